"""The CLI's value text exactly at each switch-over of units.js (api/static/js/util.js): the
answers below are what JavaScript writes (`String(1e21)`, `(2**70).toExponential(2)`,
`+(1).toPrecision(3)`), so `ringtrain status` and the dashboard agree on the boundary values too,
not only well inside each range."""

from __future__ import annotations

import pytest

from api.cli.units import format_value, js_number

EDGES = [
    ("s", "seconds", 4, 1.0, "1 s"),  # |v| < 1 is ms; 1 itself is seconds
    ("s", "seconds", 4, 0.999, "999 ms"),
    ("bytes", "bytes", 4, float(2**70), "1.18e+21 B"),  # a >= 2**70: exponent
    ("bytes", "bytes", 4, float(2**10), "1 KiB"),
    ("bytes", "bytes", 4, 1023.0, "1023 B"),
    ("tokens/s", "si", 4, 1e21, "1.00e+21"),  # a >= 1e21: exponent, not "1000E"
    ("tokens/s", "si", 4, 1e18, "1E"),
    ("tokens/s", "si", 4, 1000.0, "1k"),
    ("tokens", "fixed", 0, 1e6, "1.00e+06"),  # LARGE itself is scientific
    ("tokens", "fixed", 0, 999999.0, "999999"),
]


@pytest.mark.parametrize(("unit", "fmt", "digits", "value", "text"), EDGES)
def test_values_at_the_switch_over(
    unit: str, fmt: str, digits: int, value: float, text: str
) -> None:
    assert format_value(unit, fmt, digits, value) == text


def test_numbers_at_the_exponent_thresholds() -> None:
    """JavaScript's String(): exponent from 1e21 up and below 1e-6, positional in between."""
    assert js_number(1e21) == "1e+21"
    assert js_number(-1e21) == "-1e+21"
    assert js_number(9.5e20) == "950000000000000000000"
    assert js_number(1e-6) == "0.000001"
    assert js_number(9e-7) == "9e-7"
