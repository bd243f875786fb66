"""Prepared datasets on the cluster: a table of prepare runs and the Ray job that does each one.

`POST /v1/datasets` stores a row QUEUED and submits
`python -m workers.data.prepare ... --json-progress` as a Ray job through the Jobs API (like
training drivers, so the control plane never imports the tokenizing code and a prepare outlives a
control-plane restart). The prepare prints one JSON line per progress update and a final
`{"dataset": ...}` line; `refresh` reads the job's status and log tail and writes what it says into
the row. Reads refresh rows that are not finished, so no background loop is needed and any replica
can serve them. States: QUEUED -> RUNNING -> SUCCEEDED | FAILED.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Float, Index, String, Text, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Mapped, Session, mapped_column

from service.launcher import DriverStatus, Launcher
from service.models import Base

TERMINAL = ("SUCCEEDED", "FAILED")
PREPARE_MODULE = "workers.data.prepare"


class DatasetRow(Base):
    __tablename__ = "datasets"
    __table_args__ = (Index("ix_datasets_owner_created", "owner", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    submission_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


@dataclass(frozen=True)
class PrepareRequest:
    source: str
    out: str
    tokenizer: str
    format: str = "text"
    text_field: str = "text"

    def entrypoint(self, python: str) -> str:
        args = [
            self.source,
            "--tokenizer",
            self.tokenizer,
            "--out",
            self.out,
            "--format",
            self.format,
        ]
        args += ["--text-field", self.text_field, "--json-progress"]
        return " ".join([shlex.quote(python), "-m", PREPARE_MODULE, *map(shlex.quote, args)])


def parse_log(text: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
    """(last progress, the final dataset summary, the error line) from a prepare's output."""
    progress = result = None
    error = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("error: "):
            error = line[len("error: ") :]
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "progress" in obj:
            progress = obj["progress"]
        elif isinstance(obj, dict) and "dataset" in obj:
            result = obj["dataset"]
    return progress, result, error


class DatasetService:
    """The datasets table and the prepare jobs behind it."""

    def __init__(self, engine: Engine, launcher: Launcher) -> None:
        self.engine, self.launcher = engine, launcher

    def _client(self) -> Any:
        address, headers = (
            getattr(self.launcher, "address", None),
            getattr(self.launcher, "headers", None),
        )
        if address is None:
            raise RuntimeError(
                "preparing datasets on the cluster needs a Ray cluster (RINGTRAIN_RAY_ADDRESS)"
            )
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(address, headers=dict(headers or {}))

    def create(self, owner: str, req: PrepareRequest) -> dict[str, Any]:
        """Store the row and submit its Ray job; a failed submission leaves a FAILED row saying
        why."""
        now = time.time()
        dataset_id = "d" + secrets.token_hex(6)
        submission_id = f"ringtrain-dataset-{dataset_id}"
        with Session(self.engine) as s, s.begin():
            s.add(
                DatasetRow(
                    id=dataset_id,
                    owner=owner,
                    state="QUEUED",
                    request=req.__dict__,
                    submission_id=submission_id,
                    created_at=now,
                    updated_at=now,
                )
            )
        python = getattr(self.launcher, "python", "python")
        try:
            self._client().submit_job(
                entrypoint=req.entrypoint(python),
                submission_id=submission_id,
                runtime_env={"env_vars": dict(getattr(self.launcher, "extra_env", {}) or {})},
                metadata={"ringtrain_dataset_id": dataset_id},
            )
        except Exception as e:  # the Jobs API raises RuntimeError, connection errors, ...
            self._update(
                dataset_id, state="FAILED", error=f"could not submit the prepare to Ray: {e}"
            )
        found = self.get(dataset_id, owner)
        assert found is not None
        return found

    def _update(self, dataset_id: str, **fields: Any) -> None:
        with Session(self.engine) as s, s.begin():
            row = s.get(DatasetRow, dataset_id)
            if row is not None:
                for k, v in fields.items():
                    setattr(row, k, v)
                row.updated_at = time.time()

    def refresh(self, dataset_id: str) -> None:
        """Bring an unfinished row up to date from its Ray job's status and output."""
        with Session(self.engine) as s:
            row = s.get(DatasetRow, dataset_id)
            if row is None or row.state in TERMINAL or row.submission_id is None:
                return
            sid = row.submission_id
        try:
            info = self.launcher.status(sid)
            log = self.launcher.logs(sid)
        except Exception:  # the cluster is unreachable now: the row stays as it was
            return
        progress, result, error = parse_log(log)
        fields: dict[str, Any] = {"progress": progress} if progress else {}
        if info.status is DriverStatus.SUCCEEDED and result is not None:
            fields.update(state="SUCCEEDED", result=result)
        elif info.status in (DriverStatus.FAILED, DriverStatus.STOPPED) or (
            info.status is DriverStatus.SUCCEEDED and result is None
        ):
            fields.update(
                state="FAILED",
                error=error or info.message or f"the prepare job ended {info.status.value}",
            )
        elif info.status is DriverStatus.RUNNING:
            fields["state"] = "RUNNING"
        if fields:
            self._update(dataset_id, **fields)

    def get(self, dataset_id: str, owner: str) -> dict[str, Any] | None:
        self.refresh(dataset_id)
        with Session(self.engine) as s:
            row = s.get(DatasetRow, dataset_id)
            return None if row is None or row.owner != owner else as_dict(row)

    def list(self, owner: str, limit: int = 100) -> list[dict[str, Any]]:
        with Session(self.engine) as s:
            ids = s.scalars(
                select(DatasetRow.id)
                .where(DatasetRow.owner == owner)
                .order_by(DatasetRow.created_at.desc())
                .limit(limit)
            ).all()
        for i in ids:
            self.refresh(i)
        with Session(self.engine) as s:
            rows = s.scalars(
                select(DatasetRow)
                .where(DatasetRow.id.in_(ids))
                .order_by(DatasetRow.created_at.desc())
            )
            return [as_dict(r) for r in rows]


def as_dict(row: DatasetRow) -> dict[str, Any]:
    result = row.result or {}
    return {
        "id": row.id,
        "owner": row.owner,
        "state": row.state,
        **row.request,
        "progress": row.progress,
        "dataset_id": result.get("id"),
        "documents": result.get("documents"),
        "tokens": result.get("tokens"),
        "bytes": result.get("bytes"),
        "error": row.error,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }
