"""Models that train on the ring: every one has `forward(tokens, positions) -> fp32 logits` and
`set_sequence_parallel(sp)`, and runs its attention through `workers.attention.ring_attention`.

`build_model(cfg, seed)` is the built-in Llama-style decoder for training from scratch (`llama.py`);
`load_pretrained(path)` a Hugging Face llama/mistral/qwen2/qwen3 directory (`hf.py`, transformers'
own modeling code with ring attention plugged in); `save_pretrained(model, out_dir)` exports either
as a directory transformers reads back (`export.py`).
"""

from __future__ import annotations

from typing import TypeAlias

import torch

from workers.config import JobSpec
from workers.models.export import save_pretrained
from workers.models.hf import PretrainedLM, load_pretrained
from workers.models.llama import SequenceParallel, Transformer, attention_backend, build_model, token_losses

RingModel: TypeAlias = Transformer | PretrainedLM
"""Every model kind the trainer builds: an nn.Module with `features`, `output_weight`, `set_sequence_parallel`
and `forward`. A closed union rather than a Protocol, because callers also need it as an nn.Module (FSDP,
optimizer, checkpoints) and `materialize` dispatches on the concrete class anyway."""


def model_for(spec: JobSpec) -> RingModel:
    """The model a job trains, unsharded, in fp32 on CPU: what the trainer builds (one place to add a kind)."""
    m = spec.model
    if m.kind == "hf":
        model = load_pretrained(m.path, dtype=torch.float32, **m.overrides())
        if spec.train.activation_checkpointing == "full":
            model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    return build_model(m, spec.train.seed, spec.train.activation_checkpointing == "full")


__all__ = [
    "PretrainedLM",
    "RingModel",
    "SequenceParallel",
    "Transformer",
    "attention_backend",
    "build_model",
    "load_pretrained",
    "model_for",
    "save_pretrained",
    "token_losses",
]
