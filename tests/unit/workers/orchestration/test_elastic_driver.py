"""The driver's shrink decision after a lost node (`JobDriver._shrink`), against Ray's lagging view.

Ray shows a released placement group's resources free again only once the node's raylet reports them (a moment
after the release), and a lost node's raylet never does. Read at once, the view still counts the surviving ranks as
taken, so nothing fits and the job would wait for its own shape (`elastic_try_s`) before it shrinks. Seen on the
multi-host harness: "elastic: no shape of at least 1 rank(s) fits now" right after w2 was killed.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from workers.config import JobSpec
from workers.orchestration.driver import JobDriver, Timing
from workers.parallel_dims import ParallelDims

SPEC = JobSpec.model_validate(
    {
        "name": "elastic",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "data": {"kind": "passkey", "seq_len": 256, "key_digits": 3},
        "parallel": {"ring_size": 4},
        "train": {"steps": 4},
        "resources": {"accelerator": "cpu", "cpus_per_worker": 1},
        "elastic": {"enabled": True},
    }
)


def driver(views: list[dict[str, dict[str, float]]], wait_s: float = 5.0) -> JobDriver:
    """A driver whose last group held 2 ranks on each of w1 and w2; Ray's free resources are `views`, one per
    read (the last repeats)."""
    env: Any = SimpleNamespace(job_spec=SPEC, restarts=1, delivered_through=0)
    d = JobDriver(
        env, reporter=None, cancel=threading.Event(), timing=Timing(release_wait_s=wait_s)
    )  # type: ignore[arg-type]
    d.gpu = False
    d.group = SimpleNamespace(
        assignments=[SimpleNamespace(node_id=n) for n in ("w1", "w1", "w2", "w2")]
    )  # type: ignore[assignment]
    reads = iter(views)
    last: list[dict[str, dict[str, float]]] = []

    def free() -> dict[str, dict[str, float]]:
        last[:] = [next(reads, last[0] if last else {})]
        return last[0]

    d._free = free  # type: ignore[method-assign]
    return d


def test_the_shrink_waits_for_the_released_ranks_on_the_nodes_left() -> None:
    # w2's raylet is gone but Ray still lists it (not yet declared dead), its share never comes back;
    # w1's two CPUs show free from the third read on
    stale = {"w1": {"CPU": 0.0}, "w2": {"CPU": 0.0}}
    settled = {"w1": {"CPU": 2.0}, "w2": {"CPU": 0.0}}
    d = driver([stale, stale, settled])
    reason = d._shrink(6)
    assert "resizing from 4 to 2 rank(s)" in reason, reason
    assert d.shape == ParallelDims(1, 2)


def test_a_node_declared_dead_is_not_waited_for_and_nothing_free_keeps_the_own_shape() -> None:
    d = driver([{"w1": {"CPU": 2.0}}], wait_s=30.0)  # w2 gone from the listing: no wait
    assert "resizing from 4 to 2 rank(s)" in d._shrink(6) and d.shape == ParallelDims(1, 2)
    d = driver(
        [{"w1": {"CPU": 0.0}}], wait_s=0.3
    )  # w1 taken by another job meanwhile: bounded wait
    assert "no shape of at least 1 rank(s) fits now" in d._shrink(6) and d.shape is None


def test_a_stop_to_grow_that_lands_on_the_last_step_ends_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ranks on the smaller shape were asked to stop (the job's own shape fits again) while they trained the last
    step: the job is done. Seen on the multi-host harness: the driver placed 4 ranks that trained nothing."""
    from workers.orchestration import driver as drv
    from workers.orchestration.actor import RankResult
    from workers.orchestration.recovery import ResumePlan

    states: list[tuple[str, str]] = []
    env: Any = SimpleNamespace(
        job_spec=SPEC, restarts=1, delivered_through=0, attempt=0, job_id="j1"
    )
    reporter: Any = SimpleNamespace(
        state=lambda st, reason, **kw: states.append((st.value, reason))
    )
    d = JobDriver(env, reporter, threading.Event())
    d.shape = ParallelDims(1, 2)
    placed: list[ParallelDims | None] = []
    group = SimpleNamespace(teardown=lambda: None)

    def train(g: Any, step: int) -> RankResult:
        d.growing = d.shape is not None  # the capacity check asked the smaller shape to stop
        return RankResult(SPEC.train.steps, 1.0, step, "torch", stopped=True, seconds=1.0)

    monkeypatch.setattr(drv, "init_group", lambda g, cancelled: None)
    monkeypatch.setattr(d, "resume", lambda: ResumePlan(step=2, replay=[]))
    monkeypatch.setattr(d, "_reserve", lambda step, resume: placed.append(d.shape) or group)
    monkeypatch.setattr(d, "_report_running", lambda g, step: None)
    monkeypatch.setattr(d, "_train", train)
    assert d.run() == 0
    assert placed == [ParallelDims(1, 2)], placed  # no group of 4 placed to train nothing
    assert [st for st, _ in states] == ["SUCCEEDED"], states
