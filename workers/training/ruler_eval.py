"""RULER-style tasks inside a training job (`eval.suites: [ruler]`), scored on the ring.

The tasks and samples are `workers.evals.ruler`'s (the same questions `ringtrain eval` asks, in the
job's own tokens). A sample is scored by teacher forcing, like the passkey grid: the prompt and the
reference answers (joined by ", ") run through the ring in one forward pass, and an answer counts
as found when the argmax at each of its tokens is that token. That is greedy decoding's exact match
per answer, in one forward instead of one per generated token; it is stricter than `ringtrain
eval`'s substring match (an answer phrased differently, or given in another order, is missed), so
a job's curve is a lower bound of what the offline evaluation reports for the same model.

Metrics: `ruler/<task>/len=<L>` (mean over samples of the share of answers found),
`ruler/len=<L>` (mean over tasks) and `effective_length` (the longest length whose mean is at
least RULER's threshold, 0 when none is).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from workers import metrics
from workers.config import JobSpec
from workers.data import from_windows
from workers.data.tokenizer import Tokenizer
from workers.evals.ruler import TASKS, make_sample
from workers.evals.scoring import THRESHOLD, effective_length
from workers.models import tokenizer_for
from workers.training.evals import EVAL_SALT, _autocast
from workers.training.mesh import Mesh

MAX_ANSWERS = 16  # more reference strings than any task has


def ruler_window(
    tok: Tokenizer, task: str, length: int, index: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sample `index` of `task` as one window of `length` + 1 tokens and its label weights: the
    label of answer j's tokens weighs j + 1, every other label 0 (padding follows the answers)."""
    budget = length + 1 - TASKS[task][1]  # the prompt leaves room for the longest answer
    sample = make_sample(tok, task, budget, index, seed)
    ids = tok.encode(sample.prompt)
    weights = torch.zeros(length, dtype=torch.float32)
    for j, answer in enumerate(sample.answers):
        if j:
            ids += tok.encode(", ")
        start = len(ids)
        ids += tok.encode(answer)
        if len(ids) > length + 1:
            raise ValueError(f"{task} at {length} tokens: the answers do not fit after the prompt")
        weights[start - 1 : len(ids) - 1] = j + 1  # label t predicts token t + 1
    window = torch.zeros(length + 1, dtype=torch.long)
    window[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    return window, weights, len(sample.answers)


@torch.no_grad()
def ruler_scores(
    model: nn.Module, spec: JobSpec, mesh: Mesh, device: torch.device
) -> dict[str, float]:
    """Collective over all ranks; every rank gets the same dict of metric values. Data-parallel
    replicas split a task's samples (sample i on replica i mod data_parallel), and every rank
    runs the same number of forwards (FSDP gathers are collective)."""
    was_training = model.training
    model.eval()
    tok = tokenizer_for(spec)
    n = spec.eval.samples
    chunk = max(1, spec.train.batch_size // mesh.data_parallel)
    seed = spec.train.seed ^ EVAL_SALT
    out: dict[str, float] = {}
    by_length: dict[str, float] = {}
    for length in spec.eval_context_lengths():
        means = []
        for task in TASKS:
            # [sample, answer]: tokens missed, tokens; answers per sample
            counts = torch.zeros(2, n, MAX_ANSWERS, device=device)
            mine = list(range(mesh.dp_index, n, mesh.data_parallel))
            rounds = math.ceil(math.ceil(n / mesh.data_parallel) / chunk)
            for start in range(0, rounds * chunk, chunk):
                ids = mine[start : start + chunk]
                rows = [ruler_window(tok, task, length, i, seed) for i in ids or [0]]
                batch = from_windows(
                    torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
                )
                local = mesh.shard(batch, spec.parallel.layout, replicated=True).to(device)
                with _autocast(device):
                    logits = model(local.inputs, local.positions)
                if not ids:
                    continue
                wrong = logits.argmax(-1) != local.labels
                which = local.weights.round().long()  # 0: no answer, j + 1: answer j
                for j in range(MAX_ANSWERS):
                    on = which == j + 1
                    counts[0, ids, j] = (wrong & on).sum(1).float()
                    counts[1, ids, j] = on.sum(1).float()
            if mesh.world > 1:
                dist.all_reduce(counts)
            # found: an answer with tokens, none of them missed (summed over every rank's shard)
            exists = counts[1] > 0
            found = ((counts[0] == 0) & exists).sum(1).float()
            score = float((found / exists.sum(1).clamp_min(1)).mean())
            out[metrics.RULER_TASK.member(task=task, len=length)] = score
            means.append(score)
        by_length[str(length)] = sum(means) / len(means)
        out[metrics.RULER_LEN.member(len=length)] = by_length[str(length)]
    out[metrics.EFFECTIVE_LENGTH.name] = float(effective_length(by_length, THRESHOLD))
    model.train(was_training)
    return out
