"""Exact ring attention: softmax attention over a sequence sharded across a ring of ranks.

Layout of the package (each piece small, after ring-flash-attention's shape): `layouts` (how a
sequence is split), `plan` (which block each ring step computes — the only place layouts differ),
`kernels` (block attention with log-sum-exp, one interface, several backends), `merge` (online
softmax), `comm` (the ring exchange), `varlen` (packed documents as one variable-length kernel call
per step: flash-attn's varlen kernels on CUDA), `ring` (the autograd function tying them together),
`ulysses` (Ulysses × ring: all-to-all over heads around the ring).
"""

from workers.attention.kernels import attention_backend
from workers.attention.layouts import LAYOUTS, shard_positions, shard_sequence, unshard_sequence
from workers.attention.ring import ring_attention
from workers.attention.ulysses import (
    usp_attention,
    usp_group_ranks,
    usp_shard_positions,
    usp_shard_sequence,
    usp_unshard_sequence,
)

__all__ = [
    "LAYOUTS",
    "attention_backend",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
    "usp_attention",
    "usp_group_ranks",
    "usp_shard_positions",
    "usp_shard_sequence",
    "usp_unshard_sequence",
]
