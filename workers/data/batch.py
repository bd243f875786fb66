"""A global batch and how one rank takes its part of it.

The global batch of a step is a pure function of (data spec, seed, step). Labels are shifted on the
global sequence (tokens[:, 1:]) *before* the sequence is sharded over the ring, so the label of the
last token of a shard is the first token of the next shard, wherever that lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.attention import (
    shard_positions,
    shard_sequence,
    usp_shard_positions,
    usp_shard_sequence,
)
from workers.data.balance import replica_rows


@dataclass
class Batch:
    """`inputs`, `labels`, `weights` are [batch, seq]; `positions` [seq] are global position ids.

    Packed documents (`data.pack: documents`) add `cu_seqlens`, the document boundaries of every row
    in flash-attn's varlen convention over the rows of this batch ([0, …, S, …, rows·S], int32,
    global sequence positions: the same on every ring rank), and `doc_positions` [batch, seq], the
    RoPE positions, restarting at 0 in every document.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    doc_positions: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return Batch(
            move(self.inputs),
            move(self.labels),
            move(self.weights),
            move(self.positions),
            cu_seqlens=None if self.cu_seqlens is None else move(self.cu_seqlens),
            doc_positions=None if self.doc_positions is None else move(self.doc_positions),
        )


def select_cu_seqlens(cu_seqlens: torch.Tensor, rows: list[int], seq_len: int) -> torch.Tensor:
    """The varlen boundaries of the batch made of `rows` (in that order), renumbered from 0: each
    row's segments (a segment belongs to the row it starts in), one after the other."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    owner = cu[:-1] // seq_len
    picked = torch.cat([lengths[owner == r] for r in rows])
    return torch.cat([torch.zeros(1, dtype=torch.int64), picked.cumsum(0)]).to(torch.int32)


def from_windows(windows: torch.Tensor, weights: torch.Tensor | None = None) -> Batch:
    """[B, seq_len + 1] token windows (and optional per-label weights [B, seq_len]) → a global
    batch."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    if weights is None:
        weights = torch.ones(labels.shape, dtype=torch.float32)
    return Batch(
        inputs.contiguous(), labels.contiguous(), weights.float(), torch.arange(inputs.shape[1])
    )


def take_shard(
    batch: Batch,
    *,
    dp_index: int,
    dp_size: int,
    layout: str,
    ring_group: dist.ProcessGroup | None,
    ulysses_group: dist.ProcessGroup | None = None,
) -> Batch:
    """This rank's part: the rows of its data-parallel replica, the sequence shard of its ring rank.

    The replica's rows are `balance.replica_rows`'s: balanced for packed documents, a contiguous
    block otherwise. `ring_group=None` means no sequence parallelism (the whole sequence stays
    local). With a `ulysses_group` (Ulysses x ring), the shard is `usp_shard_positions`'s. No
    communication. `cu_seqlens` stay global in the sequence (every ring rank gets the same),
    restricted to the replica's rows.
    """
    seq_len = batch.inputs.shape[1]
    mine = replica_rows(batch, dp_size)[dp_index]
    sel = torch.tensor(mine, dtype=torch.long)
    cu = None if batch.cu_seqlens is None else select_cu_seqlens(batch.cu_seqlens, mine, seq_len)
    if ring_group is None and ulysses_group is None:
        pick = lambda t: t[sel]
        pos = batch.positions
    elif ulysses_group is None:
        rank, world = dist.get_rank(ring_group), dist.get_world_size(ring_group)
        pick = lambda t: shard_sequence(t[sel], 1, layout, ring_group)
        pos = shard_positions(seq_len, layout, rank, world)
    else:
        if ring_group is None:
            raise ValueError(
                "Ulysses sharding needs the ring group too (a one-rank group when ring_size is 1)"
            )
        pick = lambda t: usp_shard_sequence(t[sel], 1, layout, ulysses_group, ring_group)
        u, nu = dist.get_rank(ulysses_group), dist.get_world_size(ulysses_group)
        r, nr = dist.get_rank(ring_group), dist.get_world_size(ring_group)
        pos = usp_shard_positions(seq_len, layout, u, nu, r, nr)
    doc_pos = None if batch.doc_positions is None else pick(batch.doc_positions)
    return Batch(pick(batch.inputs), pick(batch.labels), pick(batch.weights), pos, cu, doc_pos)
