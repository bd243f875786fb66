"""The datasets aggregate: one row per prepare run (`POST /v1/datasets`), written by
`service.datasets.DatasetService` as it submits the prepare and reads its progress back.

No events and no job lock: a dataset row belongs to no job, and its readers poll it.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from service.models import DatasetRow
from service.store.database import Database


class Datasets:
    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, row: DatasetRow) -> None:
        with self.db.write() as (s, _):
            s.add(row)

    def update(self, dataset_id: str, **fields: Any) -> None:
        """Set `fields` and `updated_at`; a row that is gone is left gone."""
        with self.db.write() as (s, _):
            row = s.get(DatasetRow, dataset_id)
            if row is not None:
                for k, v in fields.items():
                    setattr(row, k, v)
                row.updated_at = time.time()

    def get(self, dataset_id: str) -> DatasetRow | None:
        with self.db.read() as s:
            return s.get(DatasetRow, dataset_id)

    def ids(self, owner: str, limit: int = 100) -> list[str]:
        """The owner's newest `limit` datasets' ids, newest first."""
        q = (
            select(DatasetRow.id)
            .where(DatasetRow.owner == owner)
            .order_by(DatasetRow.created_at.desc())
            .limit(limit)
        )
        with self.db.read() as s:
            return list(s.scalars(q))

    def rows(self, ids: list[str]) -> list[DatasetRow]:
        """These rows, newest first."""
        q = select(DatasetRow).where(DatasetRow.id.in_(ids)).order_by(DatasetRow.created_at.desc())
        with self.db.read() as s:
            return list(s.scalars(q))
