"""Models that train on the ring: every one has `forward(tokens, positions) -> fp32 logits` and
`set_sequence_parallel(sp)`, and runs its attention through `workers.attention.ring_attention`.

`build_model(cfg, seed)` is the built-in Llama-style decoder for training from scratch (`llama.py`);
`load_pretrained(path)` a Hugging Face llama/mistral/qwen2/qwen3 directory (`hf.py`, transformers'
own modeling code with ring attention plugged in); `save_pretrained(model, out_dir)` exports either
as a directory transformers reads back (`export.py`). Each kind is one entry in `registry.py`; every
model is a `RingModel` (`base.py`).
"""

from __future__ import annotations

from workers.config import JobSpec
from workers.models.base import RingModel, SequenceParallel
from workers.models.export import save_pretrained
from workers.models.hf import PretrainedLM, load_pretrained
from workers.models.llama import (
    Transformer,
    build_model,
    cross_entropy_per_token,
    training_attention_backend,
)
from workers.models.registry import (
    ModelKind,
    kind_for,
    kind_of,
    model_kind,
    register_model_kind,
    tokenizer_for,
)


def model_for(spec: JobSpec) -> RingModel:
    """The model a job trains, unsharded, in fp32 on CPU, weights in place (the trainer builds the
    same on `meta` and shards it: `training/materialize.py`)."""
    model: RingModel = kind_for(spec).build(spec.model, spec)
    return model


__all__ = [
    "ModelKind",
    "PretrainedLM",
    "RingModel",
    "SequenceParallel",
    "Transformer",
    "build_model",
    "cross_entropy_per_token",
    "kind_for",
    "kind_of",
    "load_pretrained",
    "model_for",
    "model_kind",
    "register_model_kind",
    "save_pretrained",
    "tokenizer_for",
    "training_attention_backend",
]
