"""Where a job's checkpoints live and which of them are complete. No torch.

A checkpoint is a directory `step-NNNNNN` under the job's checkpoint root; it counts only once
its completion marker (`state.pt`, the last file written) exists. The trainer writes and reads
them (`workers.training.checkpoint`); the control plane lists them without loading torch, to
check `init_from` at submission.
"""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "state.pt"  # the completion marker: the last file written


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def list_steps(root: str | Path) -> list[int]:
    """Completed checkpoint steps in `root`, ascending (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(root: str | Path) -> int | None:
    steps = list_steps(root)
    return steps[-1] if steps else None
