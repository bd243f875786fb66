"""/v1/plan and /v1/cluster when Ray cannot be read, and a staged spec with a fit request, driven in
process (route functions on a fake context): the cluster route answers 503 `ray_unavailable`, the
plan still answers with the reason as its first warning, and fit on a staged job is a 422 naming
`fit` (stages are fitted one by one through `ring_size: auto`)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from api.errors import ApiError
from api.routers.cluster import get_cluster, plan_job
from service.launcher import ClusterInfo
from tests.support.api_harness import TINY_SPEC

STAGED: dict[str, Any] = {
    **{k: v for k, v in TINY_SPEC.items() if k != "train"},  # stages carry the steps
    "parallel": {"ring_size": 1},
    "stages": [{"steps": 2}, {"steps": 2, "data": {"seq_len": 256}}],
}


class _DownCtx:
    settings = SimpleNamespace(resolved_data_roots=lambda: [], autoscaler_nodes=[])

    async def cluster(self, max_age_s: float = 5.0) -> ClusterInfo:
        raise ConnectionError("ray head gone")


class _Req:
    def __init__(self, body: dict[str, Any]) -> None:
        self._body = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}

    async def body(self) -> bytes:
        return self._body


def test_the_cluster_route_is_503_when_ray_is_unreachable() -> None:
    with pytest.raises(ApiError) as e:
        asyncio.run(get_cluster(_DownCtx(), "alice"))  # type: ignore[arg-type]
    assert (e.value.status, e.value.code) == (503, "ray_unavailable")
    assert "ray head gone" in e.value.message


def test_a_plan_without_the_cluster_says_why_first() -> None:
    out = asyncio.run(plan_job(_Req(TINY_SPEC), _DownCtx(), "alice"))  # type: ignore[arg-type]
    assert out.cluster_error == "cannot read the cluster: ConnectionError: ray head gone"
    assert out.warnings[0] == (
        "cannot read the cluster: ConnectionError: ray head gone - placement not previewed"
    )
    assert out.valid


@pytest.mark.parametrize(
    "kw",
    [
        {"fit": True, "fit_memory_per_rank_gib": None},
        {"fit": False, "fit_memory_per_rank_gib": 8.0},
    ],
)
def test_fit_on_a_staged_spec_is_422_naming_fit(kw: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as e:
        asyncio.run(plan_job(_Req(STAGED), _DownCtx(), "alice", **kw))  # type: ignore[arg-type]
    assert (e.value.status, e.value.field) == (422, "fit")
