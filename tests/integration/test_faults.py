"""Fault injection on the real thing: a real local Ray head (session `ray_head`), real drivers and rank actors, the
real control plane (in-thread uvicorn, or the `ringtrain serve` process itself where it gets SIGKILLed), SQLite or
a throwaway PostgreSQL. Nothing is mocked; each test counts what it claims.

Every fault ends in a terminal state; where restarts remain the job resumes from its last complete checkpoint;
the stored series (`GET /v1/jobs/{id}/metrics`) holds exactly one point per (step, name, rank): none lost, none
doubled. Figures and commands: RELIABILITY.md, section "Faults".
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from service.local_ray import RayHead
from service.ray_jobs import RayJobLauncher
from tests.support.api_harness import ALICE, TOKENS, free_port, running, wait_for
from tests.support.pg import Postgres, started_postgres
from tests.support.ray_fixtures import ray_state
from workers.training.checkpoint import latest_step, list_steps

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


# -- helpers ---------------------------------------------------------------------------------------------------------
def spec(
    steps: int, *, every: int = 5, max_restarts: int = 1, name: str = "fault", **over: Any
) -> dict[str, Any]:
    """A tiny 2-rank CPU job (d_model 32, 1 layer, seq 128): a step takes a fraction of a second."""
    base: dict[str, Any] = {
        "name": name,
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "data": {"kind": "passkey", "seq_len": 128, "key_digits": 3},
        "parallel": {"ring_size": 2},
        "train": {"steps": steps, "lr": 1e-3},
        "checkpoint": {"every_steps": every, "keep": 3},
        "eval": {"enabled": False},
        "resources": {"accelerator": "cpu", "cpus_per_worker": 1},
        "max_restarts": max_restarts,
    }
    base.update(over)
    return base


def http(url: str, token: str = ALICE, timeout: float = 10) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)


def get_job(c: httpx.Client, jid: str) -> dict[str, Any]:
    r = c.get(f"/v1/jobs/{jid}")
    assert r.status_code == 200, r.text
    return r.json()


def wait_job(
    c: httpx.Client, jid: str, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            last = get_job(c, jid)
            if pred(last):
                return last
        time.sleep(0.3)
    logs = ""
    with contextlib.suppress(Exception):
        logs = "\n".join(
            x["line"]
            for x in c.get(f"/v1/jobs/{jid}/logs", params={"limit": 10000}).json()["lines"][-30:]
        )
    raise AssertionError(
        f"{what} not seen in {timeout}s: state {last.get('state')}, step {last.get('step')}, "
        f"transitions {[(t['to'], t['reason']) for t in last.get('transitions') or []]}\n{logs}"
    )


def finished(c: httpx.Client, jid: str, timeout: float = 150) -> dict[str, Any]:
    return wait_job(c, jid, lambda j: j["state"] in TERMINAL, timeout, "a terminal state")


def stored_points(c: httpx.Client, jid: str) -> list[dict[str, Any]]:
    """The whole stored series, paged through `GET /v1/jobs/{id}/metrics` as any client would."""
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        page = c.get(f"/v1/jobs/{jid}/metrics", params={"after": after, "limit": 10000}).json()
        out += page["points"]
        after = page["next_after"]
        if not page["has_more"]:
            return out


# What the trainer emits (ARCHITECTURE.md, "Contracts"), never derived from what was stored.
GLOBAL_EVERY_STEP = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
)  # rank None, every step 1..N
# every rank, every step 1..N (`state_bytes`: at least once is promised; it is sent every step)
PER_RANK_EVERY_STEP = ("mem_peak_bytes", "state_bytes")


VERIFY_NAMES = (
    "verify_max_rel_err",
    "verify_tolerance",
    "verify_passed",
    "verify_tokens",
    "verify_seconds",
)  # rank None, once before step 1


def eval_names(js: dict[str, Any]) -> list[str]:
    """The passkey grid's names: the two means, then one exact-match and one per-token cell per (length, depth)."""
    ev = js.get("eval", {})
    lengths = ev.get("context_lengths") or [js["data"]["seq_len"]]
    depths = ev.get("depths", [0.1, 0.5, 0.9])
    cells = [(length, d) for length in lengths for d in depths]
    return [
        "passkey_acc",
        "passkey_token_acc",
        *(f"passkey_acc/len={length}/depth={d:.2f}" for length, d in cells),
        *(f"passkey_token_acc/len={length}/depth={d:.2f}" for length, d in cells),
    ]


