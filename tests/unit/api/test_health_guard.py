"""The health routes and the background Ray check, driven in process (route functions called
directly, the lifespan on a plain context over a real store on a temporary SQLite file; no server, and a
stand-in launcher instead of a Ray cluster): a Ray that goes down after a good
check is seen as down on the next one, recovers cleanly, and /healthz, /readyz and /metrics say so
with the documented fields and status codes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.routers.health import RayWatch, healthz, readyz, watch_ray
from api.telemetry import Telemetry
from service.db import make_engine
from service.launcher import ClusterInfo
from service.settings import Settings
from service.store import Store
from tests.support.stores import sqlite_store


class _Ray:
    """A launcher whose cluster call answers or raises, as the test says (a stand-in: the real
    ones need a Ray head or a Kubernetes API)."""

    def __init__(self) -> None:
        self.down: str | None = None

    def cluster(self) -> ClusterInfo:
        if self.down is not None:
            raise ConnectionError(self.down)
        return ClusterInfo()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with sqlite_store(tmp_path) as store:
        yield store


def test_ray_going_down_after_a_good_check_is_seen_and_recovery_clears_the_error() -> None:
    ray = _Ray()
    watch = RayWatch(ray.cluster, interval_s=60.0, timeout_s=2.0)

    async def go() -> list[tuple[str, str]]:
        seen = []
        await watch.check()
        seen.append((watch.state, watch.error))
        ray.down = "head gone"
        await watch.check()
        seen.append((watch.state, watch.error))
        ray.down = None
        await watch.check()
        seen.append((watch.state, watch.error))
        return seen

    try:
        seen = asyncio.run(go())
    finally:
        watch.close()
    assert seen == [("ok", ""), ("unreachable", "ConnectionError: head gone"), ("ok", "")]


def test_healthz_standalone_reports_leader_and_the_ray_error() -> None:
    ctx = SimpleNamespace(leadership=None)
    watch = SimpleNamespace(state="unreachable", error="ConnectionError: head gone")
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(ray_watch=watch)))
    assert healthz(ctx, request) == {  # type: ignore[arg-type]
        "status": "ok",
        "role": "leader",
        "replica": "standalone",
        "ray": "unreachable",
        "ray_error": "ConnectionError: head gone",
    }


def test_readyz_is_503_naming_the_store_when_it_fails(store: Store, tmp_path: Path) -> None:
    ok = asyncio.run(readyz(SimpleNamespace(store=store)))  # type: ignore[arg-type]
    assert ok.status_code == 200 and json.loads(ok.body) == {"status": "ready", "store": "ok"}
    # a real store whose database cannot be opened (its file path is a directory)
    gone = Store(make_engine(f"sqlite:///{tmp_path}"))
    bad = asyncio.run(readyz(SimpleNamespace(store=gone)))  # type: ignore[arg-type]
    body = json.loads(bad.body)
    assert bad.status_code == 503 and body["error"]["code"] == "not_ready"
    [detail] = body["error"]["details"]
    assert detail["component"] == "store"
    # the message is the store's own error (its wording below that is SQLite's)
    assert detail["message"].startswith("StoreError: ") and "database" in detail["message"]


def test_the_lifespan_wires_ray_down_and_the_ray_gauges(store: Store) -> None:
    """Under `watch_ray`, a down Ray makes `ctx.ray_down()` give the reason (requests then fail at
    once instead of waiting) and /metrics export ringtrain_ray_up 0 with a fresh check age."""
    ray = _Ray()
    ray.down = "head gone"
    tel = Telemetry(store)
    ctx = SimpleNamespace(
        settings=Settings(ray_check_interval_s=60.0, ray_check_timeout_s=2.0),
        launcher=ray,
        telemetry=tel,
        ray_down=lambda: None,
    )
    app = SimpleNamespace(state=SimpleNamespace(ctx=ctx))

    async def go() -> tuple[Any, Any, Any, Any]:
        async with watch_ray(app):  # type: ignore[arg-type]
            for _ in range(500):
                if app.state.ray_watch.checked is not None:
                    break
                await asyncio.sleep(0.01)
            get = tel.registry.get_sample_value
            return (
                ctx.ray_down(),
                get("ringtrain_ray_up"),
                get("ringtrain_ray_check_age_seconds"),
                app.state.ray_watch.state,
            )

    why, up, age, state = asyncio.run(go())
    assert state == "unreachable" and why == "ConnectionError: head gone"
    assert up == 0.0
    assert age is not None and 0.0 <= age < 5.0  # seconds since the check, not the interval
    assert tel.registry.get_sample_value("ringtrain_ray_up") is None  # unregistered at the end
