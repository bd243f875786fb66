"""Control-plane benchmark on loopback: submit latency, metric ingest rate, SSE fan-out latency.

    .venv/bin/python -m bench.api [--submits 200] [--points 20000] [--subscribers 50] [--messages 40]

A real uvicorn server on a temporary SQLite file with a launcher that only records calls; the bench plays
the driver over the real report protocol. References measured in the same run: GET /healthz round trip
(the floor for any request) and a raw SQLAlchemy bulk insert of the same points (the floor for ingest).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.api_harness import ALICE, TINY_SPEC, Driver, running, wait_for  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def bench_submit(srv, n: int) -> tuple[list[float], list[float]]:
    c = srv.client()
    ref = []
    for _ in range(n):
        t = time.perf_counter()
        c.get("/healthz")
        ref.append(time.perf_counter() - t)
    lat = []
    for i in range(n):
        t = time.perf_counter()
        r = c.post("/v1/jobs", json={**TINY_SPEC, "name": f"bench-{i}"})
        lat.append(time.perf_counter() - t)
        assert r.status_code == 201, r.text
    return lat, ref


def bench_ingest(srv, points: int, batch: int = 500) -> tuple[float, float]:
    c = srv.client()
    jid = c.post("/v1/jobs", json={**TINY_SPEC, "name": "ingest"}).json()["id"]
    d = Driver(srv, jid)
    d.state("RUNNING", reason="bench")
    t = time.perf_counter()
    for start in range(0, points, batch):
        r = d.post(
            [
                d.item("metric", step=s, name="loss", value=1.0)
                for s in range(start, min(points, start + batch))
            ]
        )
        assert r.status_code == 200, r.text
    api_rate = points / (time.perf_counter() - t)
    # reference: the same rows straight into the same database with one executemany per batch
    from service.models import MetricPointRow

    store = srv.app.state.ctx.store
    t = time.perf_counter()
    for start in range(0, points, batch):
        with store.db.sessions() as s, s.begin():
            s.execute(
                MetricPointRow.__table__.insert(),
                [
                    {
                        "job_id": jid,
                        "seq": 10**9 + k,
                        "step": k,
                        "name": "ref",
                        "value": 1.0,
                        "rank": None,
                        "time": 0.0,
                    }
                    for k in range(start, min(points, start + batch))
                ],
            )
    return api_rate, points / (time.perf_counter() - t)


def bench_fanout(srv, subscribers: int, messages: int) -> tuple[list[float], list[float]]:
    c = srv.client()
    jid = c.post("/v1/jobs", json={**TINY_SPEC, "name": "fanout"}).json()["id"]
    d = Driver(srv, jid)
    lat: list[float] = []
    lock = threading.Lock()
    ready = threading.Barrier(subscribers + 1)

    def sub() -> None:
        with (
            httpx.Client(
                base_url=srv.url,
                headers={"Authorization": f"Bearer {ALICE}"},
                timeout=httpx.Timeout(10, read=60),
            ) as h,
            h.stream("GET", f"/v1/jobs/{jid}/events") as r,
        ):
            ready.wait()
            event = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "metric":
                    sent = float(line.split('"value":')[1].split(",")[0])
                    with lock:
                        lat.append(time.time() - sent)
                elif line.startswith("data:") and event == "end":
                    return

    threads = [threading.Thread(target=sub, daemon=True) for _ in range(subscribers)]
    for t in threads:
        t.start()
    ready.wait()
    wait_for(lambda: srv.app.state.ctx.hub.subscribers(jid) == subscribers)
    ref = []
    for i in range(messages):
        t0 = time.perf_counter()
        d.post([d.item("metric", step=i, name="loss", value=time.time())])
        ref.append(time.perf_counter() - t0)
        time.sleep(0.05)
    d.state("RUNNING")
    d.state("SUCCEEDED", reason="bench")
    for t in threads:
        t.join(timeout=60)
    return lat, ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--submits", type=int, default=200)
    ap.add_argument("--points", type=int, default=20000)
    ap.add_argument("--subscribers", type=int, default=50)
    ap.add_argument("--messages", type=int, default=40)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, running(Path(d), scheduler_interval_s=0.5) as srv:
        sub, ref = bench_submit(srv, a.submits)
        api_rate, raw_rate = bench_ingest(srv, a.points)
        fan, post = bench_fanout(srv, a.subscribers, a.messages)
    ms = 1000
    rows = [
        (
            "submit latency p50",
            f"{pct(sub, 50) * ms:.2f} ms",
            f"GET /healthz p50 {pct(ref, 50) * ms:.2f} ms",
            f"{pct(sub, 50) / pct(ref, 50):.1f}x",
        ),
        (
            "submit latency p99",
            f"{pct(sub, 99) * ms:.2f} ms",
            f"GET /healthz p99 {pct(ref, 99) * ms:.2f} ms",
            f"{pct(sub, 99) / pct(ref, 99):.1f}x",
        ),
        (
            "metric ingest",
            f"{api_rate:,.0f} points/s",
            f"raw bulk insert {raw_rate:,.0f} points/s",
            f"{api_rate / raw_rate:.2f}x",
        ),
        (
            f"SSE fan-out to {a.subscribers}, p50",
            f"{pct(fan, 50) * ms:.2f} ms",
            f"report POST p50 {pct(post, 50) * ms:.2f} ms",
            f"{pct(fan, 50) / pct(post, 50):.1f}x",
        ),
        (
            f"SSE fan-out to {a.subscribers}, p95",
            f"{pct(fan, 95) * ms:.2f} ms",
            f"report POST p95 {pct(post, 95) * ms:.2f} ms",
            f"{pct(fan, 95) / pct(post, 95):.1f}x",
        ),
    ]
    print(f"$ {' '.join([Path(sys.executable).name, '-m', 'bench.api', *sys.argv[1:]])}")
    print(
        f"loopback, SQLite (WAL), {a.submits} submits, {a.points} points in batches of 500, "
        f"{a.subscribers} SSE subscribers × {len(fan) // max(1, a.subscribers)} messages"
    )
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    head = ("measure", "ringtrain", "reference (same run)", "ratio")
    w = [max(w[i], len(head[i])) for i in range(4)]
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("  ".join("-" * w[i] for i in range(4)))
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))
    print(f"(median of {len(sub)} submits {statistics.median(sub) * ms:.2f} ms)")


if __name__ == "__main__":
    main()
