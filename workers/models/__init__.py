"""Models that train on the ring: every one has `forward(tokens, positions) -> fp32 logits` and
`set_sequence_parallel(sp)`, and runs its attention through `workers.attention.ring_attention`.

`build_model(cfg, seed)` is the built-in Llama-style decoder for training from scratch (`llama.py`).
"""

from __future__ import annotations

from torch import nn

from workers.config import JobSpec
from workers.models.llama import SequenceParallel, Transformer, attention_backend, build_model, token_losses


def model_for(spec: JobSpec) -> nn.Module:
    """The model a job trains, unsharded, in fp32 on CPU: what the trainer builds (one place to add a kind)."""
    return build_model(spec.model, spec.train.seed, spec.train.activation_checkpointing)


__all__ = ["SequenceParallel", "Transformer", "attention_backend", "build_model", "model_for", "token_losses"]
