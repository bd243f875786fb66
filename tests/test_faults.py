"""Fault injection on the real thing: a real local Ray head (session `ray_head`), real drivers and rank actors, the
real control plane (in-thread uvicorn, or the `ringtrain serve` process itself where it gets SIGKILLed), SQLite or
a throwaway PostgreSQL. Nothing is mocked; each test counts what it claims.

Every fault ends in a terminal state; where restarts remain the job resumes from its last complete checkpoint;
the stored series (`GET /v1/jobs/{id}/metrics`) holds exactly one point per (step, name, rank): none lost, none
doubled. Figures and commands: RELIABILITY.md, section "Faults".
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.local_ray import RayHead
from service.ray_jobs import RayJobLauncher
from tests.api_harness import ALICE, TOKENS, Driver, RecordingLauncher, free_port, running, wait_for
from tests.ray_fixtures import ray_state
from workers.training.checkpoint import latest_step, list_steps

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


# -- helpers ---------------------------------------------------------------------------------------------------------
def spec(steps: int, *, every: int = 5, max_restarts: int = 1, name: str = "fault", **over: Any) -> dict[str, Any]:
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
            x["line"] for x in c.get(f"/v1/jobs/{jid}/logs", params={"limit": 10000}).json()["lines"][-30:]
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


def exactly_once(c: httpx.Client, jid: str, steps: int) -> dict[str, int]:
    """Assert one `loss` per step 1..steps and no (step, name, rank) twice; return the counts for the report."""
    pts = stored_points(c, jid)
    loss = Counter(p["step"] for p in pts if p["name"] == "loss")
    keys = Counter((p["step"], p["name"], p["rank"]) for p in pts)
    seqs = [p["seq"] for p in pts]
    counts = {
        "expected": steps,
        "stored": sum(loss.values()),
        "lost": sum(1 for s in range(1, steps + 1) if s not in loss),
        "duplicated": sum(n - 1 for n in loss.values() if n > 1),
        "any_key_duplicated": sum(n - 1 for n in keys.values() if n > 1),
        "points_total": len(pts),
    }
    print(f"\n[faults] job {jid}: loss points {counts}")
    assert sorted(loss) == list(range(1, steps + 1)), counts
    assert counts["duplicated"] == 0 and counts["any_key_duplicated"] == 0, counts
    assert seqs == sorted(set(seqs))  # seq strictly increasing, never reused
    return counts


def states(job: dict[str, Any]) -> list[str]:
    return [t["to"] for t in job["transitions"]]


def job_actors(head: RayHead, jid: str, alive: bool = True) -> list[dict[str, Any]]:
    acts = [a for a in ray_state(head, "actors") if (a.get("name") or "").startswith(f"rt-{jid}-")]
    return [a for a in acts if a["state"] == "ALIVE"] if alive else acts


def rank_pids(head: RayHead, jid: str) -> list[int]:
    """Pids of the job's live rank actors, from Ray's state API (works while the control plane is down)."""
    return sorted(int(a["pid"]) for a in job_actors(head, jid))


def job_pgs(head: RayHead, prefix: str) -> list[dict[str, Any]]:
    return [pg for pg in ray_state(head, "placement_groups") if pg.get("name", "").startswith(prefix)]


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
            assert b"workers.driver" in cmdline and f"RINGTRAIN_JOB_ID={jid}".encode() in environ, cmdline
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
            else [sys.executable, "-c", "from api.cli import main; raise SystemExit(main())", "serve"]
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
                self.cmd, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
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
    active = c.get("/v1/jobs", params={"state": ["QUEUED", "PLACING", "RUNNING", "RETRYING"]}).json()
    assert active["total"] == 0, [(j["id"], j["state"]) for j in active["jobs"]]


pytestmark = [pytest.mark.ray, pytest.mark.slow]


# -- 1. a rank dies --------------------------------------------------------------------------------------------------
def test_killed_rank_retries_resumes_from_checkpoint_exactly_once(
    tmp_path: Path, ray_head: RayHead, launcher: RayJobLauncher
) -> None:
    steps = 150  # ~8 s of training: still running when the kill comes, even with the driver's metrics lagging
    with control_plane(tmp_path, launcher) as srv, http(srv.url) as c:
        jid = c.post("/v1/jobs", json=spec(steps, max_restarts=2, name="kill-rank")).json()["id"]
        wait_job(c, jid, lambda j: j["step"] >= 7, 120, "step 7")
        pids = rank_pids(ray_head, jid)
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        seq = states(job)
        i = seq.index("RETRYING")
        assert seq[:3] == ["QUEUED", "PLACING", "RUNNING"] and seq[i:] == [
            "RETRYING",
            "PLACING",
            "RUNNING",
            "SUCCEEDED",
        ], seq
        retry = job["transitions"][i]
        # The newest checkpoint (every 5; at least the one at 5): points the dead rank had not handed over yet
        # are re-sent from its metrics journal instead of re-running their steps.
        assert retry["resume_step"] >= 5 and retry["resume_step"] % 5 == 0 and "died" in retry["reason"], retry
        assert job["restarts"] == 1 and job["step"] == steps
        exactly_once(c, jid, steps)


# -- 2. the driver (the job's supervisor) dies -----------------------------------------------------------------------
def test_killed_driver_is_resubmitted_from_checkpoint_then_fails_when_no_restart_left(
    tmp_path: Path, ray_head: RayHead, launcher: RayJobLauncher
) -> None:
    steps = 150  # still running when the driver is killed (see test 1)
    with control_plane(tmp_path, launcher) as srv, http(srv.url) as c:
        # a restart left: RETRYING, a new driver (attempt 1) resumes from the checkpoint, SUCCEEDED, exactly once
        jid = c.post("/v1/jobs", json=spec(steps, max_restarts=1, name="kill-driver")).json()["id"]
        job = wait_job(c, jid, lambda j: j["step"] >= 7, 120, "step 7")
        sid0 = job["submission_id"]
        t0 = time.monotonic()
        os.kill(driver_pid(launcher, sid0, jid), signal.SIGKILL)
        retrying = wait_job(c, jid, lambda j: j["state"] == "RETRYING", 60, "RETRYING")
        detected_s = time.monotonic() - t0
        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        assert job["restarts"] == 1 and job["submission_id"] != sid0 and job["submission_id"].endswith("-1")
        retry = next(t for t in job["transitions"] if t["to"] == "RETRYING")
        assert "without reporting a final state" in retry["reason"] and "resubmitting" in retry["reason"], retry
        resumed = next(t for t in job["transitions"] if t["seq"] > retry["seq"] and t.get("resume_step") is not None)
        assert resumed["to"] == "PLACING" and resumed["resume_step"] % 5 == 0  # a checkpoint step, see test 1
        assert retrying["state"] == "RETRYING"
        counts = exactly_once(c, jid, steps)
        # the dead driver's actors and placement group went with it
        assert all(a["state"] == "DEAD" for a in job_actors(ray_head, jid, alive=False))
        assert all(pg["state"] == "REMOVED" for pg in job_pgs(ray_head, f"rt-{jid}-d0-"))
        print(
            f"[faults] driver kill: RETRYING after {detected_s:.1f}s, resumed from step {resumed['resume_step']}, "
            f"{counts}"
        )

        # no restart left: FAILED with the reason, bounded by reconcile_grace_s, never hanging
        jid2 = c.post("/v1/jobs", json=spec(200, max_restarts=0, every=0, name="kill-driver-0")).json()["id"]
        job2 = wait_job(c, jid2, lambda j: j["step"] >= 1, 120, "step 1")
        t0 = time.monotonic()
        os.kill(driver_pid(launcher, job2["submission_id"], jid2), signal.SIGKILL)
        job2 = finished(c, jid2, timeout=60)
        assert job2["state"] == "FAILED" and time.monotonic() - t0 < 30
        assert "without reporting a final state" in job2["error"] and "no restarts left" in job2["error"]
        assert "Ray status FAILED" in job2["error"]
        no_active_jobs(c)


# -- 3. the control plane dies ---------------------------------------------------------------------------------------
def test_control_plane_sigkill_reattaches_running_job(serve: ServeProcess) -> None:
    steps = 150  # ~10 s of training on 2 cores: still running when the control plane comes back
    serve.start()
    with http(serve.url) as c:
        jid = c.post("/v1/jobs", json=spec(steps, every=10, name="kill-cp")).json()["id"]
        wait_job(c, jid, lambda j: j["step"] >= 3, 120, "step 3")
    serve.kill()
    t_down = time.time()
    time.sleep(4)  # the driver trains on and buffers its reports
    t_up = time.time()
    serve.start()  # same DB, same port
    with http(serve.url) as c:
        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        assert states(job) == ["QUEUED", "PLACING", "RUNNING", "SUCCEEDED"]
        exactly_once(c, jid, steps)
        during = [p for p in stored_points(c, jid) if p["name"] == "loss" and t_down < p["time"] < t_up]
        print(f"[faults] control-plane kill: {len(during)} loss points measured while it was down, all delivered")
        assert during, "training should go on while the control plane is down"
        no_active_jobs(c)


# -- 4. the control plane dies, and a rank dies during the outage ----------------------------------------------------
def test_control_plane_and_rank_killed_together(serve: ServeProcess, ray_head: RayHead) -> None:
    steps = 120
    serve.start()
    with http(serve.url) as c:
        jid = c.post("/v1/jobs", json=spec(steps, every=5, max_restarts=2, name="kill-both")).json()["id"]
        wait_job(c, jid, lambda j: j["step"] >= 7, 120, "step 7")
    pids = rank_pids(ray_head, jid)
    assert len(pids) == 2
    serve.kill()
    os.kill(pids[0], signal.SIGKILL)  # rank 0 or 1, whichever actor started first
    time.sleep(5)  # the driver notices, reports RETRYING into its buffer, re-reserves
    serve.start()
    with http(serve.url) as c:
        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        retry = next(t for t in job["transitions"] if t["to"] == "RETRYING")
        assert retry["resume_step"] >= 5 and retry["resume_step"] % 5 == 0 and job["restarts"] == 1, job["transitions"]
        exactly_once(c, jid, steps)
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
    real = ck.save_file
    def save_file(weights, path, metadata=None):
        if int((metadata or {}).get("step", -1)) == pause_at:  # write part of the file, then hang mid-save
            with open(path, "wb") as f:
                f.write(b"\\0" * 4096); f.flush(); os.fsync(f.fileno())
            open(os.path.join(root, "PAUSED"), "w").close()
            time.sleep(600)
        return real(weights, path, metadata=metadata)
    ck.save_file = save_file
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
    from safetensors.torch import load_file

    from workers.config import JobSpec

    root = tmp_path / "ckpt"
    js = JobSpec.model_validate(spec(10, every=5, parallel={"ring_size": 1})).model_dump_json()
    # (a) SIGKILL while step 10's checkpoint is half written (4 KiB of its weights file on disk, no state.pt)
    p = _child(TRAIN_CHILD, js, str(root), "10")
    wait_for(lambda: (root / "PAUSED").exists() or p.poll() is not None, timeout=120, interval=0.1)
    assert p.poll() is None, p.stderr.read() if p.stderr else ""
    p.send_signal(signal.SIGKILL)
    out, _ = p.communicate(timeout=10)
    ran = [json.loads(x)["step"] for x in out.splitlines() if '"name": "loss"' in x]
    assert ran == list(range(1, 11))
    partial = root / ".tmp-step-000010"
    assert (partial / "model.safetensors").stat().st_size == 4096 and not (partial / "state.pt").exists()
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
        w = load_file(loop / f"step-{s:06d}" / "model.safetensors")
        assert float(w["weight"][0, 0]) == float(s)
    print(f"[faults] checkpoint kill: visible steps {visible}, hidden debris {debris}")


# -- 6. the store goes away ------------------------------------------------------------------------------------------
class Postgres:
    """A throwaway PostgreSQL server we can stop and start (as user postgres when we are root)."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            pytest.skip("PostgreSQL server binaries not installed")
        self.bin = Path(found[-1]).parent
        self.tmp = Path(tempfile.mkdtemp(prefix="rt-pgf-"))
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            user = "postgres"
            try:
                pw = pwd.getpwnam(user)
            except KeyError:
                pw = pwd.getpwnam("nobody")
                user = "nobody"
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
            self.prefix = ["runuser", "-u", user, "--"]
        self.port = free_port()
        self.data = self.tmp / "data"
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "ringtrain", "--no-sync", "-E", "UTF8")
        self.url = f"postgresql://ringtrain@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.prefix, str(self.bin / tool), *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.tmp / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {self.port} -k {self.tmp} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    pg = Postgres()
    try:
        pg.start()
    except subprocess.CalledProcessError as e:
        pg.remove()
        pytest.skip(f"could not start PostgreSQL: {e.stderr!r}")
    try:
        yield pg
    finally:
        pg.remove()


