"""The leases aggregate: the row that says which replica leads the control plane, until when, and
in which epoch (one more on every acquisition).

Times are the database's own clock, so replicas whose clocks disagree still agree on expiry. A
write fenced by a lease (`check`, inside the write's own transaction) holds the row FOR SHARE on
PostgreSQL until it commits: a takeover (an UPDATE of the row) waits for it, so a write either
commits before the new epoch exists or sees it and is refused.

Taking the row FOR UPDATE (acquire, renew, release) waits at most `lock_wait_s` (a transaction-
local lock_timeout): a row held by a transaction that never ends (its client died mid-write, until
PostgreSQL's idle-in-transaction timeout ends it) raises `LeaseBusy`, "not this round", instead of
blocking the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.models import LeaderLease
from service.store.database import Database
from service.store.errors import StoreError, lock_wait_over

CONTROLLER = "controller"
LOCK_WAIT_S = 2.0  # the default bound on waiting for the lease row


class LeaseBusy(StoreError):
    """The lease row stayed locked by another transaction longer than the caller would wait:
    nothing was read or changed this round."""


class Deposed(StoreError):
    """A fenced write by a replica that no longer holds the lease (or whose term ran out): nothing
    of it was written."""


@dataclass(frozen=True)
class LeaseView:
    """The lease as read at `now` (database clock)."""

    name: str
    holder: str | None
    epoch: int
    expires_at: float
    renewed_at: float
    host: str | None
    pid: int | None
    now: float

    @property
    def live(self) -> bool:
        """Held by someone and not expired."""
        return self.holder is not None and self.expires_at > self.now

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.expires_at - self.now)


def _view(row: LeaderLease, now: float) -> LeaseView:
    held = (row.holder, row.epoch, row.expires_at, row.renewed_at)
    return LeaseView(row.name, *held, row.host, row.pid, now)


class Leases:
    def __init__(self, db: Database) -> None:
        self.db = db

    def _now(self, s: Session) -> float:
        if self.db.is_sqlite:
            q = "SELECT (julianday('now') - 2440587.5) * 86400.0"
        else:
            q = "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
        return float(s.execute(text(q)).scalar_one())

    @contextmanager
    def _locking(self, lock_wait_s: float) -> Iterator[Session]:
        """A write transaction whose row locks wait at most `lock_wait_s` (PostgreSQL)."""
        try:
            with self.db.write() as (s, _):
                if not self.db.is_sqlite:
                    ms = max(1, round(lock_wait_s * 1000))
                    s.execute(text(f"SET LOCAL lock_timeout = '{ms}ms'"))
                yield s
        except StoreError as e:
            if lock_wait_over(e.__cause__):
                raise LeaseBusy(
                    f"the lease row stayed locked for over {lock_wait_s:g} s: not this round"
                ) from e
            raise

    def _row(self, s: Session, name: str, lock: bool) -> LeaderLease:
        q = select(LeaderLease).where(LeaderLease.name == name)
        if lock and not self.db.is_sqlite:
            q = q.with_for_update()
        row = s.scalars(q).one_or_none()
        if row is None:  # a schema made without the migration's row (create_all)
            row = LeaderLease(name=name, holder=None, epoch=0, expires_at=0.0, renewed_at=0.0)
            s.add(row)
            s.flush()
        return row

    def read(self, name: str = CONTROLLER) -> LeaseView:
        with self.db.write() as (s, _):
            return _view(self._row(s, name, lock=False), self._now(s))

    def acquire(
        self,
        holder: str,
        lease_s: float,
        *,
        host: str | None = None,
        pid: int | None = None,
        stale: Callable[[LeaseView], bool] | None = None,
        name: str = CONTROLLER,
        lock_wait_s: float = LOCK_WAIT_S,
    ) -> LeaseView:
        """Take the lease when nobody holds it, it expired, it is already ours, or `stale` says its
        holder is gone; the epoch grows by one. Returns the lease as it now is (ours or not)."""
        with self._locking(lock_wait_s) as s:
            row = self._row(s, name, lock=True)
            now = self._now(s)
            seen = _view(row, now)
            if seen.live and row.holder != holder and not (stale is not None and stale(seen)):
                return seen
            row.holder, row.epoch = holder, row.epoch + 1
            row.expires_at, row.renewed_at = now + lease_s, now
            row.host, row.pid = host, pid
            return _view(row, now)

    def renew(
        self,
        holder: str,
        epoch: int,
        lease_s: float,
        name: str = CONTROLLER,
        lock_wait_s: float = LOCK_WAIT_S,
    ) -> LeaseView | None:
        """Extend our lease; None when it is no longer ours (another replica took it)."""
        with self._locking(lock_wait_s) as s:
            row = self._row(s, name, lock=True)
            now = self._now(s)
            if row.holder != holder or row.epoch != epoch:
                return None
            row.expires_at, row.renewed_at = now + lease_s, now
            return _view(row, now)

    def release(
        self, holder: str, epoch: int, name: str = CONTROLLER, lock_wait_s: float = LOCK_WAIT_S
    ) -> bool:
        """Give the lease up at once (a clean shutdown), so another replica need not wait for it to
        expire."""
        with self._locking(lock_wait_s) as s:
            row = self._row(s, name, lock=True)
            if row.holder != holder or row.epoch != epoch:
                return False
            row.expires_at = self._now(s)
            return True

    def check(self, s: Session, holder: str, epoch: int, name: str = CONTROLLER) -> None:
        """Inside a write's transaction: raise Deposed unless `holder` still holds the lease in
        `epoch`. On PostgreSQL the row stays locked FOR SHARE until the write commits."""
        q = select(LeaderLease.holder, LeaderLease.epoch).where(LeaderLease.name == name)
        if not self.db.is_sqlite:
            q = q.with_for_update(read=True)
        got = s.execute(q).one_or_none()
        if got is None or (got[0], got[1]) != (holder, epoch):
            now = (got[0], got[1]) if got is not None else None
            raise Deposed(f"lease {name} epoch {epoch} of {holder} is over (now {now})")
