"""Every metric point a rank emits, appended to a file beside the job's checkpoints.

A rank's points wait in its actor's memory until the driver drains them. If the rank dies first they
are gone, and a retry that resumes from a newer checkpoint never runs those steps again. The journal
lets the retry re-send them (`read_journal`), so it can always resume from the newest checkpoint. On
start a rank cuts its journal back to the step it resumes from: the file always holds one history.
"""

from __future__ import annotations

import os
from pathlib import Path

from workers.protocol import MetricPoint


def journal_path(root: str | Path, rank: int) -> Path:
    return Path(root) / "metrics" / f"rank-{rank:05d}.jsonl"


def _read(path: Path) -> list[MetricPoint]:
    points = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            points.append(MetricPoint.model_validate_json(line))
        except ValueError:
            continue  # a line cut short by a kill mid-write
    return points


class MetricJournal:
    def __init__(self, root: str | Path, rank: int, resume_step: int) -> None:
        self.path = journal_path(root, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [p for p in _read(self.path) if p.step <= resume_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(p.model_dump_json() + "\n" for p in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the whole run

    def append(self, point: MetricPoint) -> None:
        self._file.write(point.model_dump_json() + "\n")

    def close(self) -> None:
        self._file.close()


def read_journal(root: str | Path, rank: int) -> list[MetricPoint]:
    """The points rank `rank` emitted, in emission order (a trailing half-written line is
    skipped)."""
    return _read(journal_path(root, rank))


__all__ = ["MetricJournal", "journal_path", "read_journal"]
