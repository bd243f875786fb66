"""The token bucket's arithmetic on a fake clock, against values worked out by hand (rate 2/s,
burst 3): a new key gets the whole burst, the wait is the time to the next whole token, exactly one
token is enough, a refused request does not bank the time it waited, and rate 0 means unlimited."""

from __future__ import annotations

import pytest

from api.ratelimit import Limit, RateLimiter


def test_burst_then_waits_to_the_next_whole_token() -> None:
    now = [0.0]
    rl = RateLimiter({"k": Limit(2.0, 3)}, clock=lambda: now[0])
    assert [rl.take("k", "a") for _ in range(3)] == [0.0, 0.0, 0.0]  # the whole burst at once
    assert rl.take("k", "a") == pytest.approx(0.5)  # empty: one token is 1/2 s away
    now[0] = 0.25  # half a token back
    assert rl.take("k", "a") == pytest.approx(0.25)
    now[0] = 0.5  # exactly one token: enough
    assert rl.take("k", "a") == 0.0
    assert rl.take("k", "a") == pytest.approx(0.5)  # and spent: the waits were not banked
    assert rl.take("k", "b") == 0.0  # another key has its own full bucket


def test_a_bucket_never_holds_more_than_its_burst() -> None:
    now = [0.0]
    rl = RateLimiter({"k": Limit(2.0, 3)}, clock=lambda: now[0])
    rl.take("k", "a")
    now[0] = 100.0  # idle long enough for 200 tokens; the bucket holds 3
    assert [rl.take("k", "a") for _ in range(4)][-1] == pytest.approx(0.5)


def test_rate_zero_is_unlimited() -> None:
    rl = RateLimiter({"k": Limit(0.0, 1)}, clock=lambda: 0.0)
    assert all(rl.take("k", "a") == 0.0 for _ in range(50))