def expected_keys(js: dict[str, Any]) -> set[tuple[int, str, int | None]]:
    """Every (step, name, rank) a successful run of spec `js` stores exactly once, whatever faults it survived."""
    steps = js["train"]["steps"]
    par = js.get("parallel", {})
    ranks = range(par.get("ring_size", 1) * par.get("data_parallel", 1))
    keys = {(s, n, None) for s in range(1, steps + 1) for n in GLOBAL_EVERY_STEP}
    keys |= {(s, n, r) for s in range(1, steps + 1) for n in PER_RANK_EVERY_STEP for r in ranks}
    if js.get("verify", {}).get("enabled", True):  # the pre-training check, once before step 1
        keys |= {(0, n, None) for n in VERIFY_NAMES}
    ev = js.get("eval", {})
    if ev.get("enabled", True):
        every = ev.get("every_steps", 0)
        at = set(range(every, steps + 1, every)) if every else set()
        for s in at | {steps}:  # and once after the last step if that was not an eval step
            keys |= {(s, n, None) for n in eval_names(js)}
    return keys


def exactly_once(c: httpx.Client, jid: str, js: dict[str, Any]) -> dict[str, int]:
    """Assert the stored series is exactly `expected_keys(js)`: no key missing, none extra, none twice, seq strictly
    increasing."""
    counts = each_key_once(stored_points(c, jid), js)
    print(f"\n[faults] job {jid}: points {counts}")
    return counts


def each_key_once(
    pts: list[Any],
    js: dict[str, Any],
    seq: bool = True,
    want: set[tuple[int, str, int | None]] | None = None,
) -> dict[str, int]:
    """Assert points (dicts with step, name, rank) hold every key of `want` (default:
    `expected_keys(js)`) exactly once, and nothing else; with `seq`, their seq strictly
    increasing. Returns the counts."""
    keys = Counter((p["step"], p["name"], p.get("rank")) for p in pts)
    stored = set(keys)
    want = expected_keys(js) if want is None else want
    counts = {
        "expected": len(want),
        "stored": len(pts),
        "lost": len(want - stored),
        "unexpected": len(stored - want),
        "duplicated": sum(n - 1 for n in keys.values() if n > 1),
        "loss_points": sum(1 for k in stored if k[1] == "loss"),
    }
    assert stored == want, (counts, sorted(want - stored)[:10], sorted(stored - want)[:10])
    assert counts["duplicated"] == 0, (counts, [k for k, n in keys.items() if n > 1][:10])
    if seq:
        seqs = [p["seq"] for p in pts]
        assert seqs == sorted(set(seqs))  # seq strictly increasing, never reused
    return counts


def states(job: dict[str, Any]) -> list[str]:
    return [t["to"] for t in job["transitions"]]


def job_actors(
    head: RayHead, jid: str, alive: bool = True, prefix: str = ""
) -> list[dict[str, Any]]:
    acts = [
        a
        for a in ray_state(head, "actors")
        if (a.get("name") or "").startswith(prefix or f"rt-{jid}-")
    ]
    return [a for a in acts if a["state"] == "ALIVE"] if alive else acts


def rank_pids(head: RayHead, jid: str) -> list[int]:
    """Pids of the job's live rank actors, from Ray's state API (works while the control plane is down)."""
    return sorted(int(a["pid"]) for a in job_actors(head, jid))


def alive(pid: int) -> bool:
    """The process runs (a zombie waiting for its parent to reap it no longer does anything)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def job_pgs(head: RayHead, prefix: str) -> list[dict[str, Any]]:
    return [
        pg for pg in ray_state(head, "placement_groups") if pg.get("name", "").startswith(prefix)
    ]


def driver_pid(launcher: RayJobLauncher, sid: str, jid: str, timeout: float = 60) -> int:
    """The driver process of a Ray job: Ray's `driver_info.pid`, confirmed in the process table (its command is
    `workers.driver` and its environment names this job), so nothing else is ever killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = launcher._client.get_job_info(sid)
        pid = int(getattr(info.driver_info, "pid", 0) or 0) if info.driver_info else 0
        if pid:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"workers.driver" in cmdline and f"RINGTRAIN_JOB_ID={jid}".encode() in environ, (
                cmdline
            )
            return pid
        time.sleep(0.3)
    raise AssertionError(f"no driver pid for {sid}")


