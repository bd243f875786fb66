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
# so a late answer is forwarded, never dropped (its buffer was already emptied into it).
DRAIN_WAIT_S = 10.0


class MetricForwarder:
    def __init__(self, reporter: Reporter, delivered: Delivered) -> None:
        self.reporter = reporter
        self.delivered = delivered
        self._pending: dict[Any, Any] = {}  # actor -> its unanswered drain_metrics call

    def send(self, points: list[MetricPoint], *, replay: bool = False) -> None:
        for p in points:
            self.reporter.metric(p, replay=replay)
            self.delivered.record(p)

    def drain(self, group: RankGroup, *, tolerate_dead: bool = False) -> None:
        """Forward what every rank buffers. A dead rank raises RankLost, after the live ranks'
        points went out (their buffers are drained already); with `tolerate_dead` it is skipped.
        A rank that does not answer within DRAIN_WAIT_S is asked nothing new: its pending answer
        goes out with a later drain."""
        actors = group.ranked_actors()
        refs = [self._pending.pop(a, None) or a.drain_metrics.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DRAIN_WAIT_S)
        answered = set(ready)
        points: list[tuple[int, int, int, MetricPoint]] = []
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
            points += [
                (p.step, r, i, p) for i, p in enumerate(batch) if p.rank is not None or r == 0
            ]
        points.sort(key=lambda t: t[:3])
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
