"""Greedy generation from a prompt longer than one device: ring prefill, pass-Q decoding.

The prompt is sharded over the ring in the training layout (padded at its end to the layout's
multiple: causal attention never lets a real token see a later pad, and the pads' cache slots are
never kept), prefilled with ring attention, and each rank keeps its shard's keys and values as
its cache. The first new token comes from the logits at the prompt's last position, on the rank
that holds it. Every decode step runs the new token on every rank: each appends the token's keys
and values to its cache, but only ring rank 0 counts them (`keep`), so each token is attended
once (`workers.attention.decode`). All ranks return the same tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.attention import shard_positions
from workers.attention.layouts import _rank_world, seq_multiple
from workers.models.base import SequenceParallel
from workers.models.hf import PretrainedLM

PAD_ID = 0  # what pads the prompt to the layout's multiple: never attended, any id will do


def greedy_generate(
    model: PretrainedLM,
    prompt: list[int],
    max_new_tokens: int,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    stop: set[int] | None = None,
) -> list[int]:
    """Up to `max_new_tokens` greedy tokens after `prompt` (stopping after any id in `stop`).
    Collective over `group` (the default group when None and torch.distributed is on)."""
    from transformers import DynamicCache

    if not prompt or max_new_tokens < 1:
        raise ValueError("greedy_generate needs a non-empty prompt and max_new_tokens >= 1")
    rank, world = _rank_world(group)
    n = len(prompt)
    multiple = seq_multiple(layout, world)
    padded = -(-n // multiple) * multiple
    ids = torch.tensor(prompt + [PAD_ID] * (padded - n), dtype=torch.long)
    positions = shard_positions(padded, layout, rank, world)
    device = model.output_weight.device
    model.set_sequence_parallel(SequenceParallel(group, layout) if world > 1 else None)
    model.eval()
    cache = DynamicCache()
    logits = model.prefill(ids[positions][None].to(device), positions, cache)
    keep = positions < n
    last = (positions == n - 1).nonzero()
    token = torch.zeros(1, dtype=torch.long, device=device)
    if last.numel():
        token[0] = int(logits[0, int(last[0, 0])].argmax())
    if world > 1:  # the rank holding the prompt's last token has it: a sum over the ring
        dist.all_reduce(token, group=group)
    out: list[int] = []
    for i in range(max_new_tokens):
        out.append(int(token[0]))
        if (stop and out[-1] in stop) or i == max_new_tokens - 1:
            break
        keep = torch.cat([keep, torch.tensor([rank == 0])])
        pos = torch.tensor([n + i])
        step = model.decode_step(token[None], pos, cache, keep)
        token = step[0, -1].argmax().reshape(1)
    return out
