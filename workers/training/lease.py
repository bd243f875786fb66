"""Who may write a job's checkpoint directory: the newest attempt, and nobody else (fencing).

A network partition can cut off ranks that are still alive: the driver declares them lost and
resumes elsewhere, while they keep training and writing checkpoints and journal lines into the same
directory (a split brain). Each reservation takes the lease with a fresh token before it plans its
resume; every rank checks, after each step and before any checkpoint or export, that the lease is
still its own, and stops with `Fenced` otherwise. A fenced rank writes nothing more: at worst the
step it was in, never a rotation of the checkpoints its successor reads.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

LEASE_FILE = "LEASE"


class Fenced(RuntimeError):
    """A newer attempt of this job owns its checkpoint directory: this one must stop writing."""


@dataclass(frozen=True)
class Lease:
    path: Path
    token: str

    @classmethod
    def take(cls, root: str | Path, label: str) -> Lease:
        """Become the directory's only writer (atomic replace; earlier holders notice at their next
        check)."""
        path = Path(root) / LEASE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        token = f"{label}-{uuid.uuid4().hex[:12]}"
        tmp = path.with_name(f".{LEASE_FILE}.{token}")
        tmp.write_text(token)
        os.replace(tmp, path)
        return cls(path, token)

    def held(self) -> bool:
        try:
            return self.path.read_text() == self.token
        except FileNotFoundError:
            return False

    def check(self) -> None:
        if not self.held():
            raise Fenced(
                f"checkpoint directory {self.path.parent} now belongs to a newer attempt; "
                "this one stops"
            )
