"""The metrics journal: one history per rank, cut back on resume, robust to a line cut short by a kill."""

from __future__ import annotations

from pathlib import Path

from workers.protocol import MetricPoint
from workers.training.journal import MetricJournal, journal_path, read_journal


def _p(step: int, value: float, rank: int | None = None) -> MetricPoint:
    return MetricPoint(
        step=step,
        name="loss" if rank is None else "mem_peak_bytes",
        value=value,
        rank=rank,
        time=1.0 + step,
    )


def test_resume_cuts_the_journal_back_and_keeps_one_history(tmp_path: Path) -> None:
    j = MetricJournal(tmp_path, 0, resume_step=0)
    for s in range(1, 8):
        j.append(_p(s, 10.0 - s))
        j.append(_p(s, 100.0 + s, rank=0))
    j.close()
    assert [p.step for p in read_journal(tmp_path, 0)] == [s for s in range(1, 8) for _ in range(2)]
    j = MetricJournal(tmp_path, 0, resume_step=5)  # a retry resumes from the checkpoint at 5
    j.append(_p(6, 3.5))
    j.close()
    points = read_journal(tmp_path, 0)
    assert [(p.step, p.value) for p in points if p.rank is None] == [
        (s, 10.0 - s) for s in range(1, 6)
    ] + [(6, 3.5)]
    assert max(p.step for p in points if p.rank == 0) == 5


def test_a_line_cut_short_is_skipped(tmp_path: Path) -> None:
    j = MetricJournal(tmp_path, 3, resume_step=0)
    j.append(_p(1, 2.5, rank=3))
    j.close()
    with open(journal_path(tmp_path, 3), "a") as f:
        f.write('{"step": 2, "name": "mem_pe')  # killed mid-write
    assert [(p.step, p.value, p.rank) for p in read_journal(tmp_path, 3)] == [(1, 2.5, 3)]
    assert read_journal(tmp_path, 7) == []
