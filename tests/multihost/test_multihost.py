"""Real multi-host behaviour on one machine: a Ray head and two worker "hosts", each in its own network namespace with
its own address, joined with `ray start --address`; the control plane runs in the root namespace and reaches the head's
Jobs API over a link of its own. A host is lost by a partition: its link down for longer than Ray's (shortened)
health-check timeout, its processes alive behind the cut; it comes back as a node lost for good does, every process
of its namespace killed and `ray start` run again. Figures: RELIABILITY.md, section "Hosts".

Network (created here, removed in the fixture's finally, whatever happened): a bridge inside a "switch" namespace (no
firewall rules there), one veth pair per host from the switch to the host's namespace, and one to the root namespace
for the control plane. Every address lives on those links (10.213.<k>.0/24); nothing else is ever addressed.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.cli import main as cli
from service.ray_jobs import RayJobLauncher
from tests.integration.test_faults import (
    TERMINAL,
    VERIFY_NAMES,
    checkpoint_at_least,
    each_key_once,
    expected_keys,
    finished,
    get_job,
    http,
    spec,
    states,
    stored_points,
    wait_job,
)
from tests.support.api_harness import ALICE, Server, make_settings
from workers.orchestration.forwarding import DRAIN_WAIT_S
from workers.training.checkpoint import latest_step
from workers.training.journal import read_journal

ROOT = Path(__file__).resolve().parents[2]
# One worker runs the whole module (make test's pytest-xdist): the cluster is built once, and no
# two 4-rank rings across "hosts" compete for the machine's 2 cores.
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.xdist_group("multihost"),
]

# Ray's GCS declares a node dead after `failure_threshold` missed health checks, `period_ms` apart (defaults: 5 × 3 s
# plus a 10 s timeout each). Shortened so that a partition is detected in ~2-3 s.
HEALTH_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "4",
}
WORKER_CPUS = 2
HEAD_PORT, DASH_PORT = 6380, 8266


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


def netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"rtprobe{os.getpid()}"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"network namespaces cannot be created here (`ip netns add`: {r.stderr.strip()}); run as root"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str  # "head", "w1", "w2"
    ns: str
    ip: str
    port: str  # the switch-side veth end (down = partitioned)
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class NetCluster:
    tag: str
    subnet: str
    switch: str
    control_ip: str
    temp: Path
    token: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def jobs_url(self) -> str:
        return f"http://{self.hosts['head'].ip}:{DASH_PORT}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(HEALTH_ENV)
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.temp / "auth_token"),
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONPATH=str(ROOT),
            PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
        )
        # No GLOO_SOCKET_IFNAME: the hostname every namespace shares resolves to loopback here (as in many
        # containers), so this also checks that rank actors pin gloo to the interface of their node's Ray address.
        env.pop("GLOO_SOCKET_IFNAME", None)
        return env

    def start(self, name: str) -> None:
        """`ray start --block` inside the host's namespace (its own process group); a worker joins the head."""
        h = self.hosts[name]
        ray = str(Path(sys.executable).with_name("ray"))
        common = [f"--node-ip-address={h.ip}", "--disable-usage-stats", "--block"]
        if name == "head":
            args = [
                "--head",
                f"--port={HEAD_PORT}",
                "--num-cpus=0",  # ranks only on the worker hosts; the drivers (0 CPU) run here
                "--include-dashboard=true",
                f"--dashboard-host={h.ip}",
                f"--dashboard-port={DASH_PORT}",
                f"--temp-dir={self.temp / 'ray'}",
            ]
        else:
            args = [f"--address={self.hosts['head'].ip}:{HEAD_PORT}", f"--num-cpus={WORKER_CPUS}"]
        log = open(self.temp / f"{name}.log", "ab")  # noqa: SIM115  (the process keeps it)
        h.proc = subprocess.Popen(
            ["ip", "netns", "exec", h.ns, ray, "start", *args, *common],
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, name: str) -> int:
        """Node loss: SIGKILL every process in the host's namespace. Returns how many there were."""
        h = self.hosts[name]
        pids = [int(p) for p in sh("ip", "netns", "pids", h.ns, check=False).stdout.split()]
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if h.proc is not None:
            with contextlib.suppress(Exception):
                h.proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while (
            sh("ip", "netns", "pids", h.ns, check=False).stdout.split()
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        return len(pids)

    def link(self, name: str, up: bool) -> None:
        sh("ip", "-n", self.switch, "link", "set", self.hosts[name].port, "up" if up else "down")

    def nodes(self) -> list[dict[str, Any]]:
        r = httpx.get(
            f"{self.jobs_url}/api/v0/nodes",
            params={"limit": 1000, "detail": "true"},
            headers=self.headers,
            timeout=10,
        )
        r.raise_for_status()
        return list(r.json()["data"]["result"]["result"])

    def alive_ips(self) -> set[str]:
        with contextlib.suppress(httpx.HTTPError):
            return {n["node_ip"] for n in self.nodes() if n["state"] == "ALIVE"}
        return set()

    def wait_alive(self, names: set[str], timeout: float = 120) -> None:
        want = {self.hosts[n].ip for n in names}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_ips() >= want:
                return
            time.sleep(0.5)
        logs = {n: (self.temp / f"{n}.log").read_text(errors="replace")[-1500:] for n in self.hosts}
        raise AssertionError(f"hosts {names} not alive in {timeout}s: {self.alive_ips()}\n{logs}")

    def wait_dead(self, name: str, timeout: float = 60) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.hosts[name].ip not in self.alive_ips():
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"host {name} still alive after {timeout}s")

    def restart(self, name: str) -> None:
        """The host comes back (a new Ray node on the same address). A node start that times out
        on a loaded machine (`ray start`: "the current node timed out during startup", seen in a
        clean CI run) is the harness's hiccup, not the product's: it is tried once more."""
        for attempt in (1, 2):
            self.kill(name)
            self.link(name, True)
            self.start(name)
            try:
                self.wait_alive({name}, timeout=90 if attempt == 1 else 120)
                return
            except AssertionError:
                if attempt == 2:
                    raise


