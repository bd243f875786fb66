"""Soak: a control plane with one job streaming metrics for N minutes; the server's RSS over time.

    .venv/bin/python -m bench.soak [--minutes 10] [--rate 20] [--subscribers 4] [--samples 10]

The server runs in its own process (a real uvicorn, temporary SQLite, a launcher that only records calls)
so the RSS read from /proc is the control plane's alone. This process plays the driver over the real report
protocol (one batch of `loss`, `lr`, `tokens_per_s`, `grad_norm` per step, `--rate` steps per second), keeps
`--subscribers` SSE followers on the job, and polls the job and its metrics like a dashboard would. At the
end it checks that every point sent is stored and that every follower saw a gap-free id sequence up to
`end`, then prints RSS at start, at `--samples` points in between, and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.api_harness import ALICE, TINY_SPEC  # noqa: E402

NAMES = ("loss", "lr", "tokens_per_s", "grad_norm")


def rss_kib(pid: int) -> int:
    """Resident set size of `pid` in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def serve(tmp: Path, ready_file: Path) -> None:
    """Child process: run the server until killed; write its URL to `ready_file` once it is up.

    The launcher records submits like the tests' one and also leaves each job's ingest token in a file,
    which is how the parent (playing the driver) gets it.
    """
    from tests.support.api_harness import RecordingLauncher, running

    class TokenFileLauncher(RecordingLauncher):
        def submit(self, req):  # type: ignore[no-untyped-def]
            sid = super().submit(req)
            (tmp / f"ingest-{req.job_id}").write_text(req.ingest_token)
            return sid

    with running(tmp, TokenFileLauncher()) as srv:
        ready_file.write_text(srv.url)
        while True:
            time.sleep(3600)


def follow(url: str, job_id: str, out: list[int], ended: list[int]) -> None:
    """An SSE follower that records every id it sees (reconnecting with Last-Event-ID like the client)."""
    from api.client import Client

    with Client(url, ALICE) as c:
        for ev in c.events(job_id, read_timeout=120):
            if ev.event == "end":
                ended.append(int(ev.data["last_seq"]))
                return
            out.append(ev.id)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=20.0, help="training steps reported per second")
    ap.add_argument("--subscribers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=10, help="RSS samples between start and end")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(Path(a.serve), Path(a.serve) / "url")
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc = subprocess.Popen([sys.executable, "-m", "bench.soak", "--serve", str(tmp)], cwd=ROOT)
        try:
            run(a, proc, tmp)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def run(a: argparse.Namespace, proc: subprocess.Popen, tmp: Path) -> None:
    url_file = tmp / "url"
    deadline = time.time() + 60
    while not url_file.exists():
        if time.time() > deadline or proc.poll() is not None:
            raise SystemExit("server did not start")
        time.sleep(0.1)
    url = url_file.read_text()
    user = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
    job = user.post(
        "/v1/jobs", json={**TINY_SPEC, "name": "soak", "train": {"steps": 10_000_000}}
    ).json()
    jid = job["id"]
    token_file = tmp / f"ingest-{jid}"
    while not token_file.exists():
        if time.time() > deadline:
            raise SystemExit("the job was never handed to the launcher")
        time.sleep(0.05)
    token = token_file.read_text()
    drv = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    seq = 0

    def post(items: list[dict]) -> None:
        r = drv.post(f"/v1/jobs/{jid}/report", json={"items": items})
        if r.status_code != 200:
            raise SystemExit(f"report refused: {r.status_code} {r.text[:300]}")

    def item(type_: str, **kw: object) -> dict:
        nonlocal seq
        seq += 1
        return {"type": type_, "seq": seq, "time": time.time(), **kw}

    post([item("state", state="RUNNING", reason="soak")])
    subs: list[list[int]] = [[] for _ in range(a.subscribers)]
    ends: list[list[int]] = [[] for _ in range(a.subscribers)]
    threads = [
        threading.Thread(target=follow, args=(url, jid, subs[i], ends[i]), daemon=True)
        for i in range(a.subscribers)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    samples: list[tuple[float, int]] = [(0.0, rss_kib(proc.pid))]
    t0 = time.time()
    total = a.minutes * 60
    every = total / (a.samples + 1)
    next_sample = every
    step = points = requests = 0
    while (el := time.time() - t0) < total:
        post([item("metric", step=step, name=n, value=1.0 / (step + 1)) for n in NAMES])
        points += len(NAMES)
        requests += 1
        if step % 50 == 0:
            post([item("log", line=f"step {step}", source="driver")])
            user.get(f"/v1/jobs/{jid}")
            user.get(f"/v1/jobs/{jid}/metrics", params={"after": max(0, seq - 200)})
            requests += 3
        step += 1
        if el >= next_sample:
            samples.append((el, rss_kib(proc.pid)))
            next_sample += every
        time.sleep(max(0.0, (step / a.rate) - (time.time() - t0)))
    samples.append((time.time() - t0, rss_kib(proc.pid)))
    post([item("state", state="SUCCEEDED", reason="soak done")])
    requests += 1
    for t in threads:
        t.join(timeout=120)
    stored = user.get(f"/v1/jobs/{jid}/metrics", params={"limit": 1}).json()
    n_stored = _count_points(user, jid)
    # no point is superseded here, so each follower's ids must be exactly 1..last_seq of the `end` message
    lost_subs = sum(
        1 for i, ids in enumerate(subs) if not ends[i] or ids != list(range(1, ends[i][0] + 1))
    )
    print(
        f"$ python -m bench.soak --minutes {a.minutes:g} --rate {a.rate:g} --subscribers {a.subscribers}"
    )
    print(
        f"ran {time.time() - t0:.0f} s: {step} steps, {points} metric points, {requests} requests, "
        f"{a.subscribers} SSE followers"
    )
    print(
        f"points stored {n_stored}/{points} (lost {points - n_stored}); followers with a gap or no end: "
        f"{lost_subs}; first point seq {stored['points'][0]['seq'] if stored['points'] else None}"
    )
    print("RSS of the server process (MiB):")
    for el, kib in samples:
        print(f"  t={el:7.1f} s  {kib / 1024:8.1f}")
    start, end = samples[0][1], samples[-1][1]
    print(
        json.dumps(
            {
                "rss_start_mib": round(start / 1024, 1),
                "rss_end_mib": round(end / 1024, 1),
                "rss_growth_mib": round((end - start) / 1024, 1),
                "points": points,
                "stored": n_stored,
                "requests": requests,
                "followers_with_gaps": lost_subs,
            }
        )
    )


def _count_points(c: httpx.Client, jid: str) -> int:
    n, after = 0, 0
    while True:
        page = c.get(f"/v1/jobs/{jid}/metrics", params={"after": after, "limit": 10000}).json()
        n += len(page["points"])
        after = page["next_after"]
        if not page["has_more"]:
            return n


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
