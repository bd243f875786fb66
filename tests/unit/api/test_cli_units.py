"""The CLI's metric values by unit (api/cli/units.py): each unit of the catalog, flat zeros, very
large and non-finite values, and `status` lines written through it. The dashboard's units.js is
checked against the same answers in tests/unit/api/browser/test_charts_browser.py."""

from __future__ import annotations

import math

import pytest

from api.cli.catalog_view import MetricCatalogView
from api.cli.units import format_value, js_number
from api.routers.metrics import MetricCatalog
from api.schemas import LatestMetric
from workers.metrics import catalog_json

# (unit, format, digits, value, text): the answers units.js gives too (but NaN and exp)
KNOWN = [
    ("fraction", "percent", 4, 0.0, "0%"),
    ("fraction", "percent", 4, 1 / 3, "33.3%"),
    ("fraction", "percent", 4, 1.0, "100%"),
    ("fraction", "percent", 4, 1e30, "1e+32%"),
    ("bytes", "bytes", 4, 100.0, "100 B"),
    ("bytes", "bytes", 4, 1536.0, "1.5 KiB"),
    ("bytes", "bytes", 4, 3.2e9, "2.98 GiB"),
    ("bytes", "bytes", 4, 15.37 * 2**30, "15.4 GiB"),
    ("bytes", "bytes", 4, 3 * 2**50, "3 PiB"),
    ("bytes", "bytes", 4, 1e30, "1.00e+30 B"),
    ("tokens/s", "si", 4, 999.0, "999"),
    ("tokens/s", "si", 4, 53800.0, "53.8k"),
    ("tokens/s", "si", 4, 3.2e15, "3.2P"),
    ("tokens/s", "si", 4, 1e30, "1.00e+30"),
    ("s", "seconds", 4, 0.37, "370 ms"),
    ("s", "seconds", 4, 2.5, "2.5 s"),
    ("s", "seconds", 4, 1234.0, "1230 s"),
    ("nats/token", "fixed", 4, 2.1, "2.1000"),
    ("nats/token", "fixed", 4, 0.0, "0.0000"),
    ("nats/token", "fixed", 4, 1e30, "1.00e+30"),
    ("tokens", "fixed", 0, 8192.0, "8192"),
]


@pytest.mark.parametrize(("unit", "fmt", "digits", "value", "text"), KNOWN)
def test_each_unit_writes_its_values(
    unit: str, fmt: str, digits: int, value: float, text: str
) -> None:
    assert format_value(unit, fmt, digits, value) == text


def test_the_unit_decides_over_the_format() -> None:
    """A fraction is a percentage and bytes are binary, whatever format an entry names."""
    assert format_value("fraction", "num", 4, 0.25) == "25%"
    assert format_value("bytes", "num", 4, 2048.0) == "2 KiB"
    assert format_value("", "exp", 1, 3e-4) == "3.0e-04"  # no unit: the format's
    assert format_value("", "num", 4, 1234.5678) == "1235"


def test_non_finite_values() -> None:
    assert format_value("nats/token", "fixed", 4, None) == "nan"
    assert format_value("nats/token", "fixed", 4, math.nan) == "nan"
    assert format_value("tokens/s", "si", 4, math.inf) == "inf"
    assert format_value("bytes", "bytes", 4, -math.inf) == "-inf"


def test_numbers_as_javascript_writes_them() -> None:
    assert [js_number(x) for x in (0.0, 75.0, 33.3, 1e-5, 1e-7, 1e32, 1.5e32, -2.0)] == [
        "0", "75", "33.3", "0.00001", "1e-7", "1e+32", "1.5e+32", "-2",
    ]  # fmt: skip


def test_status_lines_write_values_by_unit() -> None:
    view = MetricCatalogView(MetricCatalog.model_validate(catalog_json()))
    latest = {
        name: LatestMetric(step=3, value=value, seq=i, time=0.0)
        for i, (name, value) in enumerate(
            [("loss", 1e30), ("passkey_acc", 0.0), ("tokens_per_s", 3.2e15)]
        )
    }
    lines = view.status_lines(latest)
    assert [line.split()[:2] for line in lines] == [
        ["loss", "1.00e+30"],
        ["tokens_per_s", "3.2P"],
        ["passkey_acc", "0%"],
    ]
    assert view.summary(latest, "column") == "loss 1.00e+30 nats/token  tokens_per_s 3.2P"
