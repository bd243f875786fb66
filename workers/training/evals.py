"""Needle-in-a-haystack: passkey retrieval accuracy over a (context length × depth) grid.

A sample counts as retrieved when the model's argmax at every answer position equals the key's
token, fed the true prefix (teacher forcing). That is exactly greedy decoding's exact-match: greedy
decoding produces the key iff each next-token argmax is right given the right tokens before it — and
it costs one forward pass on the ring instead of one per answer token. Prompts and answers are
tokenized with the job's tokenizer (`tokenizer_for`), so a pretrained model is asked and scored in
its own tokens.

Two numbers per cell: `passkey_acc` (exact match, the needle-in-a-haystack grid) and
`passkey_token_acc` (the fraction of answer tokens right: per digit for byte-level models). The
second moves first: a small model learning retrieval gets single digits right long before whole
keys.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from workers import metrics
from workers.config import JobSpec
from workers.data import from_windows, make_sample, sample_generator
from workers.models import tokenizer_for
from workers.training.mesh import Mesh

EVAL_SALT = 0x5EED_E7A1  # eval keys never coincide with the training stream


def _autocast(device: torch.device) -> AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def cell_name(length: int, depth: float, metric: str = metrics.PASSKEY_ACC.name) -> str:
    """One grid cell's name, in the family of `metric` (`passkey_acc` or `passkey_token_acc`)."""
    return metrics.PASSKEY_CELLS[metric].member(len=length, depth=f"{depth:.2f}")


@torch.no_grad()
def passkey_accuracy(
    model: nn.Module, spec: JobSpec, mesh: Mesh, device: torch.device
) -> dict[str, float]:
    """Collective over all ranks; every rank gets the same dict:

    {"passkey_acc": mean over cells, cell_name(L, d): exact-match accuracy,
     "passkey_token_acc": mean over cells,
     cell_name(L, d, "passkey_token_acc"): answer-token accuracy}.

    Data-parallel replicas split a cell's samples (sample i goes to replica i mod data_parallel);
    each replica's ring runs its samples together; per-sample counts of wrong and of all answer
    tokens are summed over ranks. The answer mask travels as the batch's weights, so it is sharded
    like the labels.
    """
    was_training = model.training
    model.eval()
    tokenizer = tokenizer_for(spec)
    digits = spec.data.key_digits if spec.data.kind == "passkey" else 5
    n = spec.eval.samples
    chunk = max(1, spec.train.batch_size // mesh.data_parallel)
    exact: dict[str, float] = {}
    per_token: dict[str, float] = {}
    for length in spec.eval_context_lengths():
        for depth in spec.eval.depths:
            counts = torch.zeros(
                2, n, dtype=torch.float32, device=device
            )  # [wrong, answer tokens] per sample
            mine = list(range(mesh.dp_index, n, mesh.data_parallel))
            # Every rank runs the same number of forwards (FSDP's gathers are collective over all
            # ranks): a replica with fewer samples runs its last rounds on sample 0 and ignores the
            # result.
            for start in range(
                0, math.ceil(math.ceil(n / mesh.data_parallel) / chunk) * chunk, chunk
            ):
                ids = mine[start : start + chunk]
                run = ids or [0]
                samples = [
                    make_sample(
                        length,
                        digits,
                        depth,
                        sample_generator(
                            spec.train.seed ^ EVAL_SALT, length, round(depth * 1e4), i
                        ),
                        tokenizer=tokenizer,
                    )
                    for i in run
                ]
                batch = from_windows(
                    torch.stack([s.tokens for s in samples]),
                    torch.stack([s.answer_mask() for s in samples]),
                )
                local = mesh.shard(batch, spec.parallel.layout, replicated=True).to(device)
                with _autocast(device):
                    logits = model(local.inputs, local.positions)
                if not ids:
                    continue
                answer = local.weights > 0
                miss = (logits.argmax(-1) != local.labels) & answer
                rows = torch.tensor(ids, device=device)
                counts[0, rows] = miss.sum(1).float()
                counts[1, rows] = answer.sum(1).float()
            if mesh.world > 1:
                dist.all_reduce(counts)
            wrong, total = counts
            exact[cell_name(length, depth)] = int((wrong == 0).sum()) / n
            token_cell = cell_name(length, depth, metrics.PASSKEY_TOKEN_ACC.name)
            per_token[token_cell] = float((1 - wrong / total).mean())
    model.train(was_training)
    return {
        metrics.PASSKEY_ACC.name: sum(exact.values()) / len(exact),
        **exact,
        metrics.PASSKEY_TOKEN_ACC.name: sum(per_token.values()) / len(per_token),
        **per_token,
    }