@pytest.fixture
def launcher(ray_head: RayHead) -> RayJobLauncher:
    return RayJobLauncher(ray_head.jobs_url, auth_token=ray_head.auth_token, python=sys.executable)


def control_plane(tmp: Path, launcher: Any, **over: Any):  # type: ignore[no-untyped-def]
    base: dict[str, Any] = dict(
        reconcile_interval_s=0.5,
        reconcile_grace_s=3.0,
        scheduler_interval_s=0.2,
        cancel_grace_s=30.0,
        placement_timeout_s=60.0,
    )
    base.update(over)
    return running(tmp, launcher, **base)


class ServeProcess:
    """`ringtrain serve` as its own process (what gets SIGKILLed), on a fixed port and SQLite file."""

    def __init__(self, tmp: Path, head: RayHead) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        exe = Path(sys.executable).with_name("ringtrain")
        self.cmd = (
            [str(exe), "serve"]
            if exe.exists()
            else [
                sys.executable,
                "-c",
                "from api.cli import main; raise SystemExit(main())",
                "serve",
            ]
        )
        self.env = {
            **os.environ,
            "RINGTRAIN_DATABASE_URL": f"sqlite:///{tmp}/rt.db",
            "RINGTRAIN_RAY_ADDRESS": head.jobs_url,
            "RAY_AUTH_TOKEN": head.auth_token or "",
            "RINGTRAIN_API_TOKENS": json.dumps(TOKENS),
            "RINGTRAIN_HOST": "127.0.0.1",
            "RINGTRAIN_PORT": str(self.port),
            "RINGTRAIN_CHECKPOINT_DIR": str(tmp / "ckpt"),
            "RINGTRAIN_TOKEN_FILE": str(tmp / "token"),
            "RINGTRAIN_SCHEDULER_INTERVAL_S": "0.2",
            "RINGTRAIN_RECONCILE_INTERVAL_S": "0.5",
            "RINGTRAIN_RECONCILE_GRACE_S": "5",
            "RINGTRAIN_PLACEMENT_TIMEOUT_S": "60",
            "RINGTRAIN_LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(ROOT),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> ServeProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise AssertionError(f"ringtrain serve did not come up:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook, no flush, no goodbye."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{self.url}/healthz", timeout=1)
            raise AssertionError("the control plane still answers after SIGKILL")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def serve(tmp_path: Path, ray_head: RayHead) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path, ray_head)
    try:
        yield s
    finally:
        s.stop()


def no_active_jobs(c: httpx.Client) -> None:
    active = c.get(
        "/v1/jobs", params={"state": ["QUEUED", "PLACING", "RUNNING", "RETRYING"]}
    ).json()
    assert active["total"] == 0, [(j["id"], j["state"]) for j in active["jobs"]]


pytestmark = [pytest.mark.ray, pytest.mark.slow]


