"""Models that train on the ring: every one has `forward(tokens, positions) -> fp32 logits` and
`set_sequence_parallel(sp)`, and runs its attention through `workers.attention.ring_attention`.

`build_model(cfg, seed)` is the built-in Llama-style decoder for training from scratch (`llama.py`).
"""

from __future__ import annotations

from workers.models.llama import SequenceParallel, Transformer, attention_backend, build_model, token_losses

__all__ = ["SequenceParallel", "Transformer", "attention_backend", "build_model", "token_losses"]
