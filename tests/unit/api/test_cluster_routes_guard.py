"""The cluster routes' own logic, called in process: the plan body's `{"spec", "fit"}` wrapper,
the cluster totals over alive nodes only, and the context's short cache of the cluster view that
never waits on a Ray the background check found unreachable."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from api.deps import AppContext
from api.errors import ApiError
from api.routers.cluster import get_cluster, unwrap_plan_body
from service.launcher import ClusterInfo, NodeInfo

SPEC = {"name": "x"}


def test_a_wrapped_plan_body_is_unwrapped() -> None:
    body = json.dumps({"spec": SPEC, "fit": {"memory_per_rank_gib": 12.5}}).encode()
    spec, ctype, fit = unwrap_plan_body(body, "Application/JSON; charset=utf-8")
    assert json.loads(spec) == SPEC and ctype == "application/json"
    assert fit is not None and fit.memory_per_rank_gib == 12.5
    spec, ctype, fit = unwrap_plan_body(json.dumps({"spec": SPEC}).encode(), "application/json")
    assert json.loads(spec) == SPEC and fit is not None and fit.memory_per_rank_gib is None


def test_other_bodies_are_the_spec_itself() -> None:
    plain = json.dumps(SPEC).encode()
    assert unwrap_plan_body(plain, "application/json") == (plain, "application/json", None)
    yaml = b"spec: {name: x}\n"  # YAML is never a wrapper, even with a `spec` key
    assert unwrap_plan_body(yaml, "application/yaml") == (yaml, "application/yaml", None)
    assert unwrap_plan_body(b"{oops", "application/json") == (b"{oops", "application/json", None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"spec": SPEC, "fit": {}, "extra": 1}, "extra"),
        ({"spec": SPEC, "fit": {"memory_per_rank_gib": 0}}, "fit.memory_per_rank_gib"),
        ({"spec": SPEC, "fit": {"budget": 1}}, "fit.budget"),
    ],
)
def test_a_bad_wrapper_is_422_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as e:
        unwrap_plan_body(json.dumps(body).encode(), "application/json")
    assert (e.value.status, e.value.field) == (422, field)


class _Ctx:
    def __init__(self, info: ClusterInfo) -> None:
        self.info = info

    async def cluster(self, max_age_s: float = 5.0) -> ClusterInfo:
        return self.info


def test_cluster_totals_count_alive_nodes_only() -> None:
    nodes = [
        NodeInfo("a", "", True, 16, 10, 4, 3),
        NodeInfo("b", "", True, 8, 2, 2, 0),
        NodeInfo("dead", "", False, 64, 64, 8, 8),
    ]
    out = asyncio.run(get_cluster(_Ctx(ClusterInfo(nodes)), "alice"))  # type: ignore[arg-type]
    assert (out.cpus_total, out.cpus_free, out.gpus_total, out.gpus_free) == (24, 12, 6, 3)
    assert [n.node_id for n in out.nodes] == ["a", "b", "dead"]  # listed, not counted


class _Launcher:
    def __init__(self) -> None:
        self.calls = 0

    def cluster(self) -> ClusterInfo:
        self.calls += 1
        return ClusterInfo([NodeInfo(f"n{self.calls}", "", True, 1, 1, 0, 0)])


def _ctx(launcher: _Launcher, down: list[str | None]) -> AppContext:
    none: Any = None
    return AppContext(none, none, none, launcher, none, {}, none, none, ray_down=lambda: down[0])  # type: ignore[arg-type]


def test_the_cluster_view_is_cached_briefly_and_never_waits_on_a_down_ray() -> None:
    launcher, down = _Launcher(), [None]
    ctx = _ctx(launcher, down)

    async def go() -> list[str]:
        seen = [(await ctx.cluster(max_age_s=60)).nodes[0].node_id]
        seen.append((await ctx.cluster(max_age_s=60)).nodes[0].node_id)  # cached
        seen.append((await ctx.cluster(max_age_s=0)).nodes[0].node_id)  # too old: asked again
        down[0] = "no answer for 2.0 s"
        seen.append((await ctx.cluster(max_age_s=60)).nodes[0].node_id)  # fresh cache still serves
        with pytest.raises(ConnectionError, match=r"no answer for 2\.0 s"):
            await ctx.cluster(max_age_s=0)
        return seen

    assert asyncio.run(go()) == ["n1", "n1", "n2", "n2"]
    assert launcher.calls == 2  # the down check refused without calling the launcher
