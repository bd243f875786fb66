"""Bad `model.*` input against a real server: 422 naming the field, before anything is reserved.

Model directories are written by hand (config.json plus placeholder weight and tokenizer files):
validation reads config.json only, so that is all these cases need. The good directory next to them
is accepted by both routes, and `plan` sizes memory from its config.json and warns when the contexts
exceed what its RoPE settings cover.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_harness import TINY_SPEC, Server, running

GOOD_CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}


def model_dir(
    root: Path, name: str, config: Any = GOOD_CONFIG, files: tuple[str, ...] = ("w", "t")
) -> str:
    d = root / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if "w" in files:
        (d / "model.safetensors").write_bytes(b"")
    if "t" in files:
        (d / "tokenizer.json").write_text("{}")
    return str(d)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "good": model_dir(root, "good"),
        "no-config": model_dir(root, "no-config", config=None),
        "not-json": model_dir(root, "not-json", config="{oops"),
        "gpt2": model_dir(root, "gpt2", config={**GOOD_CONFIG, "model_type": "gpt2"}),
        "no-weights": model_dir(root, "no-weights", files=("t",)),
        "no-tokenizer": model_dir(root, "no-tokenizer", files=("w",)),
        "bad-heads": model_dir(root, "bad-heads", config={**GOOD_CONFIG, "num_key_value_heads": 3}),
        "dropout": model_dir(root, "dropout", config={**GOOD_CONFIG, "attention_dropout": 0.1}),
        "longrope": model_dir(
            root,
            "longrope",
            config={**GOOD_CONFIG, "rope_scaling": {"type": "longrope", "factor": 2.0}},
        ),
        "window": model_dir(
            root, "window", config={**GOOD_CONFIG, "model_type": "mistral", "sliding_window": 64}
        ),
    }


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("srv")) as s:
        yield s


def body(dirs: dict[str, str], **model: Any) -> dict[str, Any]:
    path = dirs.get(str(model.pop("dir", "good")), "/nonexistent/model-dir")
    return {**TINY_SPEC, "model": {"kind": "hf", "path": path, **model}}


# (id, model fields, field named, needle in the message)
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("missing-dir", {"dir": "missing"}, "model.path", "does not exist"),
    ("no-config", {"dir": "no-config"}, "model.path", "no config.json"),
    ("not-json", {"dir": "not-json"}, "model.path", "JSON"),
    ("unsupported-family", {"dir": "gpt2"}, "model.path", "'gpt2'"),
    ("no-weights", {"dir": "no-weights"}, "model.path", "no weights"),
    ("no-tokenizer", {"dir": "no-tokenizer"}, "model.path", "no tokenizer"),
    ("heads-not-divisible", {"dir": "bad-heads"}, "model.path", "num_key_value_heads"),
    ("attention-dropout", {"dir": "dropout"}, "model.path", "attention_dropout"),
    ("config-rope-type", {"dir": "longrope"}, "model.path", "longrope"),
    ("sliding-window", {"dir": "window"}, "data.seq_len", "sliding_window (64)"),
    ("kind-typo", {"kind": "huggingface"}, "model.kind", "'native' or 'hf'"),
    ("native-field-on-hf", {"d_model": 64}, "model.d_model", "Extra inputs"),
    ("path-missing", {"path": None}, "model.path", ""),
    (
        "rope-type",
        {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
        "model.rope_scaling.rope_type",
        "",
    ),
    (
        "rope-factor",
        {"rope_scaling": {"rope_type": "linear", "factor": 0.5}},
        "model.rope_scaling.factor",
        "",
    ),
    (
        "llama3-needs-freq-factors",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        "model.rope_scaling.low_freq_factor",
        "low_freq_factor",
    ),
    (
        "yarn-field-on-linear",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}},
        "model.rope_scaling.beta_fast",
        "yarn only",
    ),
    ("rope-theta", {"rope_theta": -1}, "model.rope_theta", ""),
    (
        "max-positions-text",
        {"max_position_embeddings": "4096"},
        "model.max_position_embeddings",
        "",
    ),
]


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/plan"])
@pytest.mark.parametrize(("name", "model", "field", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_model_input(
    srv: Server,
    dirs: dict[str, str],
    route: str,
    name: str,
    model: dict[str, Any],
    field: str,
    needle: str,
) -> None:
    spec = body(dirs, **model)
    if model.get("path", "") is None:
        del spec["model"]["path"]
    with srv.client() as c:
        r = c.post(route, json=spec)
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["field"], needle in err["message"]) == (
            422,
            "validation_error",
            field,
            True,
        ), err["message"]
        assert c.get("/v1/jobs").json()["total"] == 0
    assert srv.launcher.submits == []


def test_good_model_dir_is_planned_from_its_config(srv: Server, dirs: dict[str, str]) -> None:
    with srv.client() as c:
        r = c.post("/v1/plan", json=body(dirs))
        assert r.status_code == 200, r.text
        plan = r.json()
    # params from config.json: 2 layers of d=64, kv 32, ffn 128, tied 1000×64 embedding
    d, kvd, f, layers, vocab = 64, 32, 128, 2, 1000
    expected = layers * (2 * d * d + 2 * d * kvd + 3 * d * f + 2 * d) + vocab * d + d
    assert plan["memory"]["param_count"] == expected
