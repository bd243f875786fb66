"""The ingest tokens aggregate: each driver attempt's token, kept only as a hash."""

from __future__ import annotations

import hashlib
import hmac

from sqlalchemy import select

from service.models import Job
from service.store.database import Database


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    def __init__(self, db: Database) -> None:
        self.db = db

    def check(self, job_id: str, token: str) -> bool:
        """Whether the token is the job's current one (each driver attempt gets a new one). A
        terminal job's token still matches here; `Metrics.apply_report` refuses its reports
        (`JobEnded`)."""
        with self.db.read() as s:
            h = s.scalar(select(Job.ingest_token_hash).where(Job.id == job_id))
        # compare even when the job is unknown, so timing says nothing about which ids exist
        return hmac.compare_digest(h or "0" * 64, hash_token(token)) and h is not None

    def replace(self, job_id: str, token_hash: str) -> None:
        """The new attempt's token: the previous driver's stops working."""
        with self.db.write() as (s, _):
            self.db.lock_job(s, job_id).ingest_token_hash = token_hash
