"""/v1/datasets driven in process (route functions on a fake dataset service): every path the
request names is held to the data roots under its own field name, a created dataset answers 201,
the list is the caller's, and the event stream sends one `progress` per change and a `done` at the
end, after a 404 for a dataset the caller cannot see."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.errors import ApiError
from api.routers import datasets as ds


class _Svc:
    def __init__(self, rows: list[dict[str, Any] | None] | None = None) -> None:
        self.created: list[tuple[str, Any]] = []
        self.rows = rows or []

    def create(self, owner: str, req: Any) -> dict[str, Any]:
        self.created.append((owner, req))
        return {"id": "d1", "owner": owner}

    def list(self, owner: str) -> list[dict[str, Any]]:
        return [{"id": "d1", "owner": owner}] if owner == "alice" else []

    def get(self, dataset_id: str, owner: str) -> dict[str, Any] | None:
        if owner != "alice":
            return None
        return self.rows.pop(0) if len(self.rows) > 1 else self.rows[0]


class _Req:
    def __init__(self, svc: _Svc, body: dict[str, Any] | None = None) -> None:
        self.app = SimpleNamespace(state=SimpleNamespace(datasets=svc))
        self._body = json.dumps(body or {}).encode()

    async def body(self) -> bytes:
        return self._body

    async def is_disconnected(self) -> bool:
        return False


def _ctx(root: Path) -> Any:
    return SimpleNamespace(settings=SimpleNamespace(resolved_data_roots=lambda: [root.resolve()]))


def _create(tmp_path: Path, **body: Any) -> tuple[_Svc, Any]:
    svc = _Svc()
    req = _Req(svc, body)
    return svc, asyncio.run(ds.create_dataset(req, _ctx(tmp_path / "root"), "alice"))  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["source", "out", "tokenizer"])
def test_each_path_outside_the_roots_is_a_422_naming_its_field(tmp_path: Path, field: str) -> None:
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    body = {"source": str(root / "a.txt"), "out": str(root / "o"), "tokenizer": str(root / "model")}
    body[field] = str(tmp_path / "elsewhere")
    with pytest.raises(ApiError) as e:
        _create(tmp_path, **body)
    assert e.value.status == 422 and e.value.field == field


def test_a_prepare_inside_the_roots_is_created_for_the_caller(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    svc, out = _create(
        tmp_path,
        source=str(root / "a.txt"),
        out=str(root / "o"),
        tokenizer=str(root / "model"),
        format="chat",
    )
    assert out == {"id": "d1", "owner": "alice"}
    owner, req = svc.created[0]
    assert owner == "alice" and req.tokenizer == str((root / "model").resolve())
    route = next(r for r in ds.router.routes if r.path == "/v1/datasets" and "POST" in r.methods)  # type: ignore[attr-defined]
    assert route.status_code == 201  # type: ignore[attr-defined]


def test_the_list_is_the_callers() -> None:
    svc = _Svc()
    got = asyncio.run(ds.list_datasets(_Req(svc), None, "alice"))  # type: ignore[arg-type]
    assert got == [{"id": "d1", "owner": "alice"}]


def _row(state: str, done: int) -> dict[str, Any]:
    return {"id": "d1", "state": state, "progress": {"done_bytes": done}}


def test_events_one_progress_per_change_then_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ds, "POLL_S", 0.0)
    rows = [
        _row("QUEUED", 0),  # the existence check
        _row("RUNNING", 10),
        _row("RUNNING", 10),  # unchanged: no event
        _row("RUNNING", 20),
        _row("SUCCEEDED", 30),
    ]
    svc = _Svc(list(rows))

    async def go() -> list[str]:
        resp = await ds.dataset_events("d1", _Req(svc), None, "alice")  # type: ignore[arg-type]
        return [chunk async for chunk in resp.body_iterator]  # type: ignore[misc]

    frames = asyncio.run(go())
    kinds = [(f.split("\n")[0], json.loads(f.split("\n")[1][6:])["progress"]) for f in frames]
    assert kinds == [
        ("event: progress", {"done_bytes": 10}),
        ("event: progress", {"done_bytes": 20}),
        ("event: progress", {"done_bytes": 30}),
        ("event: done", {"done_bytes": 30}),
    ]


def test_events_of_a_dataset_the_caller_cannot_see_is_404() -> None:
    svc = _Svc([_row("RUNNING", 1)])
    with pytest.raises(ApiError) as e:
        asyncio.run(ds.dataset_events("d1", _Req(svc), None, "bob"))  # type: ignore[arg-type]
    assert e.value.status == 404
