"""Metrics as the server's catalog says to show them: values with their units, the latest
metrics of a job, grids as tables."""

from __future__ import annotations

import re

from api.cli import units
from api.client import ApiError, Client
from api.routers.metrics import MetricCatalog, MetricInfo
from api.schemas import LatestMetric

SELF_UNIT = ("si", "bytes", "seconds", "percent")  # formats whose text already carries the unit


def format_value(info: MetricInfo | None, value: float | None) -> str:
    """One value as the catalog's unit or format says (units.py: the dashboard writes the same)."""
    if info is None:
        return units.format_value("", "num", 4, value)
    return units.format_value(info.unit, info.format, info.digits, value)


class MetricCatalogView:
    """The server's metric catalog, for printing: which entry a name belongs to, and its text."""

    def __init__(self, catalog: MetricCatalog) -> None:
        self.metrics = catalog.metrics
        # a name's entry is its exact one, else the first family that matches (as on the server)
        ordered = sorted(catalog.metrics, key=lambda m: bool(m.fields))
        self._tests = [(m, re.compile(m.regex)) for m in ordered]

    @classmethod
    def fetch(cls, c: Client) -> MetricCatalogView:
        """The server's catalog; this package's own where the server predates the route (404)."""
        try:
            return cls(c.metric_catalog())
        except ApiError as e:
            if e.status != 404:
                raise
            from workers.metrics import catalog_json

            return cls(MetricCatalog.model_validate(catalog_json()))

    def lookup(self, name: str) -> tuple[MetricInfo | None, list[str]]:
        """(entry, field values) of a metric name; (None, []) for a name the catalog lacks."""
        for info, test in self._tests:
            m = test.match(name)
            if m is not None:
                return info, list(m.groups())
        return None, []

    def text(self, name: str, value: float | None) -> str:
        """`value` with its unit where the format does not already write one."""
        info, _ = self.lookup(name)
        out = format_value(info, value)
        if info is not None and info.unit not in ("", "fraction") and info.format not in SELF_UNIT:
            out += f" {info.unit}"
        return out

    def marked(self, flag: str) -> list[MetricInfo]:
        """The entries with `column` or `progress` set, in catalog order."""
        return [m for m in self.metrics if getattr(m, flag)]

    def summary(self, latest: dict[str, LatestMetric], flag: str) -> str:
        """`loss 2.1000  tokens_per_s 1.23k`: the latest value of each entry marked `flag`."""
        shown = [m.name for m in self.marked(flag) if m.name in latest]
        return "  ".join(f"{name} {self.text(name, latest[name].value)}" for name in shown)

    def status_lines(self, latest: dict[str, LatestMetric]) -> list[str]:
        """A job's latest metrics in catalog order: one line per name, a table per grid family."""
        by_entry: dict[int, list[tuple[str, list[str]]]] = {}
        unknown: list[str] = []
        for name in latest:
            info, values = self.lookup(name)
            if info is None:
                unknown.append(name)
            else:
                by_entry.setdefault(self.metrics.index(info), []).append((name, values))
        lines: list[str] = []
        for i, members in sorted(by_entry.items()):
            info = self.metrics[i]
            if info.view == "grid":
                lines += self._grid(info, members, latest)
                continue
            for name, _ in sorted(members, key=lambda nv: [_natural(v) for v in nv[1]]):
                m = latest[name]
                lines.append(f"  {name:<18} {self.text(name, m.value):<18} (step {m.step})")
        for name in sorted(unknown):
            point = latest[name]
            lines.append(f"  {name:<18} {self.text(name, point.value):<18} (step {point.step})")
        return lines

    @staticmethod
    def _grid(
        info: MetricInfo,
        members: list[tuple[str, list[str]]],
        latest: dict[str, LatestMetric],
    ) -> list[str]:
        """A grid family's latest values as a table, rows and columns as the catalog names them."""
        if info.grid is None:
            return []
        row_at, col_at = info.fields.index(info.grid.rows), info.fields.index(info.grid.columns)
        cells = {(v[row_at], v[col_at]): latest[name] for name, v in members}
        rows = sorted({r for r, _ in cells}, key=_natural)
        cols = sorted({c for _, c in cells}, key=_natural)
        width = max(7, *(len(c) for c in cols))
        step = max(m.step for m in cells.values())
        corner = f"{info.grid.rows} \\ {info.grid.columns}"
        out = [f"  {info.title} (step {step})"]
        out.append(f"    {corner:>12} " + " ".join(f"{c:>{width}}" for c in cols))
        for r in rows:
            vals = [format_value(info, cells[r, c].value) if (r, c) in cells else "-" for c in cols]
            out.append(f"    {r:>12} " + " ".join(f"{v:>{width}}" for v in vals))
        return out


_LEADING_NUMBER = re.compile(r"[-+]?\d+(\.\d*)?([eE][-+]?\d+)?")


def _natural(text: str) -> tuple[int, float, str]:
    """Values that start with a number by that number, before any other text: len=1024 after
    len=256, and the position bucket 128-256 after 64-128 (not after 1024-2048)."""
    m = _LEADING_NUMBER.match(text)
    if m is None:
        return (1, 0.0, text)
    return (0, float(m.group()), text)
