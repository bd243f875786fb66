"""Registry, export and shard-loading rules the dispatch tests leave open: a kind is refused when
MODEL_CONFIGS maps its name to another config class; the native kind builds (and fills its skeleton)
from the spec's seed; `save_pretrained` writes the gathered `state` it is given (a pipeline's), not
the local model's weights; only a tied LM head may be missing from a pretrained directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.trainutil import tiny_spec
from workers import config
from workers.config import ModelConfig
from workers.models import registry
from workers.models.export import save_pretrained
from workers.models.llama import build_model
from workers.models.registry import ModelKind, model_kind, register_model_kind


class _OtherConfig(ModelConfig):
    """A config class that is not the one registered below."""


def test_a_kind_with_another_config_class_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(config.MODEL_CONFIGS, "mismatch", _OtherConfig)  # type: ignore[arg-type]
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    kind = ModelKind(**{**model_kind("native").__dict__, "name": "mismatch"})  # config=ModelConfig
    with pytest.raises(ValueError, match="MODEL_CONFIGS must map it to ModelConfig"):
        register_model_kind(kind)
    assert "mismatch" not in registry.registered_kinds()


def test_native_kind_builds_from_the_spec_seed() -> None:
    spec = tiny_spec(train={"seed": 11})
    built = model_kind("native").build(spec.model, spec)
    want = build_model(spec.model, seed=11)
    other = build_model(spec.model, seed=0)
    assert not torch.equal(want.tok_emb.weight, other.tok_emb.weight)
    for (name, p), q in zip(built.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_export_writes_the_given_state(tmp_path: Path) -> None:
    """A pipeline hands the whole model's gathered weights as `state`; the model only names the
    kind. The export must hold those weights."""
    from safetensors.torch import load_file

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2)
    model = build_model(cfg, seed=1)
    state = {k: v + 0.5 for k, v in build_model(cfg, seed=2).state_dict().items()}
    out = save_pretrained(model, tmp_path / "model", state=state)
    written = load_file(out / "model.safetensors")
    torch.testing.assert_close(written["model.embed_tokens.weight"], state["tok_emb.weight"])
    torch.testing.assert_close(
        written["model.layers.0.mlp.down_proj.weight"], state["layers.0.mlp.w_down.weight"]
    )


def test_native_kind_fills_its_skeleton_from_the_spec_seed() -> None:
    """`construct` then `load_shards` (the trainer's path) gives the model `build` gives."""
    spec = tiny_spec(train={"seed": 11})
    kind = model_kind("native")
    model = kind.construct(spec.model)
    kind.load_shards(model, spec.model, spec)
    for (name, p), q in zip(
        model.named_parameters(), build_model(spec.model, 11).parameters(), strict=True
    ):
        assert torch.equal(p, q), name


def test_untied_model_needs_its_lm_head_on_disk(tmp_path: Path) -> None:
    """Only a tied head may be missing from the safetensors (checkpoints store it once, as the
    embedding); an untied model loaded from such a directory would train a random head: refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.hf_fixtures import write_checkpoint
    from workers.config import HFModelConfig
    from workers.models.hf import PretrainedLM, load_pretrained_shards

    path = write_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    cfg = HFModelConfig(kind="hf", path=str(path))
    untied = AutoConfig.from_pretrained(path, tie_word_embeddings=False)
    model = PretrainedLM(AutoModelForCausalLM.from_config(untied, dtype=torch.float32))
    assert not model.hf.config.tie_word_embeddings
    with pytest.raises(ValueError, match=r"no weights for 'lm_head\.weight'"):
        load_pretrained_shards(model, cfg, tiny_spec())
