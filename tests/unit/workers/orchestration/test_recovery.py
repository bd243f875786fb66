"""The one resume decision (`workers.orchestration.recovery`) and the store's side of it (replays held once).

The decision never deletes a checkpoint: it resumes from the newest complete one and replays, from the ranks'
journals, exactly the points the control plane may lack through that step.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.db import make_engine, migrate
from service.store import Store
from tests.support.api_harness import TINY_SPEC
from workers.config import JobSpec
from workers.orchestration.recovery import Delivered, plan_resume
from workers.protocol import JobState, MetricItem, MetricPoint, StateItem
from workers.training.checkpoint import list_steps, step_dir
from workers.training.journal import MetricJournal

GLOBAL = ("loss", "lr")


def _emit_steps(root: Path, world: int, steps: range) -> None:
    """What `Trainer` journals: global points on rank 0, one per-rank point on every rank, each step."""
    journals = [MetricJournal(root, r, steps.start - 1) for r in range(world)]
    for s in steps:
        for name in GLOBAL:
            journals[0].append(MetricPoint(step=s, name=name, value=s + 0.5, time=time.time()))
        for r in range(world):
            journals[r].append(
                MetricPoint(step=s, name="mem_peak_bytes", value=1e6 + r, rank=r, time=time.time())
            )
    for j in journals:
        j.close()


def _checkpoint(root: Path, step: int) -> None:
    d = step_dir(root, step)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    (d / "state.pt").write_bytes(b"x")


def _keys(points: list[MetricPoint]) -> list[tuple[int, str, int | None]]:
    return [(p.step, p.name, p.rank) for p in points]


def test_resumes_from_the_newest_checkpoint_and_replays_what_was_not_delivered(
    tmp_path: Path,
) -> None:
    _emit_steps(tmp_path, 3, range(1, 13))
    for s in (5, 10):
        _checkpoint(tmp_path, s)
    delivered = Delivered(3)
    # the driver forwarded: global points through step 7 (step 7 only in part), rank 1 through 9, others nothing
    delivered.record(MetricPoint(step=7, name="loss", value=0, time=0))
    delivered.record(MetricPoint(step=9, name="mem_peak_bytes", value=0, rank=1, time=0))
    plan = plan_resume(tmp_path, delivered)
    assert plan.step == 10 and list_steps(tmp_path) == [5, 10]  # nothing deleted
    want = sorted(
        [
            (s, n, None) for s in range(7, 11) for n in GLOBAL
        ]  # step 7 replayed: it may have gone out in part
        + [(s, "mem_peak_bytes", 0) for s in range(1, 11)]
        + [(s, "mem_peak_bytes", 1) for s in range(9, 11)]
        + [(s, "mem_peak_bytes", 2) for s in range(1, 11)],
        key=lambda k: (k[0], -1 if k[2] is None else k[2], k[1]),
    )
    got = _keys(plan.replay)
    assert sorted(got, key=lambda k: (k[0], -1 if k[2] is None else k[2], k[1])) == want
    assert [k[0] for k in got] == sorted(k[0] for k in got)  # in step order
    assert len(got) == len(set(got))


def test_watermark_past_the_checkpoint_replays_nothing(tmp_path: Path) -> None:
    _emit_steps(tmp_path, 2, range(1, 9))
    _checkpoint(tmp_path, 5)
    plan = plan_resume(
        tmp_path, Delivered(2, through=7)
    )  # a resubmitted driver: the store holds through 7
    assert (
        plan.step == 5 and plan.replay == []
    )  # points 6..7 are superseded by resume_step=5 and run again


def test_no_checkpoint_starts_over(tmp_path: Path) -> None:
    _emit_steps(tmp_path, 2, range(1, 4))
    plan = plan_resume(tmp_path, Delivered(2))
    # an earlier run got this far without a checkpoint (e.g. Kueue preempted it): its points 1..3 are superseded
    assert plan.step == 0 and plan.replay == [] and plan.ran_before
    assert not plan_resume(
        tmp_path / "fresh", Delivered(2)
    ).ran_before  # a job's first run supersedes nothing


@pytest.fixture
def store(tmp_path: Path) -> Store:
    engine = make_engine(f"sqlite:///{tmp_path}/store.db")
    migrate(engine)
    return Store(engine)


def _item(
    seq: int, step: int, name: str, rank: int | None = None, replay: bool = False
) -> MetricItem:
    return MetricItem(
        seq=seq, step=step, name=name, value=float(step), rank=rank, time=time.time(), replay=replay
    )


def test_store_skips_replays_it_holds_and_keeps_the_rest(store: Store) -> None:
    job = store.jobs.create("alice", JobSpec.model_validate(TINY_SPEC), "tok")
    store.metrics.apply_report(
        job.id, [_item(1, 1, "loss"), _item(2, 1, "mem_peak_bytes", rank=0), _item(3, 2, "loss")]
    )
    # a retry replays steps 1..3: keys already held are acknowledged and skipped, new ones stored, in one batch
    res = store.metrics.apply_report(
        job.id,
        [
            _item(4, 1, "loss", replay=True),
            _item(5, 1, "mem_peak_bytes", rank=0, replay=True),
            _item(6, 2, "loss", replay=True),
            _item(7, 2, "mem_peak_bytes", rank=0, replay=True),
            _item(8, 3, "loss", replay=True),
            _item(9, 3, "loss", replay=True),  # twice in one batch: stored once
            StateItem(
                seq=10, state=JobState.RETRYING, time=time.time(), resume_step=3, reason="rank lost"
            ),
            _item(11, 3, "loss"),  # not a replay: a point computed again after the resume is stored
        ],
    )
    assert res.acked_seq == 11
    keys = [(p.step, p.name, p.rank) for p in store.metrics.points(job.id)]
    assert keys == [(1, "loss", None), (1, "mem_peak_bytes", 0), (2, "loss", None), (2, "mem_peak_bytes", 0),
                    (3, "loss", None), (3, "loss", None)]  # fmt: skip


def test_delivered_through_is_a_lower_bound(store: Store) -> None:
    job = store.jobs.create(
        "a", JobSpec.model_validate({**TINY_SPEC, "parallel": {"ring_size": 2}}), "tok"
    )
    assert store.metrics.delivered_through(job.id, 2) == 0
    items = [_item(i + 1, s, n, r) for i, (s, n, r) in enumerate(
        [(1, "loss", None), (1, "m", 0), (1, "m", 1), (2, "loss", None), (2, "m", 0), (2, "m", 1), (3, "loss", None)]
    )]  # fmt: skip
    store.metrics.apply_report(job.id, items)
    assert (
        store.metrics.delivered_through(job.id, 2) == 1
    )  # rank 0/1 newest is 2, which may be partial: 1 is certain
