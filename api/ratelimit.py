"""Per-key token buckets: per API token on the user routes, per job on the report route, per client
address for requests without a valid token.

One small bucket rather than a library: the limits live in one process (the control plane runs one
replica), the keys are few, and refilling on read needs no timer. A bucket holds `burst` tokens,
refills at `rate` per second and each request takes one; an empty bucket answers how long until the
next token (→ 429 with `Retry-After`). Idle buckets are full buckets, which are the same as no
bucket, so they are dropped when the table grows.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    rate: float  # tokens per second; 0 = unlimited
    burst: int

    @property
    def off(self) -> bool:
        return self.rate <= 0


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class RateLimiter:
    """Buckets by (kind, key). `take` returns 0.0 when the request may pass, else the seconds to
    wait."""

    def __init__(
        self,
        limits: dict[str, Limit],
        max_keys: int = 50_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[tuple[str, str], _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, kind: str, key: str) -> float:
        limit = self.limits[kind]
        if limit.off:
            return 0.0
        now = self.clock()
        with self._lock:
            b = self._buckets.get((kind, key))
            if b is None:
                b = _Bucket(float(limit.burst), now)
                self._buckets[(kind, key)] = b
                if len(self._buckets) > self.max_keys:
                    self._prune(now)
            else:
                self._buckets.move_to_end((kind, key))
                b.tokens = min(float(limit.burst), b.tokens + (now - b.stamp) * limit.rate)
                b.stamp = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                return 0.0
            return (1.0 - b.tokens) / limit.rate

    def _prune(self, now: float) -> None:
        """Drop buckets that have refilled (they equal a fresh one); then, if still too many, the
        least recent, down to 90 % of `max_keys`, so the next scan is a tenth of `max_keys` new keys
        away."""
        for k, b in list(self._buckets.items()):
            lim = self.limits[k[0]]
            if b.tokens + (now - b.stamp) * lim.rate >= lim.burst:
                del self._buckets[k]
        while len(self._buckets) > self.max_keys * 9 // 10:
            self._buckets.popitem(last=False)


def retry_after(wait_s: float) -> str:
    """`Retry-After` in whole seconds, never 0 (a client that retries at once would only be refused
    again)."""
    return str(max(1, math.ceil(wait_s)))
