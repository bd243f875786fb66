"""The one resume decision: after a lost rank, or in a driver resubmitted after its predecessor
died.

Two facts decide it. The checkpoints on disk: training always continues from the newest complete one
(never a checkpoint deleted to steer it). And `Delivered`, the watermark of what the control plane
holds or will hold: the driver records every point it forwards, and a resubmitted driver starts from
the control plane's own count. Points between the watermark and the checkpoint were emitted by ranks
that are gone; every rank wrote them to its metrics journal before emitting them
(`workers.training.journal`), and a checkpoint at step k implies all points of steps ≤ k were
emitted, so the plan replays them from there. Replays are flagged: the control plane skips the ones
it already holds, so the watermark only has to be a lower bound. Points after the checkpoint are
superseded by the state report that carries `resume_step` and are computed again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workers.checkpoint_layout import latest_step
from workers.protocol import MetricPoint
from workers.training.journal import read_journal


class Delivered:
    """Per series (the global one, rank None, and each rank's own): every point of
    steps ≤ `through` is delivered.

    A series' newest forwarded step may be incomplete (a drain can fall between two points of one
    step), so recording a point of step s only vouches for steps < s."""

    def __init__(self, world: int, through: int = 0) -> None:
        self.world = world
        self.reset(through)

    def reset(self, through: int) -> None:
        self._through: dict[int | None, int] = {
            None: through,
            **{r: through for r in range(self.world)},
        }

    def record(self, point: MetricPoint) -> None:
        self._through[point.rank] = max(self._through.get(point.rank, 0), point.step - 1)

    def holds(self, point: MetricPoint) -> bool:
        return point.step <= self._through.get(point.rank, 0)

    def summary(self) -> dict[str, int]:
        return {("global" if k is None else f"rank {k}"): v for k, v in self._through.items()}


@dataclass(frozen=True)
class ResumePlan:
    step: int  # the checkpoint to continue from (0: from scratch)
    replay: list[MetricPoint]  # journal points after the watermark, through `step`, in step order
    ran_before: bool = (
        False  # an earlier run of this job wrote metrics here (its later points must be superseded)
    )


def plan_resume(checkpoint_dir: str | Path, delivered: Delivered) -> ResumePlan:
    step = latest_step(checkpoint_dir) or 0
    found: list[tuple[int, int, int, MetricPoint]] = []
    ran_before = False
    for r in range(delivered.world):
        for i, p in enumerate(read_journal(checkpoint_dir, r)):
            ran_before = True
            own = p.rank == r or (p.rank is None and r == 0)  # global series come from rank 0 only
            if own and p.step <= step and not delivered.holds(p):
                found.append((p.step, r, i, p))
    found.sort(key=lambda t: t[:3])
    return ResumePlan(step=step, replay=[p for *_, p in found], ran_before=ran_before)
