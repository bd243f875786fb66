"""Needle-in-a-haystack: passkey retrieval accuracy over a (context length × depth) grid.

A sample counts as retrieved when the model's argmax at every answer position equals the key digit,
fed the true prefix (teacher forcing). That is exactly greedy decoding's exact-match: greedy decoding
produces the key iff each next-digit argmax is right given the right digits before it — and it costs
one forward pass on the ring instead of key_digits passes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from workers.config import JobSpec
from workers.data import from_windows, make_sample, sample_generator, take_shard
from workers.training.mesh import Mesh

EVAL_SALT = 0x5EED_E7A1  # eval keys never coincide with the training stream


def _autocast(device: torch.device) -> AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def cell_name(length: int, depth: float) -> str:
    return f"passkey_acc/len={length}/depth={depth:.2f}"


@torch.no_grad()
def passkey_accuracy(model: nn.Module, spec: JobSpec, mesh: Mesh, device: torch.device) -> dict[str, float]:
    """Collective over all ranks. Returns {"passkey_acc": mean over cells, cell_name(L, d): acc} on every rank.

    Data-parallel replicas split a cell's samples (sample i goes to replica i mod data_parallel); each
    replica's ring runs its samples together; a per-sample count of wrong digits is summed over ranks.
    """
    was_training = model.training
    model.eval()
    digits = spec.data.key_digits if spec.data.kind == "passkey" else 5
    n = spec.eval.samples
    chunk = max(1, spec.train.batch_size // mesh.data_parallel)
    results: dict[str, float] = {}
    for length in spec.eval_context_lengths():
        for depth in spec.eval.depths:
            wrong = torch.zeros(n, dtype=torch.float32, device=device)
            mine = list(range(mesh.dp_index, n, mesh.data_parallel))
            for start in range(0, len(mine), chunk):
                ids = mine[start : start + chunk]
                samples = [
                    make_sample(
                        length,
                        digits,
                        depth,
                        sample_generator(spec.train.seed ^ EVAL_SALT, length, round(depth * 1e4), i),
                    )
                    for i in ids
                ]
                batch = from_windows(torch.stack([s.tokens for s in samples]))
                local = take_shard(
                    batch, dp_index=0, dp_size=1, layout=spec.parallel.layout, ring_group=mesh.ring_group
                )
                local = local.to(device)
                with _autocast(device):
                    logits = model(local.inputs, local.positions)
                answer = (local.positions >= samples[0].answer_start).to(device)  # same for every sample of a length
                miss = (logits.argmax(-1) != local.labels) & answer[None, :]
                wrong[torch.tensor(ids, device=device)] = miss.sum(1).float()
            if mesh.world > 1:
                dist.all_reduce(wrong)
            results[cell_name(length, depth)] = int((wrong == 0).sum()) / n
    cells = list(results.values())
    model.train(was_training)
    return {"passkey_acc": sum(cells) / len(cells), **results}
