"""Metric values as text, by the catalog's unit (a fraction as a percentage, bytes, tokens/s,
seconds, nats/token), else by its format: the rules of the dashboard's `api/static/js/units.js`,
so a value reads the same in `ringtrain status` and `list` as on the job page. Two differences
are kept for a terminal: a missing or NaN value is "nan" (the page writes a dash), and `exp`
writes Python's exponent ("3.0e-04")."""

from __future__ import annotations

import math
from decimal import Decimal

# the format that writes each unit; other units (and "") use the entry's own format
FORMAT_OF_UNIT = {
    "fraction": "percent",
    "bytes": "bytes",
    "tokens/s": "si",
    "s": "seconds",
    "nats/token": "fixed",
    "tokens": "fixed",
}
LARGE = 1e6  # fixed-point values from here on are written in scientific notation
SI = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
BINARY = (
    (2**60, "EiB"),
    (2**50, "PiB"),
    (2**40, "TiB"),
    (2**30, "GiB"),
    (2**20, "MiB"),
    (2**10, "KiB"),
)


def js_number(x: float) -> str:
    """`x` as JavaScript writes a number: shortest digits, no ".0", exponent from 1e21 up."""
    if x == 0:
        return "0"
    if abs(x) >= 1e21 or abs(x) < 1e-6:
        mantissa, exp = repr(x).replace("E", "e").split("e")
        return f"{mantissa.removesuffix('.0')}e{int(exp):+d}"
    if x == int(x):
        return str(int(x))
    return format(Decimal(repr(x)), "f")  # positional, as JS writes 0.00001


def _rounded(x: float, decimals: int) -> str:
    """JavaScript's `+x.toFixed(decimals)`: rounded, then written without trailing zeros."""
    return js_number(float(f"{x:.{decimals}f}"))


def format_value(unit: str, fmt: str, digits: int, value: float | None) -> str:
    """One value of a metric whose catalog entry has `unit`, `format` and `digits`."""
    if value is None or math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    fmt = FORMAT_OF_UNIT.get(unit, fmt)
    a = abs(value)
    if fmt == "fixed":
        return f"{value:.2e}" if a >= LARGE else f"{value:.{digits}f}"
    if fmt == "exp":
        return f"{value:.{digits}e}"
    if fmt == "percent":
        return _rounded(value * 100, 1) + "%"
    if fmt == "seconds":  # JavaScript's +x.toPrecision(3)
        if a < 1:
            return js_number(float(f"{value * 1000:.3g}")) + " ms"
        return js_number(float(f"{value:.3g}")) + " s"
    if fmt == "si":
        if a >= 1e21:
            return f"{value:.2e}"
        for size, suffix in SI:
            if a >= size:
                return _rounded(value / size, 2) + suffix
        return f"{value:.3g}"
    if fmt == "bytes":
        if a >= 2**70:
            return f"{value:.2e} B"
        for size, suffix in BINARY:
            if a >= size:
                return f"{_rounded(value / size, 1 if a >= 10 * size else 2)} {suffix}"
        return f"{value:.0f} B"
    return f"{value:.{digits}g}"
