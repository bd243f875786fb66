"""The audit trail aggregate: who did what through the API (written by `api.audit`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from service.models import AuditEvent
from service.store.database import Database


class Audit:
    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, **fields: Any) -> None:
        with self.db.write() as (s, _):
            s.add(AuditEvent(**fields))

    def events(
        self,
        owner: str | None,
        job_id: str | None = None,
        before: int | None = None,
        limit: int = 100,
    ) -> list[AuditEvent]:
        """Newest first; `owner=None` reads every owner's rows."""
        q = select(AuditEvent)
        if owner is not None:
            q = q.where(AuditEvent.owner == owner)
        if job_id is not None:
            q = q.where(AuditEvent.job_id == job_id)
        if before is not None:
            q = q.where(AuditEvent.id < before)
        with self.db.read() as s:
            return list(s.scalars(q.order_by(AuditEvent.id.desc()).limit(limit)))