@pytest.mark.postgres
def test_store_outage_answers_503_writes_nothing_and_recovers(tmp_path: Path, postgres: Postgres) -> None:
    launcher = RecordingLauncher()
    with control_plane(tmp_path, launcher, database_url=postgres.url) as srv, http(srv.url) as c:
        jid = c.post("/v1/jobs", json=spec(20)).json()["id"]
        d = Driver(srv, jid)
        assert d.state("RUNNING", reason="placed").status_code == 200
        assert d.metrics(range(1, 6)).status_code == 200
        held = [d.item("metric", step=s, name="loss", value=1.0 / s) for s in range(6, 11)]

        postgres.stop()  # the store is gone (immediate shutdown: connections cut, nothing flushed politely)
        answers = {
            "GET /v1/jobs": c.get("/v1/jobs"),
            "GET /v1/jobs/{id}": c.get(f"/v1/jobs/{jid}"),
            "GET metrics": c.get(f"/v1/jobs/{jid}/metrics"),
            "POST /v1/jobs": c.post("/v1/jobs", json=spec(20, name="during-outage")),
            "POST cancel": c.post(f"/v1/jobs/{jid}/cancel"),
            "POST report": d.post(held),
        }
        for what, r in answers.items():
            assert r.status_code == 503, (what, r.status_code, r.text)
            err = r.json()["error"]
            assert err["code"] == "store_unavailable" and "store is unavailable" in err["message"], (what, err)
            assert r.headers.get("Retry-After")
        assert c.get("/healthz").status_code == 200  # alive, so not restarted in a loop
        assert c.get("/readyz").status_code == 503  # but not ready

        postgres.start()
        wait_for(lambda: c.get("/v1/jobs").status_code == 200, timeout=30, interval=0.3)
        jobs = c.get("/v1/jobs").json()
        assert jobs["total"] == 1 and [j["id"] for j in jobs["jobs"]] == [jid]  # the refused submit left nothing
        job = get_job(c, jid)
        assert job["state"] == "RUNNING" and job["step"] == 5 and not job["cancel_requested"]
        assert d.post(held).status_code == 200  # the driver's resend after the outage: applied once
        assert d.post(held).status_code == 200  # and again (a lost ack): ignored
        assert d.state("SUCCEEDED", reason="done").status_code == 200
        job = get_job(c, jid)
        assert job["state"] == "SUCCEEDED" and job["step"] == 10
        exactly_once(c, jid, 10)
        # the control loops lived through it: a new job is scheduled (submitted) again
        jid2 = c.post("/v1/jobs", json=spec(20, name="after")).json()["id"]
        wait_job(c, jid2, lambda j: j["state"] == "PLACING", 20, "PLACING after the outage")


