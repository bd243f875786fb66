"""Orchestration end to end on a real local Ray head: Jobs API launcher → driver → rank actors → report receiver.

The report receiver (tests.support.ray_fixtures.ReportReceiver) implements the API's report semantics, so these tests do
not depend on the control plane. Tiny models (d_model 32, 1 layer, seq 128): a step takes a fraction of a second.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from service.launcher import DriverStatus, LaunchRequest
from service.local_ray import RayHead
from service.ray_jobs import RayJobLauncher, submission_id_for
from tests.integration.test_faults import each_key_once
from tests.support.ray_fixtures import ReportReceiver, ray_state
from workers.config import JobSpec
from workers.orchestration.reporter import Reporter
from workers.protocol import JobState, MetricPoint

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def tiny_spec(**over: Any) -> JobSpec:
    base: dict[str, Any] = {
        "name": "tiny",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "data": {"kind": "passkey", "seq_len": 128, "key_digits": 3},
        "parallel": {"ring_size": 2},
        "train": {"steps": 8, "lr": 1e-3},
        "checkpoint": {"every_steps": 4},
        "eval": {"enabled": False},
        "max_restarts": 1,
    }
    for k, v in over.items():
        same_kind = isinstance(base.get(k), dict) and v.get("kind", base[k].get("kind")) == base[
            k
        ].get("kind")
        merge = isinstance(v, dict) and same_kind
        base[k] = {**base[k], **v} if merge else v
    return JobSpec.model_validate(base)


class Harness:
    def __init__(self, head: RayHead, receiver: ReportReceiver, tmp: Path) -> None:
        self.head = head
        self.receiver = receiver
        self.launcher = RayJobLauncher(head.jobs_url, auth_token=head.auth_token)
        self.tmp = tmp

    def submit(self, job_id: str, spec: JobSpec, *, placement_timeout_s: float = 60.0) -> str:
        self.receiver.add_job(job_id, token=f"ingest-{job_id}")
        return self.launcher.submit(
            LaunchRequest(
                job_id=job_id,
                spec=spec,
                control_url=self.receiver.url,
                ingest_token=f"ingest-{job_id}",
                checkpoint_dir=str(self.tmp),
                placement_timeout_s=placement_timeout_s,
            )
        )

    def wait_driver(self, sid: str, timeout_s: float = 60) -> DriverStatus:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.launcher.status(sid).status
            if st.finished:
                return st
            time.sleep(0.5)
        raise TimeoutError(
            f"Ray job {sid} still {st} after {timeout_s}s:\n{self.launcher.logs(sid)[-3000:]}"
        )

    def wait_for(self, job_id: str, pred: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.receiver.lock:
                if pred(self.receiver.jobs[job_id]):
                    return
            time.sleep(0.2)
        job = self.receiver.jobs[job_id]
        raise TimeoutError(
            f"{what} not seen in {timeout_s}s; states {[s['state'] for s in job.states]}, "
            f"logs {[x['line'] for x in job.logs][-10:]}"
        )

    def finish(self, job_id: str, sid: str, timeout_s: float = 120) -> dict[str, Any]:
        try:
            return self.receiver.wait_state(job_id, TERMINAL, timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"{e}\nRay status {self.launcher.status(sid)}\n{self.launcher.logs(sid)[-4000:]}"
            ) from e


@pytest.fixture()
def harness(ray_head: RayHead, report_receiver: ReportReceiver, tmp_path: Path) -> Harness:
    return Harness(ray_head, report_receiver, tmp_path)


def losses(job: Any) -> list[int]:
    return [p["step"] for p in job.points if p["name"] == "loss"]


def rank_pids(job: Any) -> dict[int, int]:
    out = {}
    for item in job.logs:
        m = re.search(r"rank (\d+) -> .* pid (\d+)", item["line"])
        if m:
            out[int(m.group(1))] = int(m.group(2))
    return out


def job_pgs(head: RayHead, job_id: str) -> list[dict[str, Any]]:
    return [
        pg
        for pg in ray_state(head, "placement_groups")
        if pg.get("name", "").startswith(f"rt-{job_id}-")
    ]


def job_actors(head: RayHead, job_id: str) -> list[dict[str, Any]]:
    return [
        a for a in ray_state(head, "actors") if (a.get("name") or "").startswith(f"rt-{job_id}-")
    ]


# -- success --------------------------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_two_rank_job_succeeds_in_order_and_trains_on_while_the_control_plane_is_away(
    harness: Harness,
) -> None:
    """One 2-rank job: resubmitting it is idempotent; the receiver (the control plane) goes away
    for 4 s a second or so after step 1 and comes back on the same port; the job trains on meanwhile
    and succeeds, and every item arrives exactly once, in sequence order, per rank where it is per
    rank. Long enough that training is still running when the receiver goes away: 150 steps take
    ~30 s on 2 loaded cores and still 3-6 s at the ~20-40 ms an idle step takes."""
    steps = 150
    spec = tiny_spec(train={"steps": steps}, checkpoint={"every_steps": 50})
    sid = harness.submit("ok1", spec)
    assert sid == submission_id_for("ok1", 0)
    assert harness.submit("ok1", spec) == sid  # idempotent resubmission: same Ray job, no error
    harness.wait_for("ok1", lambda j: len(losses(j)) >= 1, 120, "first loss")
    harness.receiver.down()
    t_down = time.time()
    time.sleep(4)
    t_up = time.time()
    harness.receiver.up()  # same port
    final = harness.finish("ok1", sid)
    assert final["state"] == "SUCCEEDED", final
    assert harness.wait_driver(sid) == DriverStatus.SUCCEEDED

    job = harness.receiver.jobs["ok1"]
    assert [s["state"] for s in job.states] == ["PLACING", "RUNNING", "SUCCEEDED"]
    assert "waiting for resources" in job.states[0]["reason"]
    running = job.states[1]
    assert [p["rank"] for p in running["placement"]] == [0, 1]
    assert all(p["device"] == "cpu" and p["node_id"] for p in running["placement"])
    assert running["metadata"]["dist_backend"] == "gloo"
    assert running["metadata"]["attention_backend"]
    # Every item arrived exactly once and in sequence order; metric steps never go backwards.
    assert job.arrival == list(range(1, len(job.arrival) + 1))
    assert losses(job) == list(range(1, steps + 1))
    each_key_once(job.points, spec.model_dump(mode="json"))  # each (step, name, rank) once
    step_order = [p["step"] for p in job.points]
    assert step_order == sorted(step_order)
    names = Counter(p["name"] for p in job.points)
    per_rank = ("mem_peak_bytes", "state_bytes")
    for name in per_rank:
        assert names[name] == 2 * steps, name  # per rank, both ranks, every step
        assert {p["rank"] for p in job.points if p["name"] == name} == {0, 1}
    assert all(p.get("rank") is None for p in job.points if p["name"] not in per_rank)
    # Training went on while nobody was listening: points were measured inside the outage window.
    assert any(t_down < p["time"] < t_up for p in job.points if p["name"] == "loss")
    assert any("rank 1 ->" in x["line"] for x in job.logs)  # driver log lines are forwarded
    assert (harness.tmp / "ok1").is_dir()  # per-job checkpoint dir under the configured root

    assert "driver for job ok1" in harness.launcher.logs(sid)
    assert harness.launcher.status("never-submitted").status == DriverStatus.UNKNOWN
    nodes = harness.launcher.cluster().nodes
    assert len(nodes) == 1 and nodes[0].alive and nodes[0].cpus_total == harness.head.num_cpus
    assert not job_pgs(harness.head, "ok1") or all(
        pg["state"] == "REMOVED" for pg in job_pgs(harness.head, "ok1")
    )


# -- stages, the second one ring x tensor parallel --------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_each_stage_is_placed_on_its_own_group_and_a_tensor_stage_trains_exactly(
    harness: Harness,
) -> None:
    """One rank for a short stage, then ring 2 x tensor 2 for a longer one: the driver releases the
    first group and places the second (PLACING again) with one bundle per tensor group (so Ray keeps
    each on one node) and four rank actors; the second stage resumes from the first stage's
    checkpoint; every step reports its loss and stage once, and the curve is the one process's
    (stages reshard exactly and tensor parallelism is exact)."""
    stages = [
        {"steps": 2, "name": "short"},
        {
            "steps": 2,
            "name": "long",
            "data": {"seq_len": 256},
            "parallel": {"ring_size": 2, "tensor_size": 2},
        },
    ]
    spec = tiny_spec(
        parallel={"ring_size": 1},
        train={"steps": 4},
        checkpoint={"every_steps": 0},
        stages=stages,
    )
    sid = harness.submit("st1", spec)

    def second_running(j: Any) -> bool:
        return sum(s["state"] == "RUNNING" for s in j.states) == 2

    harness.wait_for("st1", second_running, 180, "stage 2 RUNNING")
    groups = {pg["name"].rsplit("-", 1)[1]: pg for pg in job_pgs(harness.head, "st1")}
    bundles = [b.get("unit_resources") for b in groups["s1"].get("bundles", [])]
    assert bundles == [{"CPU": 2.0}, {"CPU": 2.0}], groups["s1"]
    final = harness.finish("st1", sid, timeout_s=180)
    assert final["state"] == "SUCCEEDED", final
    job = harness.receiver.jobs["st1"]
    assert [s["state"] for s in job.states] == [
        "PLACING",
        "RUNNING",
        "PLACING",
        "RUNNING",
        "SUCCEEDED",
    ]
    first, second = (s for s in job.states if s["state"] == "RUNNING")
    assert [p["rank"] for p in first["placement"]] == [0]
    assert [p["rank"] for p in second["placement"]] == [0, 1, 2, 3]
    assert (first["metadata"]["stage"], second["metadata"]["stage"]) == (0, 1)
    assert "stage 2/2 (long)" in second["reason"] and "from step 2" in job.states[2]["reason"]
    assert losses(job) == [1, 2, 3, 4]
    assert [p["value"] for p in job.points if p["name"] == "stage"] == [0, 0, 1, 1]
    names = sorted(pg["name"] for pg in job_pgs(harness.head, "st1"))
    assert [n.rsplit("-", 1)[1] for n in names] == ["s0", "s1"], names
    assert (harness.tmp / "st1" / "model" / "config.json").is_file()

    # the reference: the same stages on one process, here (the global batch never depends on the
    # shape, so one process computes the same curve)
    from workers.training.trainer import run_training

    reference: list[Any] = []
    one = [{**st, "parallel": {"ring_size": 1}} for st in stages]
    plain = tiny_spec(
        parallel={"ring_size": 1}, train={"steps": 4}, checkpoint={"every_steps": 0}, stages=one
    )
    run_training(plain, checkpoint_dir=harness.tmp / "reference", emit=reference.append)
    want = [p.value for p in reference if p.name == "loss" and p.rank is None]
    got = [p["value"] for p in job.points if p["name"] == "loss"]
    assert len(got) == len(want) == 4
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) < 1e-5


# -- training code raises ------------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_training_exception_fails_with_message(harness: Harness) -> None:
    spec = tiny_spec(data={"kind": "text", "path": "/nonexistent/corpus.txt", "seq_len": 128})
    sid = harness.submit("bad1", spec)
    final = harness.finish("bad1", sid)
    assert final["state"] == "FAILED"
    assert "training failed" in final["reason"] and final["error"]
    assert "corpus.txt" in final["error"] or "No such file" in final["error"]
    assert harness.wait_driver(sid) == DriverStatus.FAILED


# -- does not fit --------------------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_oversized_ring_stays_placing_then_fails_after_timeout(harness: Harness) -> None:
    spec = tiny_spec(
        parallel={"ring_size": 16}, data={"seq_len": 256}
    )  # 16 CPUs wanted, the head has 8
    sid = harness.submit("big1", spec, placement_timeout_s=4)
    harness.wait_for("big1", lambda j: bool(j.states), 60, "PLACING")
    job = harness.receiver.jobs["big1"]
    placing = job.states[0]
    assert placing["state"] == "PLACING"
    assert "at most 8 of the 16" in placing["reason"]
    final = harness.finish("big1", sid, timeout_s=60)
    assert final["state"] == "FAILED"
    assert "could not place 16 rank(s)" in final["reason"] and "within 4s" in final["reason"]
    assert [s["state"] for s in job.states] == ["PLACING", "FAILED"]
    assert harness.wait_driver(sid) == DriverStatus.FAILED
    assert all(pg["state"] == "REMOVED" for pg in job_pgs(harness.head, "big1"))


# -- reporter alone (no Ray) -----------------------------------------------------------------------------------------
def _point(step: int) -> MetricPoint:
    return MetricPoint(step=step, name="loss", value=1.0 / step, time=time.time())


def test_reporter_retries_resends_on_gap_and_continues_sequence(
    report_receiver: ReportReceiver,
) -> None:
    rec = report_receiver
    job = rec.add_job("r1", "t")
    # A previous driver of this job already delivered 5 items: the new driver must continue at 6.
    job.acked = 5
    rec.down()
    rep = Reporter(rec.url, "r1", "t", interval_s=0.05, backoff_max_s=0.2)
    rep.state(JobState.PLACING, "waiting")
    for s in range(1, 51):
        rep.metric(_point(s))  # never blocks although nobody listens
    assert rep.pending() == 51
    time.sleep(0.5)
    assert rep.failures > 0
    rec.up()
    assert rep.flush(10)
    assert job.arrival == list(range(6, 57))
    assert [p["step"] for p in job.points] == list(range(1, 51))
    # The server forgets items (e.g. restored from a backup): a 409 makes the reporter resend from its acked_seq.
    with rec.lock:
        job.acked = 50
        job.points = [p for p in job.points if p["seq"] <= 50]
    rep.metric(_point(51))
    assert rep.close(10)
    assert job.points[-1]["step"] == 51 and job.points[-1]["seq"] == 51


def test_reporter_wrong_token_never_blocks_and_close_is_bounded(
    report_receiver: ReportReceiver,
) -> None:
    """metric() never touches the network: with the control plane stuck in a request (the handshake), 1000 metric
    calls all return and are all queued while the server has seen exactly one request. Then the server answers 401
    (a wrong token): close() reports failure, names the 401, and its sender thread has ended."""
    rec = report_receiver
    rec.add_job("r2", "right")
    stuck, release = threading.Event(), threading.Event()
    real = rec.handle

    def stalled(job_id: str, auth: str, body: bytes) -> tuple[int, dict[str, Any]]:
        stuck.set()
        release.wait(60)
        return real(job_id, auth, body)

    rec.handle = stalled  # type: ignore[method-assign]
    rep = Reporter(rec.url, "r2", "wrong", interval_s=0.05, backoff_max_s=0.1)
    assert stuck.wait(30), "the reporter never sent its handshake"
    queued: list[bool] = []
    producer = threading.Thread(
        target=lambda: queued.extend(rep.metric(_point(s)) for s in range(1, 1001))
    )
    producer.start()
    producer.join(
        timeout=60
    )  # a hang detector, not a timing: metric() must not wait for the stuck request
    assert not producer.is_alive() and queued == [True] * 1000
    with rec.lock:
        assert (
            rec.jobs["r2"].requests == 0
        )  # the handshake is still inside the server, nothing applied
    assert rep.pending() == 1000
    release.set()
    assert rep.close(timeout_s=1.0) is False
    assert (
        not rep._thread.is_alive()
    )  # close() stopped the sender although nothing could be delivered
    assert "401" in (rep.last_error or "")
    assert rep.delivered == 0


def test_reporter_isolates_and_drops_an_item_the_server_refuses(
    report_receiver: ReportReceiver,
) -> None:
    rec = report_receiver
    job = rec.add_job("r3", "t")
    real = rec.handle

    def picky(job_id: str, auth: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if b'"poison"' in body:
            return 422, {"message": "unacceptable item"}
        return real(job_id, auth, body)

    rec.handle = picky  # type: ignore[method-assign]
    rep = Reporter(rec.url, "r3", "t", interval_s=0.05, backoff_max_s=0.1)
    for s in range(1, 21):
        rep.metric(
            MetricPoint(step=s, name="poison" if s == 7 else "loss", value=1.0, time=time.time())
        )
    assert rep.close(10)
    assert [p["step"] for p in job.points] == [s for s in range(1, 21) if s != 7]
    assert job.arrival == list(range(1, 20))  # gap-free although one item was dropped
