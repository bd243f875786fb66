"""How the CLI prints metrics by the server's catalog (api/cli/catalog_view.py), with known text:
an exact entry wins over a family listed before it, a fraction carries no unit word, the progress
line shows the `progress` entries, a grid table's step is its newest cell's and its columns are as
wide as their longest name, names the catalog lacks are all listed in order, and a server without
the catalog route (404) falls back to this package's catalog."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from api.cli.catalog_view import MetricCatalogView
from api.client import ApiError, Client
from api.routers.metrics import MetricCatalog
from api.schemas import LatestMetric
from workers.metrics import catalog_json


def at(value: float, step: int = 3) -> LatestMetric:
    return LatestMetric(step=step, value=value, seq=1, time=0.0)


def real() -> MetricCatalogView:
    return MetricCatalogView(MetricCatalog.model_validate(catalog_json()))


def entry(name: str, regex: str, fields: list[str], **kw: Any) -> dict[str, Any]:
    base = {
        "name": name,
        "key": name,
        "title": name,
        "unit": "",
        "group": "train",
        "description": "",
        "format": "num",
        "digits": 4,
        "per_rank": False,
        "view": "line",
        "fields": fields,
        "regex": regex,
        "grid": None,
        "column": False,
        "progress": False,
    }
    return {**base, **kw}


def test_an_exact_entry_wins_over_a_family_listed_first() -> None:
    cat = catalog_json()
    cat["metrics"] = [
        entry("acc/{k}", r"^acc/([^/]+)$", ["k"], format="fixed", digits=1),
        entry("acc/mean", r"^acc/mean$", [], unit="fraction", format="num"),
    ]
    view = MetricCatalogView(MetricCatalog.model_validate(cat))
    info, values = view.lookup("acc/mean")
    assert info is not None and info.name == "acc/mean" and values == []
    assert view.lookup("acc/7")[1] == ["7"]
    assert view.text("acc/mean", 0.5) == "50%"  # a fraction: the percent sign, no unit word
    assert view.text("acc/7", 0.25) == "0.2"


def test_the_progress_line_shows_the_progress_entries() -> None:
    latest = {"loss": at(2.1), "stage": at(1.0), "tokens_per_s": at(1234.0), "lr": at(3e-4)}
    view = real()
    assert view.summary(latest, "progress") == "loss 2.1000 nats/token  stage 1  tokens_per_s 1.23k"
    assert view.summary(latest, "column") == "loss 2.1000 nats/token  tokens_per_s 1.23k"


def test_a_grid_table_takes_the_newest_step_and_its_widest_column() -> None:
    latest = {
        "passkey_acc/len=1024/depth=0.333333333": at(0.5, step=5),
        "passkey_acc/len=2048/depth=0.333333333": at(1.0, step=9),
    }
    lines = real().status_lines(latest)
    title = next(
        m["title"] for m in catalog_json()["metrics"] if m["name"].startswith("passkey_acc/")
    )
    assert lines[0] == f"  {title} (step 9)"  # the newest cell's step, not the oldest's
    corner = "len \\ depth"
    assert lines[1] == f"    {corner:>12} 0.333333333"
    assert lines[2] == f"    {'1024':>12} {'50%':>11}"
    assert lines[3] == f"    {'2048':>12} {'100%':>11}"


def test_names_the_catalog_lacks_are_all_listed_in_order() -> None:
    lines = real().status_lines({"zeta": at(2.0), "alpha": at(1.0)})
    assert [line.split()[0] for line in lines] == ["alpha", "zeta"]


def test_a_server_without_the_catalog_route_uses_the_packages() -> None:
    def client(status: int) -> Client:
        body = {"error": {"code": "x", "message": "no"}}
        transport = httpx.MockTransport(lambda r: httpx.Response(status, json=body))
        return Client("http://test", "tok", transport=transport)

    view = MetricCatalogView.fetch(client(404))
    assert [m.name for m in view.metrics] == [m["name"] for m in catalog_json()["metrics"]]
    with pytest.raises(ApiError):
        MetricCatalogView.fetch(client(500))
