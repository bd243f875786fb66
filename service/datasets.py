"""Prepared datasets on the cluster: the prepare runs behind `/v1/datasets` and their rows.

`POST /v1/datasets` stores a row QUEUED (`store.datasets`) and starts
`python -m workers.data.prepare ... --json-progress` as a one-off task through the launcher
(`Launcher.run_task`: a Ray job on the shared cluster, a RayJob of its own in Kueue mode), so the
control plane never imports the tokenizing code and a prepare outlives a control-plane restart. The
prepare prints one JSON line per progress update and a final `{"dataset": ...}` line; `refresh`
reads the task's status and log through the same launcher and writes what they say into the row.
Reads refresh rows that are not finished, so no background loop is needed and any replica can serve
them. States: QUEUED -> RUNNING -> SUCCEEDED | FAILED.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from service import tasks
from service.launcher import Launcher, TaskRequest
from service.models import DatasetRow
from service.store.datasets import Datasets
from service.tasks import TERMINAL

PREPARE_MODULE = "workers.data.prepare"


@dataclass(frozen=True)
class PrepareRequest:
    source: str
    out: str
    tokenizer: str
    format: str = "text"
    text_field: str = "text"

    def args(self) -> tuple[str, ...]:
        """`python -m workers.data.prepare`'s arguments for this request."""
        return (
            self.source,
            *("--tokenizer", self.tokenizer, "--out", self.out, "--format", self.format),
            *("--text-field", self.text_field, "--json-progress"),
        )

    def task(self, dataset_id: str) -> TaskRequest:
        """The cluster task that prepares dataset `dataset_id`."""
        return TaskRequest(
            task_id=f"dataset-{dataset_id}",
            module=PREPARE_MODULE,
            args=self.args(),
            metadata={"ringtrain_dataset_id": dataset_id},
        )


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
    """The prepare runs behind `/v1/datasets`: rows in `store.datasets`, tasks through the
    launcher's protocol only (whatever runs them: a shared Ray cluster or Kueue's RayJobs)."""

    def __init__(self, datasets: Datasets, launcher: Launcher) -> None:
        self.datasets, self.launcher = datasets, launcher

    def create(self, owner: str, req: PrepareRequest) -> dict[str, Any]:
        """Store the row and start its task; a failed start leaves a FAILED row saying why."""
        now = time.time()
        dataset_id = "d" + secrets.token_hex(6)
        task = req.task(dataset_id)
        self.datasets.add(
            DatasetRow(
                id=dataset_id,
                owner=owner,
                state="QUEUED",
                request=req.__dict__,
                submission_id=task.submission_id,
                created_at=now,
                updated_at=now,
            )
        )
        tasks.start(
            self.launcher, task, lambda **f: self.datasets.update(dataset_id, **f), "prepare"
        )
        found = self.get(dataset_id, owner)
        assert found is not None
        return found

    def refresh(self, dataset_id: str) -> None:
        """Bring an unfinished row up to date from its task's status and output."""
        row = self.datasets.get(dataset_id)
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
        fields.update(
            tasks.outcome(
                info,
                result,
                error,
                "prepare",
                "prepare again: a finished prepare makes that a no-op",
            )
        )
        if any(getattr(row, k) != v for k, v in fields.items()):  # a write only for news
            self.datasets.update(dataset_id, **fields)

    def get(self, dataset_id: str, owner: str) -> dict[str, Any] | None:
        self.refresh(dataset_id)
        row = self.datasets.get(dataset_id)
        return None if row is None or row.owner != owner else as_dict(row)

    def list(self, owner: str, limit: int = 100) -> list[dict[str, Any]]:
        ids = self.datasets.ids(owner, limit)
        for i in ids:
            self.refresh(i)
        return [as_dict(r) for r in self.datasets.rows(ids)]


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
