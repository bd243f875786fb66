"""`MetricForwarder.drain` when a rank answers late: a drain that waited its DRAIN_WAIT_S for a
busy or stalled rank keeps that rank's call, and a later drain forwards its batch (the rank's
buffer was emptied into that answer, so asking again would lose it for good: `Delivered` then
vouches for the steps before the next batch, and no resume would replay them).

Ray's object refs are stood in for by refs that answer when the test says so; `ray.wait` and
`ray.get` are swapped for their equivalents on those refs (the rest of the path is the real one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import ray

from workers.orchestration import forwarding
from workers.orchestration.forwarding import MetricForwarder
from workers.orchestration.recovery import Delivered
from workers.protocol import MetricPoint


@dataclass(eq=False)
class Ref:
    batch: list[MetricPoint]
    answered: bool = False


@dataclass(eq=False)
class Rank:
    """A rank actor's buffer; `late` makes its next answer wait until the test releases it."""

    rank: int
    buffer: list[MetricPoint] = field(default_factory=list)
    calls: list[Ref] = field(default_factory=list)
    late: bool = False

    def train(self, step: int) -> None:
        if self.rank == 0:
            self.buffer.append(MetricPoint(step=step, name="loss", value=1.0 / step, time=0.0))
        self.buffer.append(
            MetricPoint(step=step, name="mem_peak_bytes", value=1e6, rank=self.rank, time=0.0)
        )

    @property
    def drain_metrics(self) -> SimpleNamespace:
        """`.remote()` as on the actor: the buffer moves into the answer."""
        return SimpleNamespace(remote=self._answer)

    def _answer(self) -> Ref:
        ref = Ref(list(self.buffer), answered=not self.late)
        self.buffer.clear()
        self.calls.append(ref)
        return ref


@dataclass
class Group:
    ranks: list[Rank]

    def ranked_actors(self) -> list[Rank]:
        return list(self.ranks)


class Reporter:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str, int | None]] = []

    def metric(self, p: MetricPoint, *, replay: bool = False) -> None:
        self.sent.append((p.step, p.name, p.rank))


@pytest.fixture
def fake_refs(monkeypatch: pytest.MonkeyPatch) -> None:
    def wait(refs: list[Ref], num_returns: int, timeout: float) -> tuple[list[Ref], list[Ref]]:
        return [r for r in refs if r.answered], [r for r in refs if not r.answered]

    def get(ref: Ref) -> list[MetricPoint]:
        assert ref.answered
        return ref.batch

    monkeypatch.setattr(forwarding.ray, "wait", wait)
    monkeypatch.setattr(forwarding.ray, "get", get)
    assert forwarding.ray is ray  # the real module, restored after the test


def test_a_late_answer_is_forwarded_by_the_next_drain_once_in_step_order(fake_refs: None) -> None:
    ranks = [Rank(0), Rank(1)]
    group, reporter = Group(ranks), Reporter()
    fwd = MetricForwarder(reporter, Delivered(2))  # type: ignore[arg-type]
    for step in (1, 2):
        for r in ranks:
            r.train(step)
    ranks[1].late = True  # rank 1 stalls: its answer (steps 1 and 2) does not come in time
    fwd.drain(group)  # type: ignore[arg-type]
    assert reporter.sent == []  # rank 0's points wait for rank 1's older ones
    ranks[1].late = False
    ranks[1].calls[-1].answered = True  # it answers now
    for r in ranks:
        r.train(3)
    fwd.drain(group)  # type: ignore[arg-type]  # collects the late answer, asks nothing new
    fwd.drain(group)  # type: ignore[arg-type]  # then asks again: step 3
    want = [(s, "loss", None) for s in (1, 2, 3)]
    want += [(s, "mem_peak_bytes", r) for s in (1, 2, 3) for r in (0, 1)]
    assert sorted(reporter.sent, key=str) == sorted(want, key=str)
    steps = [s for s, _, _ in reporter.sent]
    assert steps == sorted(steps), reporter.sent
    assert len(ranks[1].calls) == 2 and len(ranks[0].calls) == 3
    assert fwd.delivered.summary() == {"global": 2, "rank 0": 2, "rank 1": 2}


def test_the_last_drain_of_a_group_sends_what_it_holds(fake_refs: None) -> None:
    """At the group's end (`final`) a rank that never answers holds back nothing of the others."""
    ranks = [Rank(0), Rank(1)]
    group, reporter = Group(ranks), Reporter()
    fwd = MetricForwarder(reporter, Delivered(2))  # type: ignore[arg-type]
    for r in ranks:
        r.train(1)
    ranks[1].late = True
    fwd.drain(group)  # type: ignore[arg-type]
    assert reporter.sent == []
    fwd.drain(group, final=True)  # type: ignore[arg-type]
    assert reporter.sent == [(1, "loss", None), (1, "mem_peak_bytes", 0)]


def test_a_step_goes_out_only_once_every_rank_has_reported_it(fake_refs: None) -> None:
    """Ranks answer a drain at slightly different moments: rank 0's batch ends at step 2 while rank
    1's step-2 points are emitted just after its answer. Step 2 waits for them, so no point of step
    1 or 2 follows one of a later step (seen in CI: a 124 before a 123)."""
    ranks = [Rank(0), Rank(1)]
    group, reporter = Group(ranks), Reporter()
    fwd = MetricForwarder(reporter, Delivered(2))  # type: ignore[arg-type]
    for r in ranks:
        r.train(1)
    ranks[0].train(2)
    fwd.drain(group)  # type: ignore[arg-type]
    assert reporter.sent == [(1, "loss", None), (1, "mem_peak_bytes", 0), (1, "mem_peak_bytes", 1)]
    ranks[1].train(2)  # rank 1 reaches step 2 after it answered
    for r in ranks:
        r.train(3)
    fwd.drain(group)  # type: ignore[arg-type]
    fwd.drain(group, final=True)  # type: ignore[arg-type]
    steps = [s for s, _, _ in reporter.sent]
    assert steps == [1, 1, 1, 2, 2, 2, 3, 3, 3], reporter.sent
    assert len(set(reporter.sent)) == len(reporter.sent) == 9
