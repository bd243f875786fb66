"""What the control plane's guards cost per request: a rate-limit `take()`, the token lookup with
hashed entries, and one audit row written to SQLite (WAL), each beside a reference timed in the
same run.

    .venv/bin/python -m bench.auth_costs [--n 20000] [--rows 500]

Prints medians of 5 repetitions; RELIABILITY.md ("Security") quotes this table. Timings on a
shared machine move between runs: read the ratios, not the microseconds.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from api.deps import owner_of
from api.ratelimit import Limit, RateLimiter
from service.db import make_engine, migrate
from service.store import Store


def per_call(fn: Callable[[], object], n: int, reps: int = 5) -> float:
    """Median over `reps` runs of the mean seconds per call of `fn`, over `n` calls each."""
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)


def audit_row(i: int) -> dict[str, object]:
    """A row as `api.audit` writes it for a job create."""
    return {
        "time": time.time(),
        "owner": "alice",
        "action": "job.create",
        "method": "POST",
        "route": "/v1/jobs",
        "job_id": f"j{i:012x}",
        "status": 201,
        "outcome": "ok",
        "client": "127.0.0.1",
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timing of the in-memory guards")
    ap.add_argument("--rows", type=int, default=500, help="audit rows per timing")
    args = ap.parse_args(argv)

    # never refuses: the cost of a request that passes
    limiter = RateLimiter({"api": Limit(rate=1e9, burst=10**9)})
    take = per_call(lambda: limiter.take("api", "token-a"), args.n)
    noop = per_call(lambda: None, args.n)

    tokens = {f"sha256:{hashlib.sha256(f't{i}'.encode()).hexdigest()}": f"u{i}" for i in range(10)}
    assert owner_of(tokens, "t7") == "u7"
    lookup = per_call(lambda: owner_of(tokens, "t7"), args.n)
    one_hash = per_call(lambda: hashlib.sha256(b"t7").hexdigest(), args.n)

    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'bench.db'}")
        migrate(engine)
        store = Store(engine)
        counter = iter(range(10**9))
        audit = per_call(lambda: store.record_audit(**audit_row(next(counter))), args.rows)
        read = per_call(lambda: store.audit_events("alice", limit=1), args.rows)
        engine.dispose()

    rows = [
        ("rate limit take()", take, "empty lambda call", noop),
        ("owner_of, 10 hashed entries", lookup, "one sha256 hexdigest", one_hash),
        ("audit row (SQLite, WAL)", audit, "one audit read (limit 1)", read),
    ]
    print(f"{'measure':30} {'cost':>12} {'reference':28} {'ref cost':>12} {'ratio':>8}")
    for name, cost, ref, ref_cost in rows:
        us, ref_us = cost * 1e6, ref_cost * 1e6
        print(f"{name:30} {us:10.2f}us {ref:28} {ref_us:10.2f}us {cost / ref_cost:8.1f}")


if __name__ == "__main__":
    main()
