"""Scores of a RULER-style evaluation, by RULER's rules.

A sample's score is the share of its reference strings found in the greedy prediction
(case-insensitive substring: RULER's "string match all"). A length's score is the mean over tasks
of each task's mean over samples; the *effective length* is the longest evaluated length whose
score is at least the threshold (RULER's 0.856: Llama-2-7B's score at 4K, the length it was
trained for).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

THRESHOLD = 0.856


def score(prediction: str, answers: list[str]) -> float:
    """Share of `answers` that occur in `prediction`, ignoring case."""
    if not answers:
        raise ValueError("a sample needs at least one reference answer")
    said = prediction.lower()
    return sum(a.lower() in said for a in answers) / len(answers)


def summarize(records: Iterable[Mapping[str, Any]], threshold: float = THRESHOLD) -> dict[str, Any]:
    """`records`: one per sample, with task, length and score. Returns the report the CLI prints
    with `--json`: {tasks: {task: {length: mean}}, by_length: {length: mean over tasks},
    effective_length, threshold}. Lengths are JSON object keys, so strings."""
    per: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        per[r["task"]][int(r["length"])].append(float(r["score"]))
    tasks = {
        task: {str(n): sum(v) / len(v) for n, v in sorted(by.items())}
        for task, by in sorted(per.items())
    }
    lengths = sorted({n for by in per.values() for n in by})
    by_length = {}
    for n in lengths:
        means = [sum(by[n]) / len(by[n]) for by in per.values() if n in by]
        by_length[str(n)] = sum(means) / len(means)
    return {
        "tasks": tasks,
        "by_length": by_length,
        "effective_length": effective_length(by_length, threshold),
        "threshold": threshold,
    }


def effective_length(by_length: Mapping[str, float], threshold: float = THRESHOLD) -> int:
    """The longest length whose score is at least `threshold`; 0 when none is."""
    passing = [int(n) for n, s in by_length.items() if s >= threshold]
    return max(passing, default=0)
