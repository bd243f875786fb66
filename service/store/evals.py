"""The evals aggregate: one row per evaluation run (`POST /v1/evals`), written by
`service.evals.EvalService` as it submits the evaluation and reads its progress and report back.

No events and no job lock, as for datasets: an eval row belongs to no job (it may name one whose
model it reads, which is done by then), and its readers poll it.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from service.models import EvalRow
from service.store.database import Database


class Evals:
    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, row: EvalRow) -> None:
        with self.db.write() as (s, _):
            s.add(row)

    def update(self, eval_id: str, **fields: Any) -> None:
        """Set `fields` and `updated_at`; a row that is gone is left gone."""
        with self.db.write() as (s, _):
            row = s.get(EvalRow, eval_id)
            if row is not None:
                for k, v in fields.items():
                    setattr(row, k, v)
                row.updated_at = time.time()

    def get(self, eval_id: str) -> EvalRow | None:
        with self.db.read() as s:
            return s.get(EvalRow, eval_id)

    def ids(self, owner: str, limit: int = 100) -> list[str]:
        """The owner's newest `limit` evals' ids, newest first."""
        q = (
            select(EvalRow.id)
            .where(EvalRow.owner == owner)
            .order_by(EvalRow.created_at.desc())
            .limit(limit)
        )
        with self.db.read() as s:
            return list(s.scalars(q))

    def rows(self, ids: list[str]) -> list[EvalRow]:
        """These rows, newest first."""
        q = select(EvalRow).where(EvalRow.id.in_(ids)).order_by(EvalRow.created_at.desc())
        with self.db.read() as s:
            return list(s.scalars(q))