def checkpoint_at_least(ckpt: Path, step: int, timeout: float = 120) -> int:
    """Wait until the newest *complete* checkpoint under `ckpt` (a `step-NNNNNN` dir) is at `step` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = latest_step(ckpt) if ckpt.is_dir() else None
        if newest is not None and newest >= step:
            return newest
        time.sleep(0.1)
    raise AssertionError(
        f"no checkpoint >= {step} in {ckpt} within {timeout}s: {list_steps(ckpt) if ckpt.is_dir() else []}"
    )


OUTAGE_CHECKPOINTS = 3  # an outage lasts until this many more checkpoints are on disk


def trains_on_while_down(
    ckpt: Path, steps: int, every: int, timeout: float = 120
) -> tuple[int, int]:
    """During an outage: wait until OUTAGE_CHECKPOINTS more checkpoints are on disk (training goes on), and require
    the job to be still short of its last step (so it outlives the outage). Returns (newest before, newest after).
    Steps after the first of those checkpoints, through the last, were measured inside the outage: at least
    (OUTAGE_CHECKPOINTS - 1) × every loss points."""
    before = latest_step(ckpt) or 0
    after = checkpoint_at_least(ckpt, before + OUTAGE_CHECKPOINTS * every, timeout)
    assert after < steps, (
        f"the job reached step {after} of {steps} during the outage: make it longer"
    )
    return before, after


# -- 2. the driver (the job's supervisor) dies -----------------------------------------------------------------------
def test_killed_rank_then_killed_driver_resume_from_checkpoints_then_no_restart_left_fails(
    tmp_path: Path, ray_head: RayHead, launcher: RayJobLauncher
) -> None:
    """One job, two faults: a rank dies (the driver re-reserves and resumes from the newest
    checkpoint), then the driver itself dies (the control plane resubmits it, and it resumes from
    the newest checkpoint again); it SUCCEEDS with every point once. Then a job with no restart
    left loses its driver and FAILS with the reason, never hanging."""
    # Still running at each kill (the first right after checkpoint 10 is seen, the second 10 steps
    # after the first resume; a dead rank or driver stops the ring at once): ~0.3 s a step on 2
    # loaded cores.
    steps = 60
    js = spec(
        steps, max_restarts=2, name="kill-rank-driver", eval={"every_steps": 50, "samples": 2}
    )
    with control_plane(tmp_path, launcher) as srv, http(srv.url) as c:
        jid = c.post("/v1/jobs", json=js).json()["id"]
        ckpt = tmp_path / "ckpt" / jid
        waited_rank = checkpoint_at_least(ckpt, 10)
        pids = rank_pids(ray_head, jid)
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)  # a worker process crash, as on a lost node
        back = wait_job(
            c, jid, lambda j: j["state"] == "RUNNING" and j["restarts"] == 1, 120, "RUNNING again"
        )
        rank_retry = back["transitions"][3]
        # resumed from a checkpoint no older than the one complete before the kill (never from
        # scratch); points the dead rank had not handed over are re-sent from its metrics journal
        assert (
            rank_retry["to"] == "RETRYING"
            and rank_retry["resume_step"] >= waited_rank
            and rank_retry["resume_step"] % 5 == 0
            and "died" in rank_retry["reason"]
        ), (waited_rank, back["transitions"])
        waited = checkpoint_at_least(ckpt, rank_retry["resume_step"] + 10)
        sid0 = get_job(c, jid)["submission_id"]
        ranks = [int(a["pid"]) for a in job_actors(ray_head, jid, prefix=f"rt-{jid}-d0-")]
        assert len(ranks) == 2, ranks  # the second reservation's ranks (the first's died)
        t0 = time.monotonic()
        os.kill(driver_pid(launcher, sid0, jid), signal.SIGKILL)
        # Its rank actors die with it, so no checkpoint is written after this; attempt 1 writes only after resuming.
        # Ray records them DEAD as soon as their owner is gone and kills their processes after that: a rank can still
        # finish a checkpoint in between, so wait for the processes themselves.
        wait_for(
            lambda: not job_actors(ray_head, jid, prefix=f"rt-{jid}-d0-"), timeout=60, interval=0.2
        )
        wait_for(lambda: not any(alive(p) for p in ranks), timeout=60, interval=0.2)
        newest = latest_step(ckpt)
        assert newest is not None and newest >= waited, (waited, list_steps(ckpt))
        retrying = wait_job(c, jid, lambda j: j["state"] == "RETRYING", 60, "RETRYING")
        detected_s = time.monotonic() - t0
        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        assert states(job) == [
            "QUEUED",
            "PLACING",
            "RUNNING",
            "RETRYING",  # the rank
            "PLACING",
            "RUNNING",
            "RETRYING",  # the driver
            "PLACING",
            "RUNNING",
            "SUCCEEDED",
        ], states(job)
        assert (
            job["restarts"] == 2
            and job["submission_id"] != sid0
            and job["submission_id"].endswith("-1")
        )
        retry = job["transitions"][6]
        assert (
            "without reporting a final state" in retry["reason"]
            and "resubmitting" in retry["reason"]
        ), retry
        resumed = job["transitions"][7]
        # the newest complete checkpoint on disk when the driver died, never an older one (nor step 0)
        assert resumed["resume_step"] == newest, (
            waited,
            newest,
            list_steps(ckpt),
            job["transitions"],
        )
        assert retrying["state"] == "RETRYING"
        counts = exactly_once(c, jid, js)
        # the dead driver's actors and placement group went with it
        assert all(a["state"] == "DEAD" for a in job_actors(ray_head, jid, alive=False))
        assert all(pg["state"] == "REMOVED" for pg in job_pgs(ray_head, f"rt-{jid}-d0-"))
        print(
            f"[faults] rank kill: checkpoint {waited_rank} complete before it, resumed from "
            f"{rank_retry['resume_step']}; driver kill: checkpoint {waited} complete before the "
            f"kill, newest {newest} after it; "
            f"RETRYING after {detected_s:.1f}s, resumed from step {resumed['resume_step']}, {counts}"
        )

        # no restart left: FAILED with the reason, never hanging (one rank is enough here)
        js2 = spec(200, max_restarts=0, every=0, name="kill-driver-0", parallel={"ring_size": 1})
        jid2 = c.post("/v1/jobs", json=js2).json()["id"]
        job2 = wait_job(c, jid2, lambda j: j["step"] >= 1, 120, "step 1")
        os.kill(driver_pid(launcher, job2["submission_id"], jid2), signal.SIGKILL)
        job2 = finished(c, jid2, timeout=60)
        assert job2["state"] == "FAILED" and states(job2) == [
            "QUEUED",
            "PLACING",
            "RUNNING",
            "FAILED",
        ], states(job2)
        assert (
            "without reporting a final state" in job2["error"]
            and "no restarts left" in job2["error"]
        )
        assert "Ray status FAILED" in job2["error"]
        no_active_jobs(c)


# -- 3 and 4. the control plane dies, and a rank dies during the outage ----------------------------------------------
def test_control_plane_sigkill_then_a_rank_killed_during_the_outage(
    serve: ServeProcess, ray_head: RayHead, tmp_path: Path
) -> None:
    """One job, one control-plane outage (`ringtrain serve` SIGKILLed; back on the same DB and port):
    training goes on while nobody listens (the driver's refused reports are retried); then a rank
    dies during the outage, and the driver re-reserves and resumes from a checkpoint on its own.
    The restarted serve reattaches the job (the same Ray submission: nothing resubmitted, the serve
    kill itself adds no transition) and learns it all in order; the job SUCCEEDS with every point
    stored exactly once. Nothing here races the job's end: every fault happens while the job is
    asserted short of its last step (`trains_on_while_down`), and the serve comes back whenever."""
    steps, every = 150, 5
    js = spec(steps, every=every, max_restarts=2, name="kill-cp")
    serve.start()
    with http(serve.url) as c:
        jid = c.post("/v1/jobs", json=js).json()["id"]
        sid = wait_job(c, jid, lambda j: j["step"] >= 3, 120, "step 3")["submission_id"]
    assert sid
    ckpt = tmp_path / "ckpt" / jid
    serve.kill()
    t_down = time.time()
    before, after = trains_on_while_down(ckpt, steps, every)  # the driver buffers its reports
    pids = rank_pids(ray_head, jid)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)  # rank 0 or 1, whichever actor started first
    # the driver notices, reports RETRYING into its buffer, re-reserves and trains on: wait for a
    # newer checkpoint
    checkpoint_at_least(ckpt, (latest_step(ckpt) or 0) + every)
    t_up = time.time()
    serve.start()  # same DB, same port
    with http(serve.url) as c:
        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        assert states(job) == [
            "QUEUED",
            "PLACING",
            "RUNNING",
            "RETRYING",
            "PLACING",
            "RUNNING",
            "SUCCEEDED",
        ], states(job)
        retry = job["transitions"][3]
        assert retry["resume_step"] >= after and retry["resume_step"] % every == 0, (
            after,
            job["transitions"],
        )
        assert job["restarts"] == 1 and job["submission_id"] == sid  # the same driver throughout
        counts = exactly_once(c, jid, js)
        loss = [p for p in stored_points(c, jid) if p["name"] == "loss"]
        during = [p for p in loss if t_down < p["time"] < t_up]
        assert len(during) >= (OUTAGE_CHECKPOINTS - 1) * every  # trained on while it was down
        assert any(p["time"] > t_up for p in loss)  # and beyond it
        # the driver's reports were refused while it was down, then retried
        r = c.get(f"/v1/jobs/{jid}/logs", params={"driver": "true"})
        driver_log = r.json()["driver_log"] or ""
        assert "report to" in driver_log and "failed" in driver_log, driver_log[-3000:]
        print(
            f"[faults] control-plane kill: checkpoints {before} -> {after} while it was down, then "
            f"a rank killed; resumed from {retry['resume_step']}; {len(during)} loss points "
            f"measured during the outage, all delivered; {counts}"
        )
        no_active_jobs(c)


# -- 5. a checkpoint write interrupted -------------------------------------------------------------------------------
TRAIN_CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    torch.set_num_threads(1)
    import workers.training.checkpoint as ck
    from workers.config import JobSpec
    from workers.training.trainer import run_training
    spec = JobSpec.model_validate_json(sys.argv[1]); root = sys.argv[2]; pause_at = int(sys.argv[3])
    real = ck.dcp_save
    def save(state, *, checkpoint_id, **kw):  # DCP writes the shards, then hang before the completion marker
        out = real(state, checkpoint_id=checkpoint_id, **kw)
        if str(checkpoint_id).endswith(f"step-{pause_at:06d}"):
            open(os.path.join(root, "PAUSED"), "w").close()
            time.sleep(600)
        return out
    ck.dcp_save = save
    emit = lambda p: print(json.dumps(p.model_dump()), flush=True)
    r = run_training(spec, checkpoint_dir=root, emit=emit)
    print(json.dumps({"resumed_from": r.resumed_from, "final_step": r.final_step}), flush=True)
""")

