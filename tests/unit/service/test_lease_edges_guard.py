"""Edges of the leader lease on SQLite, in process (service/store/leases.py, service/leader.py):
a lease is over at its expiry instant, a renewal needs both the holder and the epoch, a follower
comes back when the holder's lease runs out, a term's fence refuses another epoch, the stale-holder
test on one host, and the term's timings derived from the lease length."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.leader import Leadership, _pid_alive, sqlite_holder_gone
from service.store import Deposed, LeaseView, Store
from tests.support.stores import sqlite_store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with sqlite_store(tmp_path) as store:
        yield store


def view(expires_at: float, now: float, host: str = "h", pid: int | None = 1) -> LeaseView:
    return LeaseView("controller", "A", 3, expires_at, 90.0, host, pid, now)


def test_a_lease_is_over_at_its_expiry_instant() -> None:
    assert view(100.0, 99.5).live and view(100.0, 99.5).remaining_s == 0.5
    assert not view(100.0, 100.0).live
    assert view(100.0, 105.0).remaining_s == 0.0  # never negative
    assert not LeaseView("controller", None, 3, 200.0, 90.0, None, None, 100.0).live


def test_a_renewal_needs_the_holder_and_the_epoch(store: Store) -> None:
    got = store.leases.acquire("A", 30.0)
    assert got.holder == "A"
    assert store.leases.renew("A", got.epoch + 1, 30.0) is None  # our name, another term
    assert store.leases.renew("B", got.epoch, 30.0) is None  # the term, another replica
    renewed = store.leases.renew("A", got.epoch, 30.0)
    assert renewed is not None and renewed.epoch == got.epoch


def leadership(store: Store, lease_s: float, exclusive: bool = False) -> Leadership:
    async def deposed() -> None:
        return None

    return Leadership(
        store,
        lease_s=lease_s,
        on_elected=lambda guard, acting: None,
        on_deposed=deposed,
        replica="B",
        exclusive=exclusive,
    )


def test_the_terms_timings_follow_the_lease_length(store: Store) -> None:
    long, short = leadership(store, 30.0), leadership(store, 0.6)
    assert (long.renew_every_s, long.lock_wait_s, long.margin_s) == (10.0, 5.0, 6.0)
    assert short.margin_s == 0.2  # a fifth of 0.6 s is under the floor of 0.2 s


def test_a_follower_comes_back_when_the_holders_lease_runs_out(store: Store) -> None:
    """A holds the lease for 5 s more: B (30 s lease, renewing every 10 s) does not wait 10 s but
    what is left of A's lease (+ 0.02 s), and reports the holder's lease age growing on its own
    clock meanwhile. (The delay is computed, not timed: however slow the machine, it is at most
    what A's lease had left.)"""
    store.leases.acquire("A", 5.0)
    b = leadership(store, 30.0)
    delay = asyncio.run(b._once())
    assert not b.leader and 0.0 < delay <= 5.02
    age0 = b.snapshot().lease_age_s
    assert age0 is not None and age0 >= 0.0
    time.sleep(0.2)
    snap = b.snapshot()
    assert snap.holder == "A" and snap.role == "follower"
    assert snap.lease_age_s is not None and snap.lease_age_s >= age0 + 0.2


def test_a_leader_past_its_deadline_reports_follower(store: Store) -> None:
    b = leadership(store, 30.0)
    b._epoch, b._deadline, b._renewed = 4, time.monotonic() - 1.0, time.monotonic() - 25.0
    assert b.leader and not b.acting()
    assert b.snapshot().role == "follower"


def test_the_fence_refuses_another_epoch_even_while_acting(store: Store) -> None:
    b = leadership(store, 30.0, exclusive=True)  # exclusive: acting while it leads
    b._epoch = 2
    assert b.acting()
    with pytest.raises(Deposed):
        b.guard(1)(None)  # type: ignore[arg-type]  # refused before the store is asked


def test_stale_holder_on_one_host() -> None:
    me = os.getpid()
    dead = subprocess.Popen(["true"])  # a child that ran and was reaped
    dead.wait()
    assert not sqlite_holder_gone(view(1e12, 0.0, host="other", pid=dead.pid), "h", me)
    assert sqlite_holder_gone(view(1e12, 0.0, pid=me), "h", me)  # this very process
    assert sqlite_holder_gone(view(1e12, 0.0, pid=None), "h", me)
    assert sqlite_holder_gone(view(1e12, 0.0, pid=dead.pid), "h", me)
    assert not sqlite_holder_gone(view(1e12, 0.0, pid=os.getppid()), "h", me)  # alive


def test_a_running_process_is_alive() -> None:
    assert _pid_alive(os.getpid()) and _pid_alive(os.getppid())
