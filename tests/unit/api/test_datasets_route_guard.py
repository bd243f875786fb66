"""/v1/datasets driven in process (route functions on the real `DatasetService` over a real store on
a temporary SQLite file; only the launcher, the cluster's side, is a stand-in): every path the
request names is held to the data roots under its own field name, a created dataset answers 201,
the list is the caller's, and the event stream sends one `progress` per change and a `done` at the
end, after a 404 for a dataset the caller cannot see."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.errors import ApiError
from api.routers import datasets as ds
from service.datasets import DatasetService, PrepareRequest
from service.launcher import DriverInfo, DriverStatus, TaskRequest
from service.settings import Settings
from service.store import Store
from tests.support.stores import sqlite_store


class _Cluster:
    """The launcher's task calls (a stand-in: the real launchers need a Ray head or a Kubernetes
    API): records the tasks it starts, and answers each status read with the next scripted
    (status, output so far), holding the last one."""

    def __init__(self, script: list[tuple[DriverStatus, str]] | None = None) -> None:
        self.tasks: list[TaskRequest] = []
        self.script = script or [(DriverStatus.PENDING, "")]
        self.now = self.script[0]

    def run_task(self, task: TaskRequest) -> str:
        self.tasks.append(task)
        return task.submission_id

    def status(self, submission_id: str) -> DriverInfo:
        self.now = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return DriverInfo(self.now[0])

    def logs(self, submission_id: str) -> str:
        return self.now[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """One database for the module: each test reads only the datasets it created."""
    with sqlite_store(tmp_path_factory.mktemp("datasets")) as store:
        yield store


class _Req:
    def __init__(self, svc: DatasetService, body: dict[str, Any] | None = None) -> None:
        self.app = SimpleNamespace(state=SimpleNamespace(datasets=svc))
        self._body = json.dumps(body or {}).encode()

    async def body(self) -> bytes:
        return self._body

    async def is_disconnected(self) -> bool:
        return False


def _ctx(root: Path) -> Any:
    return SimpleNamespace(settings=Settings(data_roots=[str(root)]))


def _create(store: Store, tmp_path: Path, **body: Any) -> tuple[_Cluster, Any]:
    cluster = _Cluster()
    req = _Req(DatasetService(store.datasets, cluster), body)  # type: ignore[arg-type]
    return cluster, asyncio.run(ds.create_dataset(req, _ctx(tmp_path / "root"), "alice"))  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["source", "out", "tokenizer"])
def test_each_path_outside_the_roots_is_a_422_naming_its_field(
    store: Store, tmp_path: Path, field: str
) -> None:
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    body = {"source": str(root / "a.txt"), "out": str(root / "o"), "tokenizer": str(root / "model")}
    body[field] = str(tmp_path / "elsewhere")
    stored = store.datasets.ids("alice")
    with pytest.raises(ApiError) as e:
        _create(store, tmp_path, **body)
    assert e.value.status == 422 and e.value.field == field
    assert store.datasets.ids("alice") == stored  # nothing stored


def test_a_prepare_inside_the_roots_is_created_for_the_caller(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    cluster, out = _create(
        store,
        tmp_path,
        source=str(root / "a.txt"),
        out=str(root / "o"),
        tokenizer=str(root / "model"),
        format="chat",
    )
    assert (out["owner"], out["state"]) == ("alice", "QUEUED")
    (task,) = cluster.tasks
    assert task.metadata == {"ringtrain_dataset_id": out["id"]}
    row = store.datasets.get(out["id"])
    assert row is not None and row.owner == "alice"
    assert row.request["tokenizer"] == str((root / "model").resolve())
    route = next(r for r in ds.router.routes if r.path == "/v1/datasets" and "POST" in r.methods)  # type: ignore[attr-defined]
    assert route.status_code == 201  # type: ignore[attr-defined]


def test_the_list_is_the_callers(store: Store) -> None:
    svc = DatasetService(store.datasets, _Cluster())  # type: ignore[arg-type]
    mine = svc.create("alice", PrepareRequest("/data/a.txt", "/data/o", "bytes"))
    theirs = svc.create("bob", PrepareRequest("/data/b.txt", "/data/p", "bytes"))
    got = asyncio.run(ds.list_datasets(_Req(svc), None, "alice"))  # type: ignore[arg-type]
    assert got[0]["id"] == mine["id"]  # newest first
    assert {d["owner"] for d in got} == {"alice"}
    assert theirs["id"] not in {d["id"] for d in got}


def _out(*done: int, summary: bool = False) -> str:
    """A prepare's output so far: one progress line per update, then its summary line."""
    lines = [json.dumps({"progress": {"done_bytes": d}}) for d in done]
    if summary:
        lines.append(json.dumps({"dataset": {"id": "ds-1", "documents": 2, "tokens": 9}}))
    return "\n".join(lines) + "\n"


def test_events_one_progress_per_change_then_done(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ds, "POLL_S", 0.0)
    R, P = DriverStatus.RUNNING, DriverStatus.PENDING
    cluster = _Cluster(
        [
            (P, ""),  # read by the create
            (P, _out(0)),  # the existence check
            (R, _out(0, 10)),
            (R, _out(0, 10)),  # unchanged: no event
            (R, _out(0, 10, 20)),
            (DriverStatus.SUCCEEDED, _out(0, 10, 20, 30, summary=True)),
        ]
    )
    svc = DatasetService(store.datasets, cluster)  # type: ignore[arg-type]
    dataset_id = svc.create("alice", PrepareRequest("/data/a.txt", "/data/o", "bytes"))["id"]

    async def go() -> list[str]:
        resp = await ds.dataset_events(dataset_id, _Req(svc), None, "alice")  # type: ignore[arg-type]
        return [chunk async for chunk in resp.body_iterator]  # type: ignore[misc]

    frames = asyncio.run(go())
    kinds = [(f.split("\n")[0], json.loads(f.split("\n")[1][6:])["progress"]) for f in frames]
    assert kinds == [
        ("event: progress", {"done_bytes": 10}),
        ("event: progress", {"done_bytes": 20}),
        ("event: progress", {"done_bytes": 30}),
        ("event: done", {"done_bytes": 30}),
    ]


def test_events_of_a_dataset_the_caller_cannot_see_is_404(store: Store) -> None:
    svc = DatasetService(store.datasets, _Cluster([(DriverStatus.RUNNING, _out(1))]))  # type: ignore[arg-type]
    dataset_id = svc.create("alice", PrepareRequest("/data/a.txt", "/data/o", "bytes"))["id"]
    with pytest.raises(ApiError) as e:
        asyncio.run(ds.dataset_events(dataset_id, _Req(svc), None, "bob"))  # type: ignore[arg-type]
    assert e.value.status == 404
