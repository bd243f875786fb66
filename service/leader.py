"""Which replica leads the control plane: a lease in the store, renewed every third of its length.

Every replica serves every route; only the leader runs the scheduler and the reconciler
(`service.controller`). The lease row (`service.store.leases`) names the holder, its expiry (the
database's clock) and an epoch that grows on every takeover.

Safety: a leader measures its term on its own monotonic clock from the moment it *sent* the last
renewal that succeeded, and stops acting `margin` before that renewal's expiry, whether or not it
can reach the database; the row it renewed expires later than that, so no other replica can take
over while it still acts. Its control loops' writes are fenced: each checks, in its own transaction,
that the epoch is still this term's (`WRITE_GUARD`), so a write that was in flight when the term
ended is refused rather than applied. Liveness: a follower wakes when the lease it saw expires and
takes it; a killed leader is replaced within one lease of its last renewal.

SQLite is the single-replica store: its replica always leads, and a second replica on the same file
is refused at start while the holder's process lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from service.store import Deposed, LeaseBusy, LeaseView, Store
from service.store.database import WriteGuard

log = logging.getLogger("ringtrain.leader")
T = TypeVar("T")


class ReplicaRefused(RuntimeError):
    """A second replica on a store that cannot hold two (SQLite)."""


def new_replica_id() -> str:
    """Unique per process start: host, pid and a random suffix (a restarted process is new)."""
    return f"{socket.gethostname()[:80]}-{os.getpid()}-{secrets.token_hex(3)}"


def _pid_alive(pid: int) -> bool:
    """The process runs (a killed one its parent has not reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        pass
    with contextlib.suppress(OSError, IndexError):
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def sqlite_holder_gone(view: LeaseView, host: str, pid: int) -> bool:
    """On SQLite (one host): the holder of an unexpired lease is gone when it ran on this host and
    its process is dead, or it was this very process (an earlier app, or a restart that got the same
    pid in a container). A holder on another host is taken for alive until its lease expires."""
    if view.host != host:
        return False
    if view.pid is None or view.pid == pid:
        return True
    return not _pid_alive(view.pid)


def refuse_second_sqlite_replica(store: Store, host: str, pid: int) -> None:
    """Raise ReplicaRefused, saying what to do, when another live replica holds a SQLite store."""
    view = store.leases.read()
    if view.live and not sqlite_holder_gone(view, host, pid):
        url = store.db.engine.url.render_as_string(hide_password=True)
        raise ReplicaRefused(
            f"another ringtrain replica ({view.holder}, pid {view.pid} on {view.host}) already "
            f"serves {url}: SQLite holds one replica only. Stop it, or run every replica on one "
            f"PostgreSQL store (RINGTRAIN_DATABASE_URL=postgresql://...)"
        )


@dataclass(frozen=True)
class Snapshot:
    """What /healthz and /metrics report, read without touching the database."""

    replica: str
    role: str  # "leader" or "follower"
    epoch: int  # the term this replica leads in, else the last epoch it saw
    lease_age_s: float | None  # since the lease was last renewed (by whoever holds it)
    holder: str | None


class Leadership:
    """This replica's side of the lease: acquire, renew, step down, and start or stop the control
    loops accordingly (`on_elected(guard, acting)` / `on_deposed()`)."""

    def __init__(
        self,
        store: Store,
        *,
        lease_s: float,
        on_elected: Callable[[WriteGuard, Callable[[], bool]], None],
        on_deposed: Callable[[], Awaitable[None]],
        replica: str | None = None,
        exclusive: bool | None = None,
    ) -> None:
        self.store = store
        self.lease_s = lease_s
        self.renew_every_s = lease_s / 3
        # the longest wait for the lease row (locked by a write in flight, or by a dead client's
        # transaction until PostgreSQL ends it): half a round, so a round never blocks the next
        self.lock_wait_s = self.renew_every_s / 2
        # stop acting this long before the lease could expire: room for clock-rate drift and the
        # control loops' in-flight calls
        self.margin_s = max(lease_s / 5, 0.2)
        self.replica = replica or new_replica_id()
        self.exclusive = store.db.is_sqlite if exclusive is None else exclusive
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._epoch = 0  # the term we lead in; 0: following
        self._deadline = 0.0  # monotonic: act only before this
        self._renewed = 0.0  # monotonic: when the last successful renewal was sent
        self._seen: LeaseView | None = None
        self._seen_mono = 0.0
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ringtrain-lease")
        self.takeovers = 0

    # ---- what others read ------------------------------------------------------------------------
    @property
    def leader(self) -> bool:
        return self._epoch > 0

    def acting(self) -> bool:
        """Whether this replica may schedule and reconcile now (its term has not run out)."""
        return self._epoch > 0 and (self.exclusive or time.monotonic() < self._deadline)

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        age: float | None = None
        if self.leader and self._renewed:
            age = now - self._renewed
        elif self._seen is not None and self._seen.holder is not None:
            age = self._seen.now - self._seen.renewed_at + (now - self._seen_mono)
        holder = self.replica if self.leader else (self._seen.holder if self._seen else None)
        epoch = self._epoch or (self._seen.epoch if self._seen else 0)
        role = "leader" if self.acting() else "follower"
        return Snapshot(self.replica, role, epoch, age, holder)

    def guard(self, epoch: int) -> WriteGuard:
        """The fence of term `epoch`: a write passes only while this replica still acts in it."""

        def check(s: Session) -> None:
            if self._epoch != epoch or not self.acting():
                raise Deposed(f"replica {self.replica} no longer leads (term {epoch} is over)")
            self.store.leases.check(s, self.replica, epoch)

        return check

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Try once at once (on SQLite a live other holder refuses the start), then keep at it."""
        if self.exclusive:
            t0 = time.monotonic()
            view = await self._call(self._acquire)
            self._seen, self._seen_mono = view, time.monotonic()
            if view.holder != self.replica:
                raise ReplicaRefused(
                    f"the SQLite store is held by another replica ({view.holder}): SQLite holds "
                    f"one replica only; use PostgreSQL (RINGTRAIN_DATABASE_URL) for several"
                )
            self._elect(view, t0)
        self._task = asyncio.create_task(self._run(), name="ringtrain-leadership")

    async def stop(self) -> None:
        """Stop the loop and the control loops; give the lease up so a follower takes over now."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        epoch = self._epoch
        await self._step_down("shutting down")
        if epoch:
            with contextlib.suppress(Exception):
                call = self._call(self._release, epoch)
                await asyncio.wait_for(call, timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the loop --------------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """On the lease's own thread: a hung database call never takes the API's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _acquire(self) -> LeaseView:
        stale = (lambda v: sqlite_holder_gone(v, self.host, self.pid)) if self.exclusive else None
        return self.store.leases.acquire(
            self.replica,
            self.lease_s,
            host=self.host,
            pid=self.pid,
            stale=stale,
            lock_wait_s=self.lock_wait_s,
        )

    def _renew(self, epoch: int) -> LeaseView | None:
        leases = self.store.leases
        return leases.renew(self.replica, epoch, self.lease_s, lock_wait_s=self.lock_wait_s)

    def _release(self, epoch: int) -> bool:
        return self.store.leases.release(self.replica, epoch, lock_wait_s=self.lock_wait_s)

    async def _run(self) -> None:
        while True:
            try:
                delay = await self._once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die: a replica that stops trying never leads
                log.exception("leadership pass failed; trying again")
                delay = self.renew_every_s
            if self.leader and not self.exclusive:  # wake by the deadline whatever happens
                delay = min(delay, max(0.0, self._deadline - time.monotonic()))
            await asyncio.sleep(delay)
            if self.leader and not self.acting():
                term = self.lease_s - self.margin_s
                await self._step_down(f"could not renew the lease within {term:g}s")

    async def _once(self) -> float:
        """One renewal (leading) or one try to take over (following); returns when to come back."""
        t0 = time.monotonic()
        timeout = self.renew_every_s
        if self.leader:
            epoch = self._epoch
            try:
                view = await asyncio.wait_for(self._call(self._renew, epoch), timeout)
            except Exception as e:  # unreachable or slow: the deadline decides
                log.warning("lease renewal failed (%s: %s)", type(e).__name__, str(e)[:200])
                return max(0.0, t0 + self.renew_every_s - time.monotonic())
            if view is None or self._epoch != epoch:
                await self._step_down("another replica took the lease")
                return 0.0
            self._seen, self._seen_mono = view, time.monotonic()
            self._renewed, self._deadline = t0, t0 + self.lease_s - self.margin_s
            return max(0.0, t0 + self.renew_every_s - time.monotonic())
        try:
            view = await asyncio.wait_for(self._call(self._acquire), timeout)
        except LeaseBusy as e:  # a write in flight, or a dead client's transaction: soon again
            log.info("lease not acquired this round (%s)", e)
            return self.lock_wait_s
        except Exception as e:
            log.warning("cannot read the lease (%s: %s)", type(e).__name__, str(e)[:200])
            return self.renew_every_s
        self._seen, self._seen_mono = view, time.monotonic()
        if view.holder == self.replica:
            self._elect(view, t0)
            return max(0.0, t0 + self.renew_every_s - time.monotonic())
        # come back when the holder's lease runs out (a dead leader is replaced right then)
        return min(self.renew_every_s, view.remaining_s + 0.02)

    def _elect(self, view: LeaseView, sent: float) -> None:
        self._epoch = view.epoch
        self._renewed, self._deadline = sent, sent + self.lease_s - self.margin_s
        self.takeovers += 1
        log.warning("replica %s leads the control plane (epoch %d)", self.replica, view.epoch)
        self._on_elected(self.guard(view.epoch), self.acting)

    async def _step_down(self, why: str) -> None:
        if not self._epoch:
            return
        epoch, self._epoch = self._epoch, 0
        log.warning("replica %s stops leading (epoch %d): %s", self.replica, epoch, why)
        await self._on_deposed()

    async def wait_elected(self, timeout: float) -> bool:
        """Tests and tools: whether this replica leads within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.acting():
                return True
            await asyncio.sleep(0.02)
        return self.acting()