# -- 7. placement that cannot be satisfied ---------------------------------------------------------------------------
def test_unplaceable_job_fails_after_the_configured_wait(
    tmp_path: Path, ray_head: RayHead, launcher: RayJobLauncher
) -> None:
    from ray.job_submission import JobSubmissionClient

    ray_jobs = JobSubmissionClient(ray_head.jobs_url, headers=ray_head.headers)
    hog = ray_jobs.submit_job(entrypoint="sleep 300", entrypoint_num_cpus=ray_head.num_cpus - 1)  # 1 CPU stays free
    try:
        wait_for(lambda: ray_jobs.get_job_status(hog).value == "RUNNING", timeout=60, interval=0.3)
        with control_plane(tmp_path, launcher, placement_timeout_s=4.0) as srv, http(srv.url) as c:
            # a ring larger than the whole cluster is refused before anything is stored or reserved
            r = c.post("/v1/jobs", json=spec(5, parallel={"ring_size": 16}, data={"kind": "passkey", "seq_len": 256}))
            assert r.status_code == 422 and r.json()["error"]["field"] == "parallel.ring_size", r.text
            assert c.get("/v1/jobs").json()["total"] == 0
            # a ring that fits the cluster but not what is free: PLACING with the reason, FAILED after 4 s
            jid = c.post("/v1/jobs", json=spec(5, name="no-room")).json()["id"]
            wait_job(c, jid, lambda j: j["state"] == "PLACING", 60, "PLACING")
            t0 = time.monotonic()
            job = finished(c, jid, timeout=60)
            assert job["state"] == "FAILED" and time.monotonic() - t0 < 30
            assert "could not place 2 rank(s)" in job["error"] and "within 4s" in job["error"], job["error"]
            assert states(job) == ["QUEUED", "PLACING", "FAILED"]
            assert all(pg["state"] == "REMOVED" for pg in job_pgs(ray_head, f"rt-{jid}-"))
            no_active_jobs(c)
    finally:
        ray_jobs.stop_job(hog)
