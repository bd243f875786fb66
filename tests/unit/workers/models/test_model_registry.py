"""The model registry: one entry per `model.kind`; every site that differs per kind goes through it.

The proof that nothing else branches on the kind: a third kind, registered here the way a new one
would be (a config class in `MODEL_CONFIGS`, a model class, hooks, one `register_model_kind`), is
validated, built, built on meta and materialised, tokenized and exported through the ordinary entry
points (`JobSpec`, `model_for`, `skeleton`/`materialize`, `tokenizer_for`, `save_pretrained`),
with no other code changed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

import workers.config as config
from workers.config import MODEL_CONFIGS, HFModelConfig, JobSpec, ModelConfig
from workers.data.tokenizer import ByteTokenizer, HFTokenizer
from workers.models import (
    PretrainedLM,
    Transformer,
    build_model,
    model_for,
    registry,
    save_pretrained,
    tokenizer_for,
)
from workers.models.export import write_native
from workers.models.llama import init_shards, native_tp_plan
from workers.models.registry import ModelKind, kind_for, kind_of, model_kind, register_model_kind
from workers.training.materialize import materialize, skeleton


def test_every_configured_kind_has_one_entry_and_the_same_config_class() -> None:
    assert registry.registered_kinds() == ("native", "hf")
    assert tuple(MODEL_CONFIGS) == ("native", "hf")
    assert {"native": ModelConfig, "hf": HFModelConfig} == MODEL_CONFIGS
    for name in MODEL_CONFIGS:
        assert model_kind(name).config is MODEL_CONFIGS[name]
    assert model_kind("native").model_class is Transformer
    assert model_kind("hf").model_class is PretrainedLM


def test_the_config_half_needs_no_torch() -> None:
    """The control plane validates specs with workers.config only: the kind table is torch-free."""
    import subprocess

    check = "assert 'torch' not in sys.modules, 'torch'"
    code = f"import sys, workers.config as c; {check}; print(sorted(c.MODEL_CONFIGS))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['hf', 'native']"


def test_unknown_kinds_are_refused_naming_the_registered_ones() -> None:
    refused = r"model\.kind must be 'native' or 'hf', got 'mamba'"
    with pytest.raises(ValueError, match=refused) as err:
        JobSpec.model_validate({"name": "x", "model": {"kind": "mamba"}})
    assert err.value.errors()[0]["loc"] == ("model", "kind")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown model kind 'mamba'; registered: native, hf"):
        model_kind("mamba")


def test_kind_of_finds_the_most_derived_registered_class() -> None:
    """FSDP2 swaps a sharded model's class for a subclass; a kind may subclass another's model."""
    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2)
    model = build_model(cfg, seed=0)
    assert kind_of(model).name == "native"
    # what fully_shard does to the class
    model.__class__ = type("FSDPTransformer", (Transformer,), {})
    assert kind_of(model).name == "native"
    with pytest.raises(TypeError, match="Linear is no registered model kind's model"):
        kind_of(nn.Linear(2, 2))


def test_registration_refuses_duplicates_and_kinds_without_a_config_class() -> None:
    native = model_kind("native")
    with pytest.raises(ValueError, match="'native' is registered already"):
        register_model_kind(native)
    orphan = ModelKind(**{**native.__dict__, "name": "orphan"})
    with pytest.raises(ValueError, match="MODEL_CONFIGS must map it to ModelConfig"):
        register_model_kind(orphan)
    assert "orphan" not in registry.registered_kinds()


# --- a third kind, added the way the docs say ----------------------------------------------------


class ToyConfig(ModelConfig):
    """A toy kind's spec section: the native fields under another name."""

    kind: Literal["toy"] = "toy"  # type: ignore[assignment]


class ToyLM(Transformer):
    """The toy kind's model: the native decoder under another class (kind_of must pick toy)."""


class ToyTokenizer(ByteTokenizer):
    eos_id = 10  # "\n" separates documents: tells this tokenizer apart from the byte one


def _toy_export(
    model: ToyLM,
    state: dict[str, torch.Tensor],
    out: Path,
    max_positions: int,
) -> None:
    write_native(model, state, out, max_positions)
    (out / "toy.txt").write_text("written by the toy kind's export hook")


@pytest.fixture
def toy_kind(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(config.MODEL_CONFIGS, "toy", ToyConfig)  # type: ignore[arg-type]
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))  # restored after the test
    register_model_kind(
        ModelKind(
            name="toy",
            config=ToyConfig,
            model_class=ToyLM,
            build=lambda cfg, spec: _toy_built(cfg, spec.train.seed),
            construct=ToyLM,
            load_shards=init_shards,
            export=_toy_export,
            tokenizer=lambda cfg: ToyTokenizer(),
            tp_plan=native_tp_plan,
        )
    )
    yield


def _toy_built(cfg: ToyConfig, seed: int) -> ToyLM:
    model = ToyLM(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


TOY_SPEC = {
    "name": "toy",
    "model": {"kind": "toy", "d_model": 32, "n_layers": 2, "n_heads": 4},
    "train": {"seed": 5},
}


def test_a_third_kind_goes_through_every_dispatch_site(toy_kind: None, tmp_path: Path) -> None:
    spec = JobSpec.model_validate(TOY_SPEC)
    assert type(spec.model) is ToyConfig and kind_for(spec).name == "toy"

    built = model_for(spec)
    assert type(built) is ToyLM
    native = build_model(ModelConfig(d_model=32, n_layers=2, n_heads=4), seed=5)
    for (name, p), q in zip(built.named_parameters(), native.parameters(), strict=True):
        assert torch.equal(p, q), name  # the toy's build hook drew the native init from train.seed

    meta = skeleton(spec)
    assert type(meta) is ToyLM and all(p.device.type == "meta" for p in meta.parameters())
    materialize(meta, spec, torch.device("cpu"))
    for (name, p), q in zip(meta.named_parameters(), built.parameters(), strict=True):
        assert torch.equal(p, q), name  # load_shards filled what build drew

    tok = tokenizer_for(spec)
    assert type(tok) is ToyTokenizer and tok.eos_id == 10

    out = save_pretrained(built, tmp_path / "model")
    assert (out / "toy.txt").read_text() == "written by the toy kind's export hook"
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def test_materialize_refuses_a_model_of_another_kind(toy_kind: None) -> None:
    spec = JobSpec.model_validate(TOY_SPEC)
    native_spec = {**TOY_SPEC, "model": {**TOY_SPEC["model"], "kind": "native"}}
    native = skeleton(JobSpec.model_validate(native_spec))
    with pytest.raises(TypeError, match=r"model\.kind 'toy' trains a ToyLM, not a Transformer"):
        materialize(native, spec, torch.device("cpu"))


def test_the_built_in_kinds_tokenize_as_before(tmp_path: Path) -> None:
    from tests.support.hf_fixtures import write_checkpoint

    assert type(tokenizer_for(JobSpec(name="n"))) is ByteTokenizer
    src = write_checkpoint(tmp_path / "q", "qwen2")
    hf_spec = {"name": "h", "model": {"kind": "hf", "path": str(src)}}
    tok = tokenizer_for(JobSpec.model_validate(hf_spec))
    assert isinstance(tok, HFTokenizer) and tok.path == str(src)
