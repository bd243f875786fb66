"""What the store's aggregates raise; the API maps each to one HTTP answer (`api.errors`)."""

from __future__ import annotations

LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock wait that ran past lock_timeout


def lock_wait_over(e: BaseException | None) -> bool:
    """A driver error (SQLAlchemy's DBAPIError) saying a lock wait ran past lock_timeout."""
    return getattr(getattr(e, "orig", None), "sqlstate", None) == LOCK_NOT_AVAILABLE


class StoreError(RuntimeError):
    """The database could not be reached or refused the write (-> 503)."""


class JobNotFound(LookupError):
    """No such job, or not the caller's (-> 404: the two are not told apart)."""


class ReportGap(Exception):
    """The first new item skips sequence numbers: the driver must resend from `acked_seq + 1`."""

    def __init__(self, acked_seq: int) -> None:
        super().__init__(f"report sequence gap after {acked_seq}")
        self.acked_seq = acked_seq


class JobEnded(Exception):
    """A report for a job that is already terminal: nothing is applied (its ingest token has stopped
    working)."""

    def __init__(self, state: str) -> None:
        super().__init__(f"the job has ended ({state})")
        self.state = state
