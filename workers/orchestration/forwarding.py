"""Moving metric points from the rank actors' buffers to the control plane, in step order, once
each.

Global points come from rank 0 only, per-rank points (mem_peak_bytes, ...) from each rank. Every
forwarded point is recorded in `Delivered`, the watermark the resume decision uses
(`workers.orchestration.recovery`).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from workers.orchestration.recovery import Delivered
from workers.orchestration.reporter import Reporter
from workers.orchestration.reservation import RankGroup, RankLost, lost_errors, short
from workers.protocol import MetricPoint

log = logging.getLogger("ringtrain.driver")


# How long one drain waits for the ranks' buffers. A rank that answers later (a long step, a
# stalled process) keeps its call: the next drain collects that batch instead of asking again,
# so a late answer is forwarded, never dropped (its buffer was already emptied into it). Until it
# comes, the other ranks' points are held back, so that points still go out in step order.
DRAIN_WAIT_S = 10.0


class MetricForwarder:
    """Points go out in step order even when every rank answered: each rank's buffer is in step
    order, but the ranks answer a drain at slightly different moments, so one batch can end at step
    124 on rank 0 and at step 123 on rank 1, whose step-124 points then come with the next drain. A
    step goes out once every rank of the group has reported it (`_seen`); a rank's later points can
    then only be at that step or later."""

    def __init__(self, reporter: Reporter, delivered: Delivered) -> None:
        self.reporter = reporter
        self.delivered = delivered
        self._pending: dict[Any, Any] = {}  # actor -> its unanswered drain_metrics call
        self._held: list[tuple[int, int, MetricPoint]] = []  # (step, rank, point), arrival order
        self._seen: dict[Any, int] = {}  # actor -> the latest step it has reported

    def send(self, points: list[MetricPoint], *, replay: bool = False) -> None:
        for p in points:
            self.reporter.metric(p, replay=replay)
            self.delivered.record(p)

    def drain(self, group: RankGroup, *, tolerate_dead: bool = False, final: bool = False) -> None:
        """Forward what every rank buffers, in step order. A dead rank raises RankLost, after the
        live ranks' points went out (their buffers are drained already); with `tolerate_dead` it is
        skipped. A rank that does not answer within DRAIN_WAIT_S is asked nothing new, and the
        points of the ranks that did answer wait for its answer (a later drain), unless this is the
        group's last drain (`final`, `tolerate_dead`): then they go out without it. Otherwise a
        step goes out once every rank has reported it (see the class)."""
        actors = group.ranked_actors()
        refs = [self._pending.pop(a, None) or a.drain_metrics.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DRAIN_WAIT_S)
        answered = set(ready)
        lost: RankLost | None = None
        for r, (actor, ref) in enumerate(zip(actors, refs, strict=True)):
            if ref not in answered:
                self._pending[actor] = ref
                continue
            try:
                batch: list[MetricPoint] = ray.get(ref)
            except lost_errors() as e:
                if lost is None and not tolerate_dead:
                    lost = RankLost(f"rank {r} died: {short(e)}")
                    lost.__cause__ = e
                continue
            if batch:
                self._seen[actor] = max(self._seen.get(actor, -1), batch[-1].step)
            self._held += [(p.step, r, p) for p in batch if p.rank is not None or r == 0]
        last = final or tolerate_dead
        if last:  # nobody asks this group again: what it has not answered is not waited for
            for a in actors:
                self._pending.pop(a, None)
                self._seen.pop(a, None)
        self._held.sort(key=lambda t: t[:2])  # stable: a rank's points keep their order
        if last or lost is not None:  # a lost rank ends the group: salvage() collects the rest
            points, self._held = self._held, []
        else:  # only steps every rank has reached (see the class)
            floor = min(self._seen.get(a, -1) for a in actors)
            points = [t for t in self._held if t[0] <= floor]
            self._held = self._held[len(points) :]
        self.send([p for *_, p in points])
        if lost is not None:
            raise lost

    def salvage(self, group: RankGroup | None) -> None:
        """After a rank died: forward what the surviving ranks still buffer (never raises)."""
        if group is None or not group.actors or not group.assignments:
            return
        try:
            self.drain(group, tolerate_dead=True)
        except Exception as e:
            log.warning("could not collect metrics from surviving ranks: %s", short(e))
