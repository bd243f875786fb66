"""`model.kind: hf` rules read from config.json (workers/config/pretrained.py, rules.py) that the
fast tier lacked: RoPE coverage, sliding windows, GQA shape, and the overrides `pretrained_config`
applies. Everything reads a config.json written here (no weights, no tokenizer) or a config dict set
on the section directly, so nothing loads a model; the expected numbers are worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from workers.config.pretrained import HFModelConfig, pretrained_config, read_config_json
from workers.config.rules import rope_coverage_warning

BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}


def _dir(tmp_path: Path, **config: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **config}))
    return str(tmp_path)


def _section(config: dict[str, Any]) -> HFModelConfig:
    """An hf model section whose config.json reads as `config` (no directory needed)."""
    section = HFModelConfig.model_construct(kind="hf", path="/nowhere")
    section.__dict__["hf_config"] = config
    return section


def _spec(model: Any, seq_len: int, evals: list[int] | None = None, ulysses: int = 1) -> Any:
    return SimpleNamespace(
        model=model,
        data=SimpleNamespace(seq_len=seq_len),
        parallel=SimpleNamespace(ulysses_size=ulysses),
        eval_context_lengths=lambda: evals or [seq_len],
    )


def test_rope_context_is_the_larger_of_the_window_and_the_scaled_pretraining_context() -> None:
    def ctx(rp: dict[str, Any], max_pos: int = 4096) -> int:
        return _section({"max_position_embeddings": max_pos, "rope_parameters": rp}).rope_context()

    assert ctx({"rope_type": "default", "rope_theta": 1e4}) == 4096
    assert (
        ctx({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}) == 8192
    )
    assert (
        ctx({"rope_type": "linear", "factor": 1.5, "original_max_position_embeddings": 2048})
        == 4096
    )
    assert ctx({"rope_type": "dynamic", "factor": 2.0}) == 8192  # original: max_position_embeddings


def test_rope_warning_only_past_what_rope_covers() -> None:
    model = SimpleNamespace(rope_context=lambda: 4096)
    assert rope_coverage_warning(_spec(model, 4096)) is None  # exactly covered
    assert rope_coverage_warning(_spec(model, 2048, [1024, 4096])) is None
    warning = rope_coverage_warning(_spec(model, 2048, [2048, 8192]))
    assert warning is not None and "up to 8192 tokens exceed the 4096" in warning


def test_sliding_window_applies_only_where_a_layer_slides() -> None:
    qwen = {"model_type": "qwen2", "sliding_window": 512, "num_hidden_layers": 4}
    on = {**qwen, "use_sliding_window": True}
    assert _section(qwen).sliding_window() is None  # use_sliding_window off
    assert _section({**on, "max_window_layers": 4}).sliding_window() is None  # no layer past it
    assert _section({**on, "max_window_layers": 3}).sliding_window() == 512
    assert (
        _section({**qwen, "layer_types": ["full_attention", "sliding_attention"]}).sliding_window()
        == 512
    )
    assert _section({"model_type": "mistral", "sliding_window": 256}).sliding_window() == 256
    assert _section({"model_type": "mistral", "sliding_window": None}).sliding_window() is None


def test_a_window_as_long_as_every_context_is_fine() -> None:
    section = _section({"model_type": "mistral", "sliding_window": 1024, "num_attention_heads": 8})
    assert section.spec_problems(_spec(section, 1024)) == []
    problems = section.spec_problems(_spec(section, 512, [512, 2048]))
    assert [p[0] for p in problems] == ["data.seq_len"] and "2048-token" in problems[0][2]
    heads = section.spec_problems(_spec(section, 1024, ulysses=3))
    assert [(p[0], p[1]) for p in heads] == [("parallel.ulysses_size", 3)]


def test_config_json_shape_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size must be a positive integer, got 0"):
        read_config_json(_dir(tmp_path, hidden_size=0))
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\) must be divisible by num_key"):
        read_config_json(_dir(tmp_path, num_key_value_heads=3))
    assert read_config_json(_dir(tmp_path))["num_key_value_heads"] == 2


def test_shape_properties_read_gqa_and_head_dim(tmp_path: Path) -> None:
    section = _section(pretrained_config(_dir(tmp_path, head_dim=16, tie_word_embeddings=True)))
    assert (section.n_heads, section.kv_heads, section.head_dim) == (8, 2, 16)
    assert section.tie_embeddings is True
    plain = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    (tmp_path / "config.json").write_text(json.dumps(plain))
    section = _section(pretrained_config(str(tmp_path)))
    assert (section.kv_heads, section.head_dim) == (8, 8)  # MHA; 64 / 8
    assert section.tie_embeddings is False


def test_pretrained_config_applies_the_overrides(tmp_path: Path) -> None:
    path = _dir(tmp_path)
    plain = pretrained_config(path)
    assert plain["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert plain["max_position_embeddings"] == 4096
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    out = pretrained_config(path, rope_scaling=llama3, max_position_embeddings=32768)
    assert out["rope_parameters"] == {
        **llama3,
        "rope_theta": 500000.0,
        "original_max_position_embeddings": 4096,
    }
    assert out["max_position_embeddings"] == 32768
    assert pretrained_config(path, rope_theta=1e6)["rope_parameters"]["rope_theta"] == 1e6


def test_llama3_high_frequency_factor_must_exceed_the_low_one() -> None:
    from pydantic import ValidationError

    from workers.config.pretrained import RopeScaling

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}
    assert RopeScaling(**llama3, high_freq_factor=2.5).high_freq_factor == 2.5
    with pytest.raises(ValidationError, match="high_freq_factor must exceed low_freq_factor"):
        RopeScaling(**llama3, high_freq_factor=2.0)


def test_a_model_directory_needs_weights_and_any_tokenizer_file(tmp_path: Path) -> None:
    from workers.config.pretrained import check_pretrained_dir

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        check_pretrained_dir(str(tmp_path))
    for name in ("tokenizer.model", "vocab.json", "tokenizer.json"):  # sentencepiece, BPE, fast
        (tmp_path / name).write_text("{}")
        check_pretrained_dir(str(tmp_path))
        (tmp_path / name).unlink()


def test_attention_dropout_is_refused(tmp_path: Path) -> None:
    from pydantic import ValidationError

    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    path = _dir(tmp_path, attention_dropout=0.0)
    assert HFModelConfig(kind="hf", path=path).n_layers == 4
    path = _dir(tmp_path, attention_dropout=0.1)
    with pytest.raises(ValidationError, match="attention_dropout must be 0"):
        HFModelConfig(kind="hf", path=path)