SAVE_LOOP_CHILD = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from workers.training.checkpoint import save_checkpoint
    torch.manual_seed(0)
    model = nn.Linear(2048, 2048)  # 16 MiB of fp32 weights per save
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model.weight.fill_(float(step))
        save_checkpoint(sys.argv[1], step, model, {"blob": torch.full((1 << 20,), float(step))}, keep=2)
        print(step, flush=True)
""")


def _child(code: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def test_checkpoint_write_killed_midway_is_never_picked_up(tmp_path: Path) -> None:
    from workers.config import JobSpec
    from workers.training.checkpoint import read_weights

    root = tmp_path / "ckpt"
    js = JobSpec.model_validate(spec(10, every=5, parallel={"ring_size": 1})).model_dump_json()
    # (a) SIGKILL while step 10's checkpoint is half written (its DCP shards on disk, no state.pt marker)
    p = _child(TRAIN_CHILD, js, str(root), "10")
    wait_for(lambda: (root / "PAUSED").exists() or p.poll() is not None, timeout=120, interval=0.1)
    assert p.poll() is None, p.stderr.read() if p.stderr else ""
    p.send_signal(signal.SIGKILL)
    out, _ = p.communicate(timeout=10)
    ran = [json.loads(x)["step"] for x in out.splitlines() if '"name": "loss"' in x]
    assert ran == list(range(1, 11))
    partial = root / ".tmp-step-000010"
    assert (partial / ".metadata").exists() and not (partial / "state.pt").exists(), sorted(
        partial.iterdir()
    )
    assert list_steps(root) == [5] and latest_step(root) == 5  # the partial step is invisible
    # (b) a new run resumes from the previous complete step, re-runs 6..10, and replaces the debris
    (root / "PAUSED").unlink()
    p = _child(TRAIN_CHILD, js, str(root), "-1")
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    lines = [json.loads(x) for x in out.splitlines()]
    assert lines[-1] == {"resumed_from": 5, "final_step": 10}
    assert [x["step"] for x in lines if x.get("name") == "loss"] == list(range(6, 11))
    assert list_steps(root) == [5, 10] and not partial.exists()

    # (c) SIGKILL at a random moment of a loop of 16 MiB saves: every visible step is complete and loadable
    loop = tmp_path / "loop"
    p = _child(SAVE_LOOP_CHILD, str(loop))
    assert p.stdout is not None
    while int(p.stdout.readline() or 0) < 3:
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
    time.sleep(random.uniform(0.0, 0.5))
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    visible = list_steps(loop)
    debris = sorted(x.name for x in loop.iterdir() if x.name.startswith("."))
    assert visible and latest_step(loop) == visible[-1]
    for s in visible:
        w = read_weights(loop, s)
        assert float(w["weight"][0, 0]) == float(s)
    print(f"[faults] checkpoint kill: visible steps {visible}, hidden debris {debris}")


# -- 6. the store goes away ------------------------------------------------------------------------------------------
@pytest.fixture
def postgres() -> Iterator[Postgres]:
    """A server of this test's own (it is stopped and started): `tests.support.pg.Postgres`."""
    pg = started_postgres()
    try:
        yield pg
    finally:
        pg.remove()