def build(k: int, tag: str) -> NetCluster:
    subnet = f"10.213.{k}"
    temp = Path(tempfile.mkdtemp(prefix=f"rt-mh-{tag}-", dir="/tmp"))
    token = secrets.token_hex(32)
    (temp / "auth_token").write_text(token)
    (temp / "auth_token").chmod(0o600)
    nc = NetCluster(
        tag=tag, subnet=subnet, switch=f"{tag}sw", control_ip=f"{subnet}.1", temp=temp, token=token
    )
    sh("ip", "netns", "add", nc.switch)
    sh("ip", "-n", nc.switch, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", nc.switch, "link", "set", "br0", "up")
    sh("ip", "-n", nc.switch, "link", "set", "lo", "up")
    # the control plane's link: root namespace <-> switch
    cp, cp_port = f"{tag}cp", f"{tag}cpp"
    sh("ip", "link", "add", cp, "type", "veth", "peer", "name", cp_port, "netns", nc.switch)
    sh("ip", "addr", "add", f"{nc.control_ip}/24", "dev", cp)
    sh("ip", "link", "set", cp, "up")
    sh("ip", "-n", nc.switch, "link", "set", cp_port, "master", "br0", "up")
    for i, name in enumerate(("head", "w1", "w2")):
        h = Host(name, f"{tag}{name}", f"{subnet}.{10 + i}", f"{tag}{name}p")
        sh("ip", "netns", "add", h.ns)
        sh("ip", "-n", h.ns, "link", "set", "lo", "up")
        sh(
            "ip",
            "-n",
            nc.switch,
            "link",
            "add",
            h.port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            h.ns,
        )
        sh("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        sh("ip", "-n", h.ns, "link", "set", "eth0", "up")
        sh("ip", "-n", nc.switch, "link", "set", h.port, "master", "br0", "up")
        nc.hosts[name] = h
    return nc


def teardown(nc: NetCluster) -> None:
    for name in nc.hosts:
        with contextlib.suppress(Exception):
            nc.kill(name)
    for h in nc.hosts.values():
        sh("ip", "netns", "del", h.ns, check=False)
    sh("ip", "link", "del", f"{nc.tag}cp", check=False)
    sh("ip", "netns", "del", nc.switch, check=False)
    shutil.rmtree(nc.temp, ignore_errors=True)


def start_cluster(nc: NetCluster) -> None:
    """The head (and its Jobs API), then w1 and w2 one at a time: two nodes joining at once can time out on a loaded
    machine. Also used by bench/elastic.py."""
    nc.start("head")
    nc.wait_alive({"head"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the Jobs API comes up last
        with contextlib.suppress(httpx.HTTPError):
            if (
                httpx.get(f"{nc.jobs_url}/api/jobs/", headers=nc.headers, timeout=5).status_code
                == 200
            ):
                break
        time.sleep(0.5)
    for name in ("w1", "w2"):
        nc.start(name)
        nc.wait_alive({name})


@pytest.fixture(scope="module")
def net() -> Iterator[NetCluster]:
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    tag = f"rt{os.getpid() % 100000}"
    nc = build(100 + os.getpid() % 150, tag)
    try:
        start_cluster(nc)
        yield nc
    finally:
        teardown(nc)
        leftovers = [ns for ns in sh("ip", "netns", "list").stdout.split() if ns.startswith(tag)]
        assert not leftovers, leftovers


@pytest.fixture
def healthy(net: NetCluster) -> NetCluster:
    """Every host up and linked before each test (a previous test may have left one down)."""
    for name in ("w1", "w2"):
        if net.hosts[name].ip not in net.alive_ips():
            net.restart(name)
    return net


class BridgeServer(Server):
    """The real control plane, listening on the root namespace's end of its link (drivers run in the head's)."""

    def __init__(self, settings: Any, launcher: Any) -> None:
        super().__init__(settings, launcher)
        self.server.config.host = settings.host
        self.url = f"http://{settings.host}:{settings.port}"


@contextlib.contextmanager
def control_plane(tmp: Path, nc: NetCluster, **over: Any) -> Iterator[BridgeServer]:
    launcher = RayJobLauncher(nc.jobs_url, auth_token=nc.token, python=sys.executable)
    base: dict[str, Any] = dict(
        host=nc.control_ip,
        reconcile_interval_s=0.5,
        reconcile_grace_s=3.0,
        scheduler_interval_s=0.2,
        cancel_grace_s=30.0,
        placement_timeout_s=240.0,
    )
    base.update(over)
    srv = BridgeServer(make_settings(tmp, **base), launcher).start()
    try:
        yield srv
    finally:
        srv.stop()


def ring_spec(ring: int, steps: int, name: str, every: int = 5, **over: Any) -> dict[str, Any]:
    return spec(
        steps,
        every=every,
        max_restarts=2,
        name=name,
        parallel={"ring_size": ring},
        data={"kind": "passkey", "seq_len": 64 * ring, "key_digits": 3},
        eval={"enabled": False},
        **over,
    )


def nothing_left(nc: NetCluster, jid: str, ring: int) -> None:
    """No live actor and no placement group of the job anywhere in the cluster, read from a listing
    that really holds the job: its first reservation's placement group (REMOVED) and its `ring`
    rank actors (DEAD) must be in it. An empty listing (other names, a state API that answers
    nothing) proves nothing."""
    first = f"rt-{jid}-d0-r0"  # the driver's first reservation: `{first}` and actors `{first}-b<i>`

    def state(kind: str) -> list[dict[str, Any]]:
        r = httpx.get(
            f"{nc.jobs_url}/api/v0/{kind}",
            params={"limit": 10000, "detail": "true"},
            headers=nc.headers,
            timeout=10,
        )
        r.raise_for_status()
        return [
            x
            for x in r.json()["data"]["result"]["result"]
            if (x.get("name") or "").startswith(f"rt-{jid}-")
        ]

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        actors, pgs = state("actors"), state("placement_groups")
        live = [a for a in actors if a["state"] != "DEAD"]
        kept = [p for p in pgs if p["state"] != "REMOVED"]
        listed = (
            sum(1 for p in pgs if p["name"] == first) == 1
            and sum(1 for a in actors if a["name"].startswith(f"{first}-b")) == ring
        )
        if listed and not live and not kept:
            return
        time.sleep(0.5)
    names = sorted((x["name"], x["state"]) for x in actors + pgs)
    raise AssertionError(f"left behind or not listed ({first}, ring {ring}): {names}")


def running_across(c: httpx.Client, nc: NetCluster, jid: str, ring: int) -> dict[str, Any]:
    try:
        return wait_job(
            c,
            jid,
            lambda j: j["state"] == "RUNNING" and len(j["placement"]) == ring,
            240,
            "RUNNING",
        )
    except (
        AssertionError
    ) as e:  # add the driver's own log, read from the head (the control plane may have none)
        log = ""
        with contextlib.suppress(Exception):
            sid = get_job(c, jid).get("submission_id") or f"ringtrain-{jid}-0"
            r = httpx.get(f"{nc.jobs_url}/api/jobs/{sid}/logs", headers=nc.headers, timeout=10)
            log = str(r.json().get("logs", ""))[-4000:]
        raise AssertionError(f"{e}\n--- driver log (tail) ---\n{log}") from None


# -- 1. an elastic ring of 4 across two hosts: a host is cut off, the job goes on with 2 ranks, and grows back -------
# The cut comes once checkpoint ELASTIC_CUT_AT is on disk. The job resumes from it on w1's 2 ranks; once they have
# trained a few steps they are held (SIGSTOP) while w2 is restarted, and let go once w2 is alive and at least
# HOLD_S has passed. The driver grows back at its first capacity check after w2 is alive (every
# `Timing.grow_check_s`), from a checkpoint of the step the 2 ranks finish. The hold keeps the grow from racing the
# job's end however long w2's restart takes on a loaded machine (without it, 120 steps were once too few: the 2-rank
# ring trains at ~0.1 s a step), and it is longer than the driver's metrics drain waits for a rank (DRAIN_WAIT_S),
# so a drain answered late is part of what the exactly-once count checks.
ELASTIC_STEPS, ELASTIC_EVERY, ELASTIC_CUT_AT = 30, 3, 6
HOLD_S = DRAIN_WAIT_S + 3


def rank_actors_in(nc: NetCluster, name: str) -> list[int]:
    """The rank actor processes in the host's namespace (Ray names them `ray::RankActor`)."""
    pids = []
    for pid in sh("ip", "netns", "pids", nc.hosts[name].ns, check=False).stdout.split():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RankActor"):
                pids.append(int(pid))
    return pids


def ranks_in(reason: str) -> int:
    """The number of ranks a RUNNING transition's reason names ("training on 2 node(s), 4 rank(s)")."""
    m = re.search(r"(\d+) rank\(s\)", reason)
    assert m, reason
    return int(m.group(1))


def exactly_once_elastic(
    pts: list[dict[str, Any]], js: dict[str, Any], ranks_at: dict[int, int], resized_at: list[int]
) -> dict[str, int]:
    """`exactly_once` for a job whose shape changed: each step's per-rank points come from the ranks it ran on
    (`ranks_at`, step -> world), every step has one rank-less `world_size` point, and each resume onto another shape
    (at the steps `resized_at`) checked the math on it again (the verify points, at that step). Returns the counts."""
    want = {k for k in expected_keys(js) if k[2] is None or k[2] < ranks_at.get(k[0], 0)}
    want |= {(s, "world_size", None) for s in ranks_at}
    want |= {(s, name, None) for s in resized_at for name in VERIFY_NAMES}
    return each_key_once(pts, js, want=want)


def uninterrupted_losses(js: dict[str, Any]) -> dict[int, float]:
    """The per-step loss of the same job in one process, never interrupted (the global batch of a step does not
    depend on the shape, so one rank is the reference for every shape)."""
    from workers.config import JobSpec
    from workers.config.elastic import resized
    from workers.parallel_dims import ParallelDims
    from workers.training.trainer import run_training

    points: list[Any] = []
    run_training(
        resized(JobSpec.model_validate(js), ParallelDims(1, 1)),
        checkpoint_dir=None,
        emit=points.append,
    )
    return {p.step: p.value for p in points if p.name == "loss"}


def test_elastic_ring_across_hosts_shrinks_on_a_partition_and_grows_back_exactly_once(
    healthy: NetCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ring of 4 over w1 + w2 with `elastic: {enabled, grow}`. w2's link goes down for longer than Ray's health
    timeout: Ray declares w2 dead, and the job goes RETRYING and RUNNING on w1's 2 ranks from exactly the newest
    checkpoint without waiting for w2, while w2's rank processes are still alive behind the cut (they block in their
    next collective, so nothing races the resumed run). The link comes back and w2 is restarted (a node declared dead
    does not rejoin); the job grows to 4 across both hosts from a checkpoint of the step the 2 ranks finished; it
    succeeds with one point per (step, name, rank), a `world_size` point per step (4, then one stretch of 2, then 4)
    and the loss of an uninterrupted run. A fixed-size job's wait after a partition: the cancel test below.
    While w2 restarts, w1's ranks are held (SIGSTOP): the grow never races the job's end, and the driver's metrics
    drains wait out on stalled ranks, whose late answers must still be forwarded once."""
    nc = healthy
    steps = ELASTIC_STEPS
    js = ring_spec(
        4, steps, "mh-elastic", every=ELASTIC_EVERY, elastic={"enabled": True, "grow": True}
    )
    w1, w2 = nc.hosts["w1"].ip, nc.hosts["w2"].ip
    with control_plane(tmp_path, nc) as srv, http(srv.url) as c:
        jid = c.post("/v1/jobs", json=js).json()["id"]
        ckpt = tmp_path / "ckpt" / jid
        job = running_across(c, nc, jid, 4)
        ips = sorted(p["node_ip"] for p in job["placement"])
        assert ips == sorted([w1] * 2 + [w2] * 2), job["placement"]
        # ranks ordered node by node: the ring crosses the host boundary exactly twice, and says so
        meta = job["metadata"]
        assert (
            meta["nodes"] == 2 and meta["ring_node_crossings"] == 2 and meta["world_size"] == 4
        ), meta
        order = [p["node_ip"] for p in sorted(job["placement"], key=lambda p: p["rank"])]
        assert order[0] == order[1] != order[2] == order[3], order
        assert meta["dist_backend"] == "gloo"

        checkpoint_at_least(ckpt, ELASTIC_CUT_AT, timeout=180)
        wall_cut = time.time()
        nc.link("w2", False)
        dead_after = nc.wait_dead("w2")
        job = wait_job(c, jid, lambda j: "RETRYING" in states(j), 120, "RETRYING")
        # No rank trains until the smaller group is placed: the newest checkpoint is where the retry must resume, and
        # rank 0's journal still ends at the last step the ring of 4 finished (steps recomputed from the checkpoint).
        newest = latest_step(ckpt)
        reached = max((p.step for p in read_journal(ckpt, 0) if p.name == "loss"), default=0)
        retry = next(t for t in job["transitions"] if t["to"] == "RETRYING")
        assert newest is not None and newest >= ELASTIC_CUT_AT, newest
        assert retry["resume_step"] == newest, (retry, newest)
        assert "elastic: resizing from 4 to 2 rank(s)" in retry["reason"], retry

        # w2 is still down: the job runs on w1's two CPUs
        small = wait_job(
            c,
            jid,
            lambda j: (
                (j["state"] == "RUNNING" and len(j["placement"]) == 2) or j["state"] in TERMINAL
            ),
            120,
            "RUNNING on 2 ranks",
        )
        assert small["state"] == "RUNNING", (small["state"], small["error"])
        assert nc.hosts["w2"].ip not in nc.alive_ips()
        behind_cut = len(rank_actors_in(nc, "w2"))  # a figure (they go when w2's raylet gives up)
        # placed on 2 ranks at once: no reservation waited for the 4 that cannot fit on w1
        after = small["transitions"][
            [t["to"] for t in small["transitions"]].index("RETRYING") + 1 :
        ]
        placing = [t["reason"] for t in after if t["to"] == "PLACING"]
        assert placing and all(" 2 rank(s)" in r for r in placing), placing
        assert {p["node_ip"] for p in small["placement"]} == {w1}, small["placement"]
        assert small["metadata"]["world_size"] == 2 and small["metadata"]["nodes"] == 1, small[
            "metadata"
        ]
        assert (
            "elastic"
            in next(t for t in reversed(small["transitions"]) if t["to"] == "RUNNING")["reason"]
        )

        wait_job(c, jid, lambda j: j["step"] >= newest + 2, 120, "steps on 2 ranks")
        held = rank_actors_in(nc, "w1")
        assert len(held) == 2, held
        wall_restart = time.time()
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            nc.restart("w2")
            wall_back = time.time()
            time.sleep(max(0.0, wall_restart + HOLD_S - wall_back))
        finally:
            for pid in held:
                os.kill(pid, signal.SIGCONT)
        wall_go = time.time()
        grown = wait_job(
            c,
            jid,
            lambda j: (
                (j["state"] == "RUNNING" and len(j["placement"]) == 4) or j["state"] in TERMINAL
            ),
            240,
            "RUNNING on 4 ranks again",
        )
        assert grown["state"] == "RUNNING", (
            grown["state"],
            [(t["to"], t["reason"]) for t in grown["transitions"]],
        )
        ips = sorted(p["node_ip"] for p in grown["placement"])
        assert ips == sorted([w1] * 2 + [w2] * 2), grown["placement"]
        assert (
            grown["metadata"]["ring_node_crossings"] == 2 and grown["metadata"]["world_size"] == 4
        )
        job = finished(c, jid, timeout=300)
        assert job["state"] == "SUCCEEDED", job["error"]

        # the history: 4 ranks, the resize to 2 on the loss, the resize back to 4 when capacity returned
        trans = job["transitions"]
        assert [ranks_in(t["reason"]) for t in trans if t["to"] == "RUNNING"] == [4, 2, 4], trans
        back = next(t for t in trans if t["to"] == "PLACING" and "is back" in t["reason"])
        assert "capacity for 4 rank(s) is back" in back["reason"], back
        assert "from 2 to 4 rank(s)" in back["reason"], back
        order_ok = [t["to"] for t in trans].index("RETRYING") < trans.index(back)
        assert order_ok, trans
        m = re.search(r"from the checkpoint at step (\d+)", back["reason"])
        assert m, back
        grow_step = int(m.group(1))
        assert newest + 2 <= grow_step < steps, (
            newest,
            grow_step,
        )  # some steps on 2 ranks, some on 4 again

        pts = stored_points(c, jid)
        ranks_at = {s: 2 if newest < s <= grow_step else 4 for s in range(1, steps + 1)}
        sizes = sorted((p["step"], p["value"]) for p in pts if p["name"] == "world_size")
        assert sizes == [(s, float(ranks_at[s])) for s in range(1, steps + 1)], sizes
        counts = exactly_once_elastic(pts, js, ranks_at, [newest, grow_step])
        got = {p["step"]: p["value"] for p in pts if p["name"] == "loss"}
        first_small = min(p["time"] for p in pts if p["name"] == "world_size" and p["value"] == 2)
        first_grown = min(
            p["time"] for p in pts if p["name"] == "world_size" and p["step"] == grow_step + 1
        )
        small_reached = max(p["step"] for p in pts if p["name"] == "world_size" and p["value"] == 2)
        held_at = max(p["step"] for p in pts if p["name"] == "loss" and p["time"] < wall_restart)
        at = {p["step"]: p["time"] for p in pts if p["name"] == "loss"}
        verify_s = [
            next(p["value"] for p in pts if p["name"] == "verify_seconds" and p["step"] == s)
            for s in (newest, grow_step)
        ]
        pace = [(at[b] - at[a]) / (b - a) for a, b in ((1, newest), (grow_step + 1, steps))]

        # `ringtrain status` shows the shape over time and both resizes in the history
        monkeypatch.setenv("RINGTRAIN_URL", srv.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        capsys.readouterr()
        assert cli(["status", jid]) == 0
        shown = capsys.readouterr().out
        spans = f"1-{newest}, {newest + 1}-{grow_step}, {grow_step + 1}-{steps}"
        assert f"elastic   4 -> 2 -> 4 ranks (steps {spans})" in shown, shown
        assert (
            "resizing from 4 to 2 rank(s)" in shown and "capacity for 4 rank(s) is back" in shown
        ), shown
        nothing_left(nc, jid, 4)

    want = uninterrupted_losses(js)
    assert sorted(want) == sorted(got) == list(range(1, steps + 1))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst < 1e-4, worst
    print(
        f"\n[hosts] elastic: w2 cut off, declared dead after {dead_after:.1f}s, RETRYING "
        f"{retry['time'] - wall_cut:.1f}s after the cut; first step on 2 ranks {first_small - wall_cut:.1f}s after "
        f"the cut ({behind_cut} rank actors alive behind it); the 2 ranks held after step {held_at} for "
        f"{wall_go - wall_restart:.1f}s while w2 restarted ({wall_back - wall_restart:.1f}s); first step on 4 "
        f"ranks {first_grown - wall_go:.1f}s after they were let go; steps recomputed: {reached - newest} at the "
        f"shrink (checkpoint {newest}, reached {reached}), {small_reached - grow_step} at the grow (checkpoint "
        f"{grow_step}); {grow_step - newest} steps on 2 ranks; s/step {pace[0]:.2f} on 4, {pace[1]:.2f} on 4 "
        f"again; the math checked again on each new shape ({verify_s[0]:.1f}s, {verify_s[1]:.1f}s); "
        f"max loss rel err {worst:.1e}; {counts}"
    )


# -- 2. cancelled while a host is cut off ----------------------------------------------------------------------------
def test_cancel_during_a_partition_leaves_nothing(healthy: NetCluster, tmp_path: Path) -> None:
    """Cancelled while the job waits to be placed again after w2 was cut off: no actor, no placement group and no
    active job is left, although w2's rank processes were still alive behind the cut. A cancel after a node loss
    (w2's processes gone) is the easier case of the same path (the driver stops waiting for a placement and releases
    what it holds), so it has no job of its own."""
    nc = healthy
    with control_plane(tmp_path, nc) as srv, http(srv.url) as c:
        jid = c.post("/v1/jobs", json=ring_spec(4, 400, "mh-cancel-partition")).json()["id"]
        running_across(c, nc, jid, 4)
        nc.link("w2", False)
        try:
            wait_job(
                c,
                jid,
                lambda j: j["state"] in ("RETRYING", "PLACING") and j["restarts"] >= 1,
                120,
                "RETRYING",
            )
            r = c.post(f"/v1/jobs/{jid}/cancel")
            assert r.status_code == 202, r.text
            job = finished(c, jid, timeout=120)
            assert job["state"] == "CANCELLED", (job["state"], job["error"])
            nothing_left(nc, jid, 4)
            active = c.get(
                "/v1/jobs", params={"state": ["QUEUED", "PLACING", "RUNNING", "RETRYING"]}
            ).json()
            assert active["total"] == 0
        finally:
            nc.link("w2", True)
        print(f"\n[hosts] cancel during a partition: {states(job)}")
