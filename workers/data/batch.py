"""A global batch and how one rank takes its part of it.

The global batch of a step is a pure function of (data spec, seed, step). Labels are shifted on the
global sequence (tokens[:, 1:]) *before* the sequence is sharded over the ring, so the label of the
last token of a shard is the first token of the next shard, wherever that lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.attention import shard_positions, shard_sequence


@dataclass
class Batch:
    """`inputs`, `labels`, `weights` are [batch, seq]; `positions` [seq] are global position ids."""

    inputs: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    positions: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(t.to(device, non_blocking=True) for t in (self.inputs, self.labels, self.weights, self.positions))
        )


def from_windows(windows: torch.Tensor, weights: torch.Tensor | None = None) -> Batch:
    """[B, seq_len + 1] token windows (and optional per-label weights [B, seq_len]) → a global batch."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    if weights is None:
        weights = torch.ones(labels.shape, dtype=torch.float32)
    return Batch(inputs.contiguous(), labels.contiguous(), weights.float(), torch.arange(inputs.shape[1]))


def take_shard(
    batch: Batch, *, dp_index: int, dp_size: int, layout: str, ring_group: dist.ProcessGroup | None
) -> Batch:
    """This rank's part: the rows of its data-parallel replica, the sequence shard of its ring rank.

    `ring_group=None` means no sequence parallelism (the whole sequence stays local). No communication.
    """
    rows = batch.inputs.shape[0]
    if rows % dp_size:
        raise ValueError(f"global batch of {rows} is not divisible by data_parallel={dp_size}")
    per = rows // dp_size
    sl = slice(dp_index * per, (dp_index + 1) * per)
    if ring_group is None:
        return Batch(batch.inputs[sl], batch.labels[sl], batch.weights[sl], batch.positions)
    rank, world = dist.get_rank(ring_group), dist.get_world_size(ring_group)
    pick = lambda t: shard_sequence(t[sl], 1, layout, ring_group)
    pos = shard_positions(batch.inputs.shape[1], layout, rank, world)
    return Batch(pick(batch.inputs), pick(batch.labels), pick(batch.weights), pos)