def ingest_token(launcher: RayJobLauncher, sid: str) -> str:
    """The job's ingest token, as the driver got it: from the Ray job's runtime environment."""
    return launcher._client.get_job_info(sid).runtime_env["env_vars"]["RINGTRAIN_INGEST_TOKEN"]


@pytest.mark.postgres
def test_store_outage_answers_503_and_a_real_job_delivers_every_point_once(
    tmp_path: Path, postgres: Postgres, launcher: RayJobLauncher
) -> None:
    """A real Ray job (real driver, reporter and retries) trains through a PostgreSQL outage: every API call
    answers 503 meanwhile, the driver's reports are refused and retried, and afterwards the job succeeds with
    every point stored exactly once."""
    # The outage lasts until checkpoint (before + 15), ~step 20 at ~0.1 s a step on 2 loaded cores:
    # the job outlives it (`trains_on_while_down` asserts it is short of its end).
    steps, every = 50, 5
    js = spec(steps, every=every, name="store-outage")
    with control_plane(tmp_path, launcher, database_url=postgres.url) as srv, http(srv.url) as c:
        jid = c.post("/v1/jobs", json=js).json()["id"]
        job = wait_job(
            c, jid, lambda j: j["state"] == "RUNNING" and j["step"] >= 3, 120, "RUNNING at step 3"
        )
        token = ingest_token(launcher, job["submission_id"])
        ckpt = tmp_path / "ckpt" / jid

        postgres.stop()  # the store is gone (immediate shutdown: connections cut, nothing flushed politely)
        t_down = time.time()
        answers = {
            "GET /v1/jobs": c.get("/v1/jobs"),
            "GET /v1/jobs/{id}": c.get(f"/v1/jobs/{jid}"),
            "GET metrics": c.get(f"/v1/jobs/{jid}/metrics"),
            "POST /v1/jobs": c.post("/v1/jobs", json=spec(20, name="during-outage")),
            "POST cancel": c.post(f"/v1/jobs/{jid}/cancel"),
            "POST report": httpx.post(
                f"{srv.url}/v1/jobs/{jid}/report",
                json={
                    "items": []
                },  # the driver's handshake: harmless, and refused like its batches
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
            ),
        }
        for what, r in answers.items():
            assert r.status_code == 503, (what, r.status_code, r.text)
            err = r.json()["error"]
            assert (
                err["code"] == "store_unavailable" and "store is unavailable" in err["message"]
            ), (what, err)
            assert r.headers.get("Retry-After")
        assert c.get("/healthz").status_code == 200  # alive, so not restarted in a loop
        assert c.get("/readyz").status_code == 503  # but not ready
        before, after = trains_on_while_down(
            ckpt, steps, every
        )  # the driver buffers and retries meanwhile
        t_up = time.time()

        postgres.start()
        wait_for(lambda: c.get("/v1/jobs").status_code == 200, timeout=30, interval=0.3)
        jobs = c.get("/v1/jobs").json()
        assert jobs["total"] == 1 and [j["id"] for j in jobs["jobs"]] == [
            jid
        ]  # the refused submit left nothing
        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        assert not job["cancel_requested"]  # the refused cancel was not applied either
        assert states(job) == ["QUEUED", "PLACING", "RUNNING", "SUCCEEDED"], states(job)
        counts = exactly_once(c, jid, js)
        loss = [p for p in stored_points(c, jid) if p["name"] == "loss"]
        during = [p for p in loss if t_down < p["time"] < t_up]
        assert len(during) >= (OUTAGE_CHECKPOINTS - 1) * every  # trained on while it was down
        assert any(p["time"] > t_up for p in loss)  # and beyond it
        driver_log = launcher.logs(job["submission_id"])
        assert "503" in driver_log, driver_log[-3000:]  # the real reporter was refused, and retried
        print(
            f"[faults] store outage: checkpoints {before} -> {after} while PostgreSQL was down, {len(during)} loss "
            f"points measured then; {counts}"
        )
        # the control loops lived through it: a new job (one rank is enough) runs to the end
        after_js = spec(3, every=0, name="after", parallel={"ring_size": 1})
        jid2 = c.post("/v1/jobs", json=after_js).json()["id"]
        assert finished(c, jid2)["state"] == "SUCCEEDED"
        no_active_jobs(c)


