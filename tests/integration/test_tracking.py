"""Tracking export against the real things: a local MLflow tracking server (`mlflow server`, sqlite backend,
loopback port, started and stopped by the test) and TensorBoard event files read back with TensorBoard's own
EventAccumulator.

The job is played over the real report protocol (tests/support/api_harness.Driver). Expected values are the store's
own points (GET /v1/jobs/{id}/metrics): every metric (per rank too) must arrive exactly — the same count and
the same (step, value) pairs — including after a resume superseded points, and after the MLflow server was
down for part of the job. The outage must not cost the store a single point, nor any report its 200.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

# dev dependencies, imported plainly: a missing one fails the run instead of skipping it
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from api.client import Client
from service.artifacts import model_dir
from service.tracking import flatten
from tests.support.api_harness import ALICE, TINY_SPEC, Driver, Server, running, wait_for
from tests.support.dist import free_port

# one worker runs this module's tests (make test's `--dist loadgroup`), so the MLflow server, a
# module fixture, starts once per run rather than once per worker
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.xdist_group("mlflow")]


class MlflowServer:
    """`mlflow server` in its own process group on a loopback port; stop() and start() again keep its data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root}/mlflow.db",
            "--default-artifact-root",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = (self.root / "server.log").open("ab")
        # Without MLflow's job runner (a second process importing mlflow, for its GenAI jobs, which
        # tracking never uses): ~7 CPU-s less per start, and this module starts the server twice.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=log, start_new_session=True, cwd=self.root, env=env
        )
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    "mlflow server did not start: " + (self.root / "server.log").read_text()[-2000:]
                )
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(
            self.proc.pid, signal.SIGTERM
        )  # its own group: uvicorn and its job runner, nothing else
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def steps(d: Driver, lo: int, hi: int, scale: float = 1.0) -> list[dict[str, Any]]:
    items = []
    for s in range(lo, hi + 1):
        loss = math.nan if s == 7 else scale * 5.0 / (1 + 0.1 * s)
        items.append(d.item("metric", step=s, name="loss", value=loss))
        items.append(d.item("metric", step=s, name="tokens_per_s", value=1000.0 + s))
        items += [
            d.item("metric", step=s, name="mem_peak_bytes", value=1e6 * (r + 1) + s, rank=r)
            for r in (0, 1)
        ]
        if s % 10 == 0:
            items.append(d.item("metric", step=s, name="passkey_acc", value=s / 100))
    return items


def post(d: Driver, items: list[dict[str, Any]]) -> int:
    """A report batch as a driver sends it: json.dumps writes the NaN loss as NaN (httpx's json= refuses it)."""
    body = json.dumps({"items": items})
    url = f"/v1/jobs/{d.job_id}/report"
    return d.http.post(url, content=body, headers={"Content-Type": "application/json"}).status_code


def store_series(srv: Server, job_id: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with Client(srv.url, ALICE) as c:
        for p in c.iter_metrics(job_id):
            tag = p.name if p.rank is None else f"{p.name}/rank{p.rank}"
            out[tag].append((p.step, math.nan if p.value is None else p.value))
    return {k: sorted(v) for k, v in out.items()}


def same(a: list[tuple[int, float]], b: list[tuple[int, float]], rel: float = 0.0) -> bool:
    if len(a) != len(b):
        return False
    for (sa, va), (sb, vb) in zip(a, b, strict=True):
        if sa != sb or math.isnan(va) != math.isnan(vb):
            return False
        if not math.isnan(va) and abs(va - vb) > rel * abs(va):
            return False
    return True


def mlflow_run(uri: str, experiment: str, job_id: str) -> Any:
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`ringtrain.job_id` = '{job_id}'")
    assert len(runs) <= 1, "one active run per job (superseded exports are deleted)"
    return runs[0] if runs else None


def mlflow_series(uri: str, run: Any) -> dict[str, list[tuple[int, float]]]:
    c = MlflowClient(uri)
    return {
        k: sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, k))
        for k in run.data.metrics
    }


def tensorboard_series(root: Path, job_id: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(root / job_id), size_guidance={SCALARS: 0})
    acc.Reload()
    return {t: sorted((e.step, e.value) for e in acc.Scalars(t)) for t in acc.Tags()["scalars"]}


def finished_run(uri: str, experiment: str, job_id: str) -> Any:
    return wait_for(
        lambda: (
            (r := mlflow_run(uri, experiment, job_id)) is not None
            and r.info.status != "RUNNING"
            and r
        ),
        timeout=90,
        interval=0.3,
    )


