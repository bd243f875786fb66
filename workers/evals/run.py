"""One RULER-style evaluation of a model directory: every (task, length, sample), greedy answers
over the ring, scores and the summary. Collective: every rank of the ring calls `evaluate` with
the same arguments and gets the same records (generation is; see `generate`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from workers.data.tokenizer import load_tokenizer
from workers.evals.generate import greedy_generate
from workers.evals.ruler import TASKS, make_sample
from workers.evals.scoring import THRESHOLD, score, summarize


def evaluate(
    model_dir: str | Path,
    lengths: Sequence[int],
    samples: int,
    *,
    tasks: Sequence[str] | None = None,
    seed: int = 0,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    threshold: float = THRESHOLD,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, one record per sample). `progress` is called after each sample with its record."""
    from workers.models import load_pretrained

    tasks = list(tasks or TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: one of {', '.join(TASKS)}")
    if samples < 1 or not lengths or min(lengths) < 1:
        raise ValueError("an evaluation needs samples >= 1 and at least one length >= 1")
    model = load_pretrained(str(model_dir))
    tok = load_tokenizer(str(Path(model_dir).resolve()))
    stop = {tok.eos_id} if tok.eos_id is not None else set()
    records: list[dict[str, Any]] = []
    for length in sorted(lengths):
        for task in tasks:
            for index in range(samples):
                t0 = time.perf_counter()
                s = make_sample(tok, task, length, index, seed)
                ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(s.prompt)
                new = greedy_generate(
                    model, ids, s.max_new_tokens, group=group, layout=layout, stop=stop
                )
                prediction = tok.decode([t for t in new if t not in stop])
                record = {
                    "task": task,
                    "length": length,
                    "index": index,
                    "prompt": s.prompt,
                    "prompt_tokens": len(ids),
                    "answers": s.answers,
                    "prediction": prediction,
                    "score": score(prediction, s.answers),
                    "max_new_tokens": s.max_new_tokens,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
                records.append(record)
                if progress is not None:
                    progress(record)
    return summarize(records, threshold), records