# -- 7. placement that cannot be satisfied ---------------------------------------------------------------------------
class StaleView:
    """The Ray launcher, but its cluster view shows every node idle: what the control plane believed just before
    something else took the capacity (the cluster shrank after admission)."""

    def __init__(self, inner: RayJobLauncher) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def cluster(self) -> Any:
        from dataclasses import replace

        c = self.inner.cluster()
        return replace(
            c, nodes=[replace(n, cpus_free=n.cpus_total, gpus_free=n.gpus_total) for n in c.nodes]
        )


def test_unplaceable_job_waits_queued_holding_nothing_and_fails_only_if_the_cluster_shrinks_after_admission(
    tmp_path: Path, ray_head: RayHead, launcher: RayJobLauncher
) -> None:
    from ray.job_submission import JobSubmissionClient

    ray_jobs = JobSubmissionClient(ray_head.jobs_url, headers=ray_head.headers)
    hog = ray_jobs.submit_job(
        entrypoint="sleep 300", entrypoint_num_cpus=ray_head.num_cpus - 1
    )  # 1 CPU stays free
    try:
        wait_for(lambda: ray_jobs.get_job_status(hog).value == "RUNNING", timeout=60, interval=0.3)
        # Ray's usage figure follows a new job by a second or two: admission sees what Ray reports
        wait_for(
            lambda: sum(n.cpus_free for n in launcher.cluster().nodes) <= 1,
            timeout=60,
            interval=0.3,
        )
        with control_plane(tmp_path, launcher, placement_timeout_s=4.0) as srv, http(srv.url) as c:
            # a ring larger than the whole cluster is refused before anything is stored or reserved
            r = c.post(
                "/v1/jobs",
                json=spec(5, parallel={"ring_size": 16}, data={"kind": "passkey", "seq_len": 256}),
            )
            assert r.status_code == 422 and r.json()["error"]["field"] == "parallel.ring_size", (
                r.text
            )
            assert f"the whole cluster has {ray_head.num_cpus}" in r.json()["error"]["message"], (
                r.text
            )
            assert c.get("/v1/jobs").json()["total"] == 0
            # a ring that fits the cluster but not what is free: QUEUED with its position and why, no driver, no
            # placement group, never failed for waiting (longer than the placement timeout); it runs once the CPUs free
            jid = c.post("/v1/jobs", json=spec(5, name="no-room", every=0)).json()["id"]
            job = wait_job(c, jid, lambda j: j["queue_position"] == 1, 30, "a queue position")
            assert (
                "waiting for capacity: needs 2 x (1 CPU), room for 1 now" in job["queue_reason"]
            ), job
            time.sleep(6)
            job = get_job(c, jid)
            assert (
                job["state"] == "QUEUED"
                and job["submission_id"] is None
                and not job_pgs(ray_head, f"rt-{jid}-")
            )
            ray_jobs.stop_job(hog)
            job = finished(c, jid)
            assert job["state"] == "SUCCEEDED" and states(job) == [
                "QUEUED",
                "PLACING",
                "RUNNING",
                "SUCCEEDED",
            ], job
        # admitted on a view that was already stale: the driver's placement timeout fails it, saying why
        hog = ray_jobs.submit_job(entrypoint="sleep 300", entrypoint_num_cpus=ray_head.num_cpus - 1)
        wait_for(lambda: ray_jobs.get_job_status(hog).value == "RUNNING", timeout=60, interval=0.3)
        with (
            control_plane(tmp_path / "stale", StaleView(launcher), placement_timeout_s=4.0) as srv,
            http(srv.url) as c,
        ):
            jid = c.post("/v1/jobs", json=spec(5, name="shrunk")).json()["id"]
            wait_job(c, jid, lambda j: j["state"] == "PLACING", 60, "PLACING")
            job = finished(c, jid, timeout=60)
            assert job["state"] == "FAILED"
            assert "could not place 2 rank(s)" in job["error"] and "within 4s" in job["error"], job[
                "error"
            ]
            assert states(job) == ["QUEUED", "PLACING", "FAILED"]
            assert all(pg["state"] == "REMOVED" for pg in job_pgs(ray_head, f"rt-{jid}-"))
            no_active_jobs(c)
    finally:
        ray_jobs.stop_job(hog)
