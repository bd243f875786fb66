"""A private, local Ray head for `ringtrain serve` (and the tests) when no `RINGTRAIN_RAY_ADDRESS`
is given.

Why a subprocess running `ray start --head --block` instead of `ray.init()`: the control plane must
not hold a Ray driver (only the Jobs API), and a blocking `ray start` owns every Ray daemon it
spawns, so SIGTERM to that one process tears the whole cluster down. Every port is chosen explicitly
and the temp dir is unique, so this head is never auto-detected by, nor collides with, another Ray
cluster on the same machine (`ray stop` is never used: it would kill everyone's clusters).

Token authentication stays on: a fresh random token is written (0600) into the head's temp dir and
the head is started with `RAY_AUTH_MODE=token` + `RAY_AUTH_TOKEN_PATH`; the daemons, job supervisors
and job drivers inherit that environment, and HTTP clients send `Authorization: Bearer <token>` (see
`LocalRayHead.headers`). Setting `RAY_AUTH_MODE=disabled` in the environment is the only way to turn
it off, and that is logged loudly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports (all bound at once so they differ; the OS may still hand one out
    later)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def default_num_cpus() -> int:
    """Logical CPUs to declare: more than the cores so that a 4-rank CPU ring (plus its driver) fits
    on a laptop."""
    return max(8, os.cpu_count() or 1)


@dataclass
class RayHead:
    """How to reach a running Ray head: Jobs API URL, GCS address and the auth token (None = auth
    disabled)."""

    jobs_url: str
    gcs_address: str
    temp_dir: str
    auth_token: str | None = None
    num_cpus: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers for the Jobs/dashboard API (JobSubmissionClient(headers=...))."""
        return {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}

    def client_env(self) -> dict[str, str]:
        """Environment a Ray driver process needs to `ray.init(address=gcs_address)` into this
        head."""
        if self.auth_token:
            return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.auth_token}
        return {"RAY_AUTH_MODE": "disabled"}


class LocalRayHead:
    """Start a local Ray head on free ports in a unique temp dir; stop exactly what was started.

    Use as a context manager: ``with LocalRayHead() as head: ... head.jobs_url ...``.
    """

    def __init__(
        self,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        temp_dir: str | None = None,
        extra_env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.num_cpus = num_cpus if num_cpus is not None else default_num_cpus()
        self.num_gpus = num_gpus
        # Unix socket paths are limited to ~107 bytes: keep the temp dir short.
        self._own_temp_dir = temp_dir is None
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="rt-ray-", dir="/tmp")
        self.extra_env = dict(extra_env or {})
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.head: RayHead | None = None
        self._log_file: Path | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> RayHead:
        if self.head is not None:
            return self.head
        env = dict(os.environ)
        env.update(self.extra_env)
        # Never let this head pick up, or be picked up by, another local cluster through
        # RAY_ADDRESS.
        for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            env.pop(var, None)
        token: str | None = None
        if env.get("RAY_AUTH_MODE", "").lower() == "disabled":
            log.warning(
                "RAY_AUTH_MODE=disabled: the local Ray head runs WITHOUT token authentication"
            )
        else:
            token = env.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)
            token_path = Path(self.temp_dir) / "auth_token"
            token_path.write_text(token)
            token_path.chmod(0o600)
            env["RAY_AUTH_MODE"] = "token"
            env.pop("RAY_AUTH_TOKEN", None)
            env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # `ray start --block` answers SIGTERM by draining the node until it is idle, for up to this
        # long (30 s by default). Ray Data's detached stats actor never lets it go idle, so every
        # stop would wait out the whole drain. The drain is for Ray Serve's proxies; this head has
        # none, and `stop` kills its processes anyway.
        env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
        # Job entrypoints (`python -m workers.driver`) and workers must run the head's own
        # interpreter/venv.
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")

        (gcs, dash, client, agent_http, agent_grpc, metrics, rt_env, node_mgr, obj_mgr) = (
            free_ports(9)
        )
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [
            str(ray_bin) if ray_bin.exists() else "ray",
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            f"--temp-dir={self.temp_dir}",
            f"--num-cpus={self.num_cpus}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={rt_env}",
            f"--node-manager-port={node_mgr}",
            f"--object-manager-port={obj_mgr}",
            "--disable-usage-stats",
        ]
        if self.num_gpus is not None:
            cmd.append(f"--num-gpus={self.num_gpus}")
        self._log_file = Path(self.temp_dir) / "ray-start.log"
        with open(self._log_file, "wb") as out:
            # Own process group so that our SIGTERM (and nothing else's) reaches `ray start` and its
            # children.
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        head = RayHead(
            jobs_url=f"http://127.0.0.1:{dash}",
            gcs_address=f"127.0.0.1:{gcs}",
            temp_dir=self.temp_dir,
            auth_token=token,
            num_cpus=self.num_cpus,
        )
        head.env = head.client_env()
        try:
            self._wait_ready(head)
        except BaseException:
            self.stop()
            raise
        self.head = head
        log.info(
            "local Ray head up: jobs %s, gcs %s, temp dir %s",
            head.jobs_url,
            head.gcs_address,
            self.temp_dir,
        )
        return head

    def _wait_ready(self, head: RayHead) -> None:
        """Wait until the Jobs API answers (it comes up last: GCS, raylet, dashboard, then the job
        module)."""
        deadline = time.monotonic() + self.start_timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"`ray start` exited with {self.proc.returncode}:\n{self._tail()}"
                )
            try:
                self._get_json(head, "/api/jobs/")
                nodes = self._get_json(head, "/api/v0/nodes?limit=100")["data"]["result"]["result"]
                alive = [n for n in nodes if n.get("state") == "ALIVE"]
                if alive:  # the head node is registered: jobs can be scheduled
                    port = head.gcs_address.rsplit(":", 1)[1]
                    head.gcs_address = f"{alive[0].get('node_ip') or '127.0.0.1'}:{port}"
                    return
                last = "head node not registered yet"
            except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
                last = str(e)
            time.sleep(0.5)
        raise TimeoutError(
            f"Ray head not ready after {self.start_timeout_s}s ({last}):\n{self._tail()}"
        )

    @staticmethod
    def _get_json(head: RayHead, path: str) -> Any:
        req = urllib.request.Request(f"{head.jobs_url}{path}", headers=head.headers)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def _tail(self, n: int = 4000) -> str:
        try:
            return self._log_file.read_text(errors="replace")[-n:] if self._log_file else ""
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM `ray start --block` (it kills its daemons), then sweep leftovers that name our
        temp dir."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        _kill_processes_mentioning(self.temp_dir)
        self.head = None
        if self._own_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayHead:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the forked child, before exec: SIGTERM it when the process that started it dies, SIGKILL
    included.

    `ray start --block` stops every daemon it started on SIGTERM, so a `serve` that is killed never
    leaves its private head (and the CPUs it claimed) behind. Linux only; elsewhere the head stops
    on a clean exit only."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _kill_processes_mentioning(marker: str, grace_s: float = 5.0) -> None:
    """Kill processes whose command line names our unique temp dir (workers that outlived the
    raylet)."""
    import psutil

    me = os.getpid()
    victims = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != me and any(marker in arg for arg in (p.info["cmdline"] or [])):
                victims.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in victims:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.terminate()
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
