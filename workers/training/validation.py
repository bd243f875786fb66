"""Held-out loss of a prepared dataset (`data.validation` > 0, or the path of a held-out dataset):
`val_loss` and `val_loss/pos=<lo>-<hi>`.

The same held-out batches at every eval (`TokensSource.validation_batches`), sharded like training
batches, forward only. Every weighted token loss is summed into a bucket by its position inside its
document (windows: inside the window); buckets are [0, 64), [64, 128), ... doubling up to seq_len,
so a model that uses its long context shows lower loss in the later buckets. Sums of loss and of
weight per bucket are all-reduced over every rank: the global token mean, as in training.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from workers import metrics as catalog
from workers.config import JobSpec
from workers.data import TokensSource
from workers.training.loss import token_losses
from workers.training.mesh import Mesh

VAL_SEQUENCES = 8  # held-out sequences per eval (at least one global batch)


def bucket_edges(seq_len: int) -> list[int]:
    """[0, 64, 128, ..., seq_len]: position buckets doubling in width."""
    edges, width = [0], 64
    while width < seq_len:
        edges.append(width)
        width *= 2
    return [*edges, seq_len]


def _autocast(device: torch.device) -> AbstractContextManager[object]:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@torch.no_grad()
def validation_loss(
    model: Any, source: TokensSource, spec: JobSpec, mesh: Mesh, device: torch.device
) -> dict[str, float]:
    """Collective over all ranks; every rank gets the same dict ({} without held-out documents)."""
    batch_size = spec.train.batch_size
    batches = source.validation_batches(batch_size, max(1, -(-VAL_SEQUENCES // batch_size)))
    if not batches:
        return {}
    was_training = model.training
    model.eval()
    edges = torch.tensor(bucket_edges(spec.data.seq_len), device=device)
    sums = torch.zeros(
        2, len(edges) - 1, dtype=torch.float64, device=device
    )  # [loss, weight] per bucket
    for batch in batches:
        local = mesh.shard(batch, spec.parallel.layout).to(device)
        positions = local.positions if local.doc_positions is None else local.doc_positions
        with _autocast(device):
            hidden = model.features(local.inputs, positions, cu_seqlens=local.cu_seqlens)
        losses = token_losses(hidden, model.output_weight, local.labels)
        where = torch.bucketize(positions.expand_as(losses), edges, right=True) - 1
        w = local.weights.double()
        sums[0].index_add_(0, where.reshape(-1), (losses.double() * w).reshape(-1))
        sums[1].index_add_(0, where.reshape(-1), w.reshape(-1))
    if mesh.world > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    out = {catalog.VAL_LOSS.name: float(sums[0].sum() / sums[1].sum().clamp_min(1e-12))}
    for b in range(len(edges) - 1):
        if sums[1, b] > 0:
            out[catalog.VAL_LOSS_POS.member(pos=f"{int(edges[b])}-{int(edges[b + 1])}")] = float(
                sums[0, b] / sums[1, b]
            )
    return out
