"""Exact ring attention: softmax attention over a sequence sharded across a ring of ranks."""

from workers.attention.layouts import LAYOUTS, shard_positions, shard_sequence, unshard_sequence
from workers.attention.ring import ring_attention

__all__ = ["LAYOUTS", "ring_attention", "shard_positions", "shard_sequence", "unshard_sequence"]
