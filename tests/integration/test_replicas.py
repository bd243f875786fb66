"""Replicas for real: two `ringtrain serve` processes on one PostgreSQL store and one Ray head, a
round-robin TCP proxy in front of them standing in for the Service (users and drivers go through
it: `RINGTRAIN_PUBLIC_URL`), and the leader SIGKILLed mid-run.

What must hold: the follower takes over within the lease (plus a few seconds' slack for a loaded
machine; takeover time printed), the running job finishes with every (step, name, rank) point
stored exactly once and its driver submitted once, a job submitted after the kill is scheduled by
the new leader, and an SSE stream on the survivor saw every event, whichever replica stored it,
each within a second of the other replica's stream (cross-replica latency printed). Figures:
RELIABILITY.md, "Replicas".

    pytest tests/integration/test_replicas.py -q -s
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.local_ray import RayHead
from service.ray_jobs import RayJobLauncher
from tests.integration.test_faults import ServeProcess, exactly_once, finished, http, spec, wait_job
from tests.support.api_harness import free_port
from tests.support.pg import fresh_pg_database

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.postgres]

LEASE_S = float(os.environ.get("RINGTRAIN_TEST_LEADER_LEASE_S", "4"))  # the figure scales with it
# The contract (README "Replicas"): a follower takes over within one lease of the leader's
# death. Measured on 2 shared cores: 3.67 s at lease 4 s, 14.19 s at 15 s, i.e. 0.3-0.8 s inside the lease (the last
# renewal was 0 to lease/3 before the kill), and 4.08 s at lease 4 s on a run at load average ~20
# (0.08 s past it). What can push it past the lease is only a loaded machine: the follower's
# wake-up timer firing late, its acquire transaction, and this test's /healthz poll answered late
# by a busy replica (up to its 1 s timeout). 3 s covers those on a loaded 2-core CI machine (the
# poll's timeout, then as much again for the timer and the transaction, and slack), and still
# fails a follower that waited out a second lease (2 x lease).
TAKEOVER_SLACK_S = 3.0
# The contract (README "Replicas"): every event reaches an SSE subscriber on any replica within
# a second. Measured max 87 ms, 486 ms and 175 ms (three runs); a lost notice would show as the 5 s store re-read.
EVENT_LATENCY_MAX_MS = 1000.0


class Proxy:
    """A TCP proxy on loopback: each new connection goes to the next backend in turn (one that
    refuses is skipped, as a Service skips an endpoint that is gone)."""

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.turn = 0
        self.routed: list[int] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        for _ in range(len(self.backends)):
            port = self.backends[self.turn % len(self.backends)]
            self.turn += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=2)
                upstream.settimeout(None)
                self.routed.append(port)
                break
            except OSError:
                continue
        if upstream is None:
            client.close()
            return
        done = threading.Event()

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            done.set()

        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)
        done.wait(timeout=1)
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class SseLog:
    """An SSE stream read in a thread: (event, id, data, arrival time) per message until `end`."""

    def __init__(self, url: str, token: str, job_id: str) -> None:
        self.messages: list[tuple[str, int | None, dict[str, Any], float]] = []
        self.ended = threading.Event()
        self.error: str | None = None
        args = (url, token, job_id)
        self.thread = threading.Thread(target=self._run, args=args, daemon=True)
        self.thread.start()

    def _run(self, url: str, token: str, job_id: str) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            where = f"{url}/v1/jobs/{job_id}/events"
            with httpx.stream("GET", where, headers=headers, timeout=None) as r:
                event, ident, data = "message", None, ""
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("id:"):
                        ident = int(line[3:].strip())
                    elif line.startswith("data:"):
                        data = line[5:].strip()
                    elif line == "" and data:
                        self.messages.append((event, ident, json.loads(data), time.time()))
                        if event == "end":
                            self.ended.set()
                            return
                        event, ident, data = "message", None, ""
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
        self.ended.set()

    def arrivals(self) -> dict[int, float]:
        return {i: t for _, i, _, t in self.messages if i is not None}


def role(url: str) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"{url}/healthz", timeout=1)
        if r.status_code == 200:
            out: dict[str, Any] = r.json()
            return out
    return None


@pytest.fixture
def cluster(
    tmp_path: Path, ray_head: RayHead, postgres_server: str
) -> Iterator[tuple[Proxy, ServeProcess, ServeProcess]]:
    url = fresh_pg_database(postgres_server)
    ports = [free_port(), free_port()]
    proxy = Proxy(ports)
    replicas = []
    for name, port in zip("ab", ports, strict=True):
        s = ServeProcess(tmp_path, ray_head)
        s.port, s.url = port, f"http://127.0.0.1:{port}"
        s.log = tmp_path / f"serve-{name}.log"
        s.env.update(
            {
                "RINGTRAIN_DATABASE_URL": url,
                "RINGTRAIN_PORT": str(port),
                "RINGTRAIN_PUBLIC_URL": proxy.url,
                "RINGTRAIN_LEADER_LEASE_S": str(LEASE_S),
                "RINGTRAIN_LOG_LEVEL": "WARNING",
            }
        )
        replicas.append(s)
    try:
        replicas[0].start()  # a first: it upgrades the schema and takes the lease
        replicas[1].start()
        yield proxy, replicas[0], replicas[1]
    finally:
        for s in replicas:
            s.stop()
        proxy.close()
        for s in replicas:
            if s.log.exists():
                print(f"--- {s.log.name} (tail) ---\n{s.log.read_text()[-1500:]}")


def test_leader_killed_mid_run_follower_takes_over_nothing_lost_or_doubled(
    cluster: tuple[Proxy, ServeProcess, ServeProcess], ray_head: RayHead
) -> None:
    proxy, a, b = cluster
    ra, rb = role(a.url), role(b.url)
    assert ra is not None and rb is not None
    assert (ra["role"], rb["role"]) == ("leader", "follower"), (ra, rb)
    assert ra["replica"] != rb["replica"]
    metrics_b = httpx.get(f"{b.url}/metrics", timeout=5).text
    assert f'ringtrain_replica_leader{{replica="{rb["replica"]}"}} 0.0' in metrics_b

    # one rank: what is tested is the control plane's replicas (a ring's resume: test_faults.py)
    js = spec(40, every=5, name="replicas", parallel={"ring_size": 1})
    with http(proxy.url) as c:
        jid = c.post("/v1/jobs", json=js).json()["id"]
        token = c.headers["Authorization"].split()[1]
        on_b = SseLog(b.url, token, jid)  # the survivor's stream
        on_a = SseLog(a.url, token, jid)  # the leader's, until it dies
        job = wait_job(c, jid, lambda j: j["state"] == "RUNNING" and j["step"] >= 3, 150, "step 3")
        sid = job["submission_id"]

        a.kill()  # SIGKILL the leader mid-run
        t_kill = time.monotonic()
        c.close()  # its pooled connection went to the dead replica; a new one goes to the survivor
    with http(proxy.url) as c:
        jid2 = c.post(
            "/v1/jobs", json=spec(3, every=0, name="after-kill", parallel={"ring_size": 1})
        ).json()["id"]
        took = None
        while time.monotonic() - t_kill < 3 * LEASE_S:  # wait longer than the bound, to report it
            got = role(b.url)
            if got is not None and got["role"] == "leader":
                took = time.monotonic() - t_kill
                break
            time.sleep(0.05)
        assert took is not None, f"the follower did not take over within {3 * LEASE_S:g}s"
        print(
            f"\n[replicas] takeover after SIGKILL of the leader: {took:.2f}s (lease {LEASE_S:g}s)"
        )
        bound = LEASE_S + TAKEOVER_SLACK_S
        assert took <= bound, f"takeover {took:.2f}s > lease {LEASE_S:g}s + {TAKEOVER_SLACK_S:g}s"

        job = finished(c, jid)
        assert job["state"] == "SUCCEEDED", job["error"]
        moves = [t["to"] for t in job["transitions"]]
        assert moves == ["QUEUED", "PLACING", "RUNNING", "SUCCEEDED"], moves
        assert job["submission_id"] == sid and job["restarts"] == 0  # never submitted again
        counts = exactly_once(c, jid, js)
        job2 = finished(c, jid2)
        assert job2["state"] == "SUCCEEDED", job2["error"]

    launcher = RayJobLauncher(ray_head.jobs_url, auth_token=ray_head.auth_token)
    listed = launcher._client.list_jobs()
    ray_jobs = [j for j in listed if (j.metadata or {}).get("ringtrain_job_id") == jid]
    assert [j.submission_id for j in ray_jobs] == [sid]  # one driver, one submission

    assert on_b.ended.wait(30), "the survivor's SSE stream did not end"
    assert on_b.error is None, on_b.error
    seen = [(e, i, d) for e, i, d, _ in on_b.messages if i is not None]
    ids = [i for _, i, _ in seen]
    assert ids == sorted(set(ids))  # in order, none twice
    points = {(d["step"], d["name"], d["rank"]) for e, _, d in seen if e == "metric"}
    assert len(points) == counts["expected"] == counts["stored"]
    states = [d["to"] for e, _, d in seen if e == "state"]
    assert states == ["QUEUED", "PLACING", "RUNNING", "SUCCEEDED"], states
    assert on_b.messages[-1][0] == "end"

    # cross-replica latency: the same event reaching the stream on a and on b; the replica that
    # stored it delivers at once, the other one after the notice
    at_a, at_b = on_a.arrivals(), on_b.arrivals()
    both = [abs(at_b[i] - at_a[i]) * 1000 for i in at_a if i in at_b]
    both.sort()
    ingest = {port: proxy.routed.count(port) for port in proxy.backends}
    print(f"[replicas] points {counts}; connections per replica {ingest}")
    assert both, "no event reached both replicas' streams before the kill: latency unmeasured"
    p95 = both[min(len(both) - 1, int(0.95 * len(both)))]
    print(
        f"[replicas] events seen on both replicas: {len(both)}; |arrival b - arrival a| "
        f"median {statistics.median(both):.1f} ms, p95 {p95:.1f} ms, max {both[-1]:.1f} ms"
    )
    assert both[-1] < EVENT_LATENCY_MAX_MS, f"cross-replica event latency {both[-1]:.0f} ms"