def test_points_spec_and_model_path_reach_mlflow_and_tensorboard(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    exp = f"exp-{uuid.uuid4().hex[:8]}"
    tb = tmp_path / "tb"
    with running(
        tmp_path,
        mlflow_tracking_uri=mlflow_server.url,
        mlflow_experiment=exp,
        tensorboard_dir=str(tb),
    ) as srv:
        with srv.client() as c:
            job = c.post("/v1/jobs", json=TINY_SPEC).json()
        d = Driver(srv, job["id"])
        assert d.state("PLACING").status_code == 200 and d.state("RUNNING").status_code == 200
        for lo in range(1, 31, 10):
            assert post(d, steps(d, lo, lo + 9)) == 200
        # a lost rank: resume from step 20; the store drops 21..30 and the ranks send them again, changed
        wait_for(
            lambda: (
                (r := mlflow_run(mlflow_server.url, exp, job["id"])) and "loss" in r.data.metrics
            ),
            60,
        )
        assert d.state("RETRYING", reason="rank 1 died", resume_step=20).status_code == 200
        assert d.state("RUNNING").status_code == 200
        assert post(d, steps(d, 21, 35, scale=0.5)) == 200
        assert d.state("SUCCEEDED", reason="done").status_code == 200

        run = finished_run(mlflow_server.url, exp, job["id"])
        expected = store_series(srv, job["id"])
        assert len(expected["loss"]) == 35 and len(expected["mem_peak_bytes/rank1"]) == 35
        assert dict(expected["loss"])[25] == pytest.approx(
            0.5 * 5.0 / 3.5
        )  # the resumed values, not the old

        assert run.info.status == "FINISHED" and run.info.run_name == TINY_SPEC["name"]
        got = mlflow_series(mlflow_server.url, run)
        assert set(got) == set(expected)
        for tag, pts in expected.items():
            assert same(got[tag], pts, rel=1e-12), tag  # count per metric and every (step, value)
        spec = Client(srv.url, ALICE).get_job(job["id"]).spec
        assert run.data.params == flatten(spec) and run.data.params["model.d_model"] == "32"
        assert run.data.tags["ringtrain.model_path"] == str(
            model_dir(srv.settings.checkpoint_dir, job["id"])
        )

        board = wait_for(
            lambda: (b := tensorboard_series(tb, job["id"])) and len(b.get("loss", [])) == 35 and b
        )
        assert set(board) == set(expected)
        for tag, pts in expected.items():
            assert same(board[tag], pts, rel=1e-6), tag  # float32 in event files


def test_mlflow_outage_loses_nothing(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    exp = f"exp-{uuid.uuid4().hex[:8]}"
    tb = tmp_path / "tb"
    with running(
        tmp_path,
        mlflow_tracking_uri=mlflow_server.url,
        mlflow_experiment=exp,
        tensorboard_dir=str(tb),
        tracking_retry_max_s=2.0,
    ) as srv:
        with srv.client() as c:
            job = c.post("/v1/jobs", json=TINY_SPEC).json()
        d = Driver(srv, job["id"])
        assert d.state("RUNNING").status_code == 200
        assert post(d, steps(d, 1, 10)) == 200
        wait_for(
            lambda: (
                (r := mlflow_run(mlflow_server.url, exp, job["id"])) and "loss" in r.data.metrics
            ),
            60,
        )

        mlflow_server.stop()
        try:
            for lo in range(11, 41, 5):  # the job goes on: every report is taken
                assert post(d, steps(d, lo, lo + 4)) == 200
            expected = store_series(srv, job["id"])
            assert [s for s, _ in expected["loss"]] == list(range(1, 41))
            assert len(expected["mem_peak_bytes/rank0"]) == 40 and len(expected["passkey_acc"]) == 4

            def logged(text: str) -> bool:
                with Client(srv.url, ALICE) as c:
                    return any(text in line.line for line in c.logs(job["id"], driver=False).lines)

            wait_for(lambda: logged("export to mlflow failing"), timeout=60)
            # TensorBoard is a separate sink: it keeps up during the MLflow outage
            wait_for(
                lambda: len(tensorboard_series(tb, job["id"]).get("loss", [])) == 40, timeout=30
            )
        finally:
            mlflow_server.start()
        assert d.state("SUCCEEDED", reason="done").status_code == 200

        run = finished_run(mlflow_server.url, exp, job["id"])
        assert [s for s, _ in store_series(srv, job["id"])["loss"]] == list(range(1, 41))
        got = mlflow_series(mlflow_server.url, run)
        assert set(got) == set(expected)
        for tag, pts in expected.items():
            assert same(got[tag], pts, rel=1e-12), tag
        wait_for(lambda: logged("export to mlflow recovered"), timeout=30)


def test_service_runs_without_the_trackers_installed() -> None:
    """Not configured: neither mlflow nor tensorboard is imported (they are an optional extra)."""
    code = (
        "import sys, tempfile, pathlib\n"
        "from api.app import create_app\n"
        "from service.settings import Settings\n"
        "d = pathlib.Path(tempfile.mkdtemp())\n"
        "from service.db import upgrade\n"
        "upgrade(f'sqlite:///{d}/x.db')\n"
        "create_app(Settings(database_url=f'sqlite:///{d}/x.db', api_tokens={'t0123456789': 'a'}))\n"
        "bad = [m for m in ('mlflow', 'tensorboard') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
