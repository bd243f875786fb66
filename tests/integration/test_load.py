"""Load on loopback: 500 submissions from 20 concurrent clients while 100 SSE subscribers follow a running job
that a driver feeds with real reports. No request may fail and no subscriber may miss an event; the p99
submit latency is printed (no timed assertion: 2 shared cores make timings noise).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from api.client import parse_sse
from tests.support.api_harness import ALICE, TINY_SPEC, Driver, roomy_launcher, running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SUBMITS = 500
CLIENTS = 20
SUBSCRIBERS = 100
MIN_BATCHES = (
    100  # report batches of 4 points the driver sends at least (and until the submits are done)
)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def test_submits_while_streaming(tmp_path: Path) -> None:
    with running(tmp_path, roomy_launcher()) as srv:
        c = srv.client()
        followed = c.post(
            "/v1/jobs", json={**TINY_SPEC, "name": "followed", "train": {"steps": 100000}}
        ).json()["id"]
        d = Driver(srv, followed)
        assert d.state("RUNNING", reason="placed").status_code == 200

        streams: list[list[int]] = [[] for _ in range(SUBSCRIBERS)]
        ends: list[dict] = [{} for _ in range(SUBSCRIBERS)]
        sub_errors: list[str] = []

        def subscribe(i: int) -> None:
            # no reconnect: a dropped stream is an error here, not something to paper over
            try:
                with (
                    httpx.Client(
                        base_url=srv.url,
                        headers={"Authorization": f"Bearer {ALICE}"},
                        timeout=httpx.Timeout(30, read=120),
                    ) as h,
                    h.stream("GET", f"/v1/jobs/{followed}/events") as r,
                ):
                    if r.status_code != 200:
                        sub_errors.append(f"subscriber {i}: HTTP {r.status_code}")
                        return
                    for ev in parse_sse(r.iter_lines()):
                        if ev.event == "end":
                            ends[i] = ev.data
                            return
                        streams[i].append(ev.id)
            except Exception as e:  # any failure of a subscriber is a test failure, reported below
                sub_errors.append(f"subscriber {i}: {type(e).__name__}: {e}")

        subs = [
            threading.Thread(target=subscribe, args=(i,), daemon=True) for i in range(SUBSCRIBERS)
        ]
        for t in subs:
            t.start()
        wait_for(lambda: srv.app.state.ctx.hub.subscribers(followed) == SUBSCRIBERS, timeout=60)

        submit_lat: list[float] = []
        submit_errors: list[str] = []
        lock = threading.Lock()
        submits_done = threading.Event()

        def client(k: int) -> None:
            with srv.client(timeout=60) as h:
                for i in range(SUBMITS // CLIENTS):
                    t0 = time.perf_counter()
                    try:
                        r = h.post("/v1/jobs", json={**TINY_SPEC, "name": f"load-{k}-{i}"})
                        ok = r.status_code == 201 or f"HTTP {r.status_code}: {r.text[:200]}"
                    except httpx.HTTPError as e:
                        ok = f"{type(e).__name__}: {e}"
                    dt = time.perf_counter() - t0
                    with lock:
                        submit_lat.append(dt)
                        if ok is not True:
                            submit_errors.append(str(ok))

        report_codes: list[int] = []
        feed_errors: list[str] = []
        points = 0

        def feed() -> None:
            # a failure here fails the test (below), never a thread that quietly stops feeding
            nonlocal points
            step = 0
            try:
                while step < MIN_BATCHES or not submits_done.is_set():
                    names = ("loss", "lr", "tokens_per_s", "grad_norm")
                    r = d.metrics(range(step, step + 1), names)
                    report_codes.append(r.status_code)
                    points += 4
                    step += 1
                    time.sleep(0.01)
            except Exception as e:
                feed_errors.append(f"feeder at step {step}: {type(e).__name__}: {e}")

        feeder = threading.Thread(target=feed, daemon=True)
        t_start = time.perf_counter()
        feeder.start()
        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=240)
        submits_done.set()
        submit_wall = time.perf_counter() - t_start
        feeder.join(timeout=120)
        assert not feeder.is_alive(), "the feeder did not finish"
        report_codes.append(d.state("SUCCEEDED", reason="load test done").status_code)
        for t in subs:
            t.join(timeout=120)
        stored = [
            e.seq for e in srv.app.state.ctx.store.metrics.events_after(followed, 0, 1_000_000)
        ]
        listed = c.get("/v1/jobs", params={"limit": 1}).json()["total"]
        # Every accepted job reaches the launcher once: wait for all of them (the scheduler's pace), then let the
        # scheduler run ~20 more passes so a second hand-over of any job would show.
        wait_for(lambda: len(srv.launcher.submits) >= SUBMITS + 1, timeout=120, interval=0.1)
        time.sleep(20 * srv.settings.scheduler_interval_s)
        with srv.launcher.lock:
            handed = Counter(r.job_id for r in srv.launcher.submits)
        accepted = {
            j["id"]
            for off in range(0, SUBMITS + 1, 500)
            for j in c.get("/v1/jobs", params={"limit": 500, "offset": off}).json()["jobs"]
        }

    last = stored[-1]
    complete = sum(
        1 for i in range(SUBSCRIBERS) if streams[i] == stored and ends[i].get("last_seq") == last
    )
    lost = sum(len(set(stored) - set(s)) for s in streams)
    print(
        f"\nload: {len(submit_lat)} submits from {CLIENTS} clients in {submit_wall:.1f} s "
        f"({len(submit_lat) / submit_wall:.0f}/s); submit latency p50 {pct(submit_lat, 50) * 1000:.1f} ms, "
        f"p99 {pct(submit_lat, 99) * 1000:.1f} ms, max {max(submit_lat) * 1000:.1f} ms; "
        f"{len(report_codes)} report batches ({points} points); {SUBSCRIBERS} subscribers × {len(stored)} events "
        f"= {SUBSCRIBERS * len(stored)} SSE messages; complete gap-free streams {complete}/{SUBSCRIBERS}; "
        f"events lost {lost}; jobs listed {listed}, handed to the launcher {sum(handed.values())} times "
        f"({len(handed)} distinct)"
    )
    assert (
        feed_errors,
        len(report_codes) > MIN_BATCHES,
        submit_errors,
        sub_errors,
        set(report_codes),
        len(submit_lat),
        complete,
        lost,
        stored,
        listed,
        sum(handed.values()),
        [j for j, n in handed.items() if n > 1],
        set(handed) == accepted,
    ) == (
        [],
        True,
        [],
        [],
        {200},
        SUBMITS,
        SUBSCRIBERS,
        0,
        list(range(1, last + 1)),
        SUBMITS + 1,
        SUBMITS + 1,
        [],
        True,
    )
