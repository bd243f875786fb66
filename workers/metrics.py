"""The metric catalog: every metric ringtrain emits, defined once, next to the code that emits it.

The emit sites (`workers/training/trainer.py`, `evals.py`) take their names from the constants
here; the control plane serves `CATALOG` at `GET /v1/metrics/catalog`, and the dashboard (job page
charts, jobs list columns, evaluation grids) and the CLI (`status`, `list`, `submit --follow`) draw
from it. Adding a metric is one `Metric` entry here plus the emit; the dashboard and the CLI never
name it.

A `Metric` is one name (`loss`) or a family of names built from a pattern with `{field}`
placeholders (`passkey_acc/len={len}/depth={depth}`): `member(len=..., depth=...)` builds a name,
`match(name)` reads the fields back, and `regex` is the same test as a regular expression that both
Python and JavaScript read (one unnamed group per field, in `fields` order). Field values never
contain `/`.

Ground layer: no torch, no pydantic; the control plane may import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["num", "fixed", "si", "bytes", "seconds", "exp", "percent"]
View = Literal["line", "grid", "stat"]

FORMATS: dict[str, str] = {
    "num": "about `digits` significant digits",
    "fixed": "`digits` decimals",
    "si": "k/M/G/T suffixes",
    "bytes": "KiB/MiB/GiB/TiB",
    "seconds": "ms below one second, else s",
    "exp": "scientific notation with `digits` decimals",
    "percent": "a fraction shown as a percentage",
}
VIEWS: dict[str, str] = {
    "line": "a line chart over steps: one series, or one per rank, or one per family member",
    "grid": "a heat table of the latest value of each member, rows and columns from two fields",
    "stat": "the latest value as a figure (one-off measurements such as verification)",
}
GROUPS: dict[str, str] = {  # chart groups, in the order the job page shows them
    "training": "Training",
    "throughput": "Throughput",
    "memory": "Memory",
    "validation": "Held-out loss",
    "eval": "Evaluation",
    "verification": "Verification",
}

_FIELD = re.compile(r"\{([a-z][a-z0-9_]*)\}")
_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class Metric:
    """One metric (or a family of them): what it is, and how the dashboard and the CLI show it."""

    name: str  # the exact name, or a family's pattern with {field} placeholders
    title: str  # chart title, CLI label
    unit: str  # "" for a plain number
    group: str  # a key of GROUPS
    description: str  # one line: what it measures
    format: Format = "num"
    digits: int = 4
    per_rank: bool = False  # each rank emits its own value (MetricPoint.rank set)
    view: View = "line"
    grid: tuple[str, str] | None = None  # (row field, column field) of a "grid" family
    # a "line" family also drawn as a profile: x = this field's values (ordered numerically), y =
    # the latest evaluation's value of each member, and the first evaluation's as a second series
    profile: str | None = None
    column: bool = False  # a column of the jobs list (dashboard and `ringtrain list`)
    progress: bool = False  # on the `ringtrain submit --follow` progress line
    key: str = ""  # stable id for dashboard element ids; the name unless set (families set one)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(_FIELD.findall(self.name))

    @property
    def family(self) -> bool:
        return bool(self.fields)

    @property
    def id(self) -> str:
        return self.key or self.name

    @property
    def regex(self) -> str:
        """Anchored; one unnamed group per field; valid in Python's `re` and JS's `RegExp`."""
        parts = _FIELD.split(self.name)  # literal, field, literal, field, ..., literal
        pieces = (re.escape(p) if i % 2 == 0 else "([^/]+)" for i, p in enumerate(parts))
        return "^" + "".join(pieces) + "$"

    def match(self, name: str) -> dict[str, str] | None:
        """The fields of `name` if it is this metric (an exact name gives {}), else None."""
        m = re.match(self.regex, name)
        return None if m is None else dict(zip(self.fields, m.groups(), strict=True))

    def member(self, **values: object) -> str:
        """The name of one member of a family: `member(len=128, depth="0.50")`."""
        if set(values) != set(self.fields):
            want = list(self.fields)
            raise ValueError(f"{self.name} takes the fields {want}, got {sorted(values)}")
        name = self.name
        for field, value in values.items():
            text = str(value)
            if not text or "/" in text:
                raise ValueError(f"{self.name}: {field}={text!r} must be non-empty, without '/'")
            name = name.replace("{" + field + "}", text)
        return name

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.id,
            "title": self.title,
            "unit": self.unit,
            "group": self.group,
            "description": self.description,
            "format": self.format,
            "digits": self.digits,
            "per_rank": self.per_rank,
            "view": self.view,
            "fields": list(self.fields),
            "regex": self.regex,
            "grid": None if self.grid is None else {"rows": self.grid[0], "columns": self.grid[1]},
            "profile": self.profile,
            "column": self.column,
            "progress": self.progress,
        }


# ---- the catalog ---------------------------------------------------------------------------
LOSS = Metric(
    name="loss",
    title="Loss",
    unit="nats/token",
    group="training",
    description="cross-entropy of the step's global batch, the token mean over all ranks",
    format="fixed",
    column=True,
    progress=True,
)
LR = Metric(
    name="lr",
    title="Learning rate",
    unit="",
    group="training",
    description="learning rate of the step (after warm-up)",
    format="exp",
    digits=1,
)
GRAD_NORM = Metric(
    name="grad_norm",
    title="Gradient norm",
    unit="",
    group="training",
    description="global L2 norm of the gradients before clipping",
)
STAGE = Metric(
    name="stage",
    title="Stage",
    unit="",
    group="training",
    description="index of the stage the step belongs to (jobs with stages; 0 is the first)",
    format="fixed",
    digits=0,
    progress=True,
)
WORLD_SIZE = Metric(
    name="world_size",
    title="Ranks",
    unit="",
    group="training",
    description="ranks the step ran on (elastic jobs: the shape after each resize)",
    format="fixed",
    digits=0,
    progress=True,
)
TOKENS_PER_S = Metric(
    name="tokens_per_s",
    title="Tokens / s",
    unit="tokens/s",
    group="throughput",
    description="global tokens of the step over its wall time",
    format="si",
    column=True,
    progress=True,
)
STEP_TIME_S = Metric(
    name="step_time_s",
    title="Step time",
    unit="s",
    group="throughput",
    description="wall time of one optimizer step",
    format="seconds",
)
MEM_PEAK_BYTES = Metric(
    name="mem_peak_bytes",
    title="Peak memory per rank",
    unit="bytes",
    group="memory",
    description="peak device memory (host RSS on CPU) of the rank during the step",
    format="bytes",
    per_rank=True,
)
STATE_BYTES = Metric(
    name="state_bytes",
    title="Training state per rank",
    unit="bytes",
    group="memory",
    description="parameters + gradients + optimizer state the rank holds (its FSDP2 shards)",
    format="bytes",
    per_rank=True,
)
VAL_LOSS = Metric(
    name="val_loss",
    title="Validation loss",
    unit="nats/token",
    group="validation",
    description="token-mean loss on held-out documents, at every evaluation",
    format="fixed",
)
VAL_LOSS_POS = Metric(
    name="val_loss/pos={pos}",
    key="val_loss_pos",
    title="Validation loss by position",
    unit="nats/token",
    group="validation",
    description="held-out loss of the tokens in one position bucket (lower later: context used)",
    format="fixed",
    profile="pos",
)
PASSKEY_ACC = Metric(
    name="passkey_acc",
    title="Passkey accuracy",
    unit="fraction",
    group="eval",
    description="passkey retrieval (the whole key right), mean over the length x depth grid",
    format="percent",
)
PASSKEY_TOKEN_ACC = Metric(
    name="passkey_token_acc",
    title="Passkey answer-token accuracy",
    unit="fraction",
    group="eval",
    description="fraction of answer tokens right (per digit for bytes), mean over the grid",
    format="percent",
)
PASSKEY_ACC_CELL = Metric(
    name="passkey_acc/len={len}/depth={depth}",
    key="passkey",
    title="Retrieval accuracy by context length (rows) and needle depth (columns)",
    unit="fraction",
    group="eval",
    description="passkey exact-match accuracy of one context length and needle depth",
    format="percent",
    view="grid",
    grid=("len", "depth"),
)
PASSKEY_TOKEN_ACC_CELL = Metric(
    name="passkey_token_acc/len={len}/depth={depth}",
    key="passkey_token",
    title="Answer-token accuracy by context length (rows) and needle depth (columns)",
    unit="fraction",
    group="eval",
    description="fraction of answer tokens right at one context length and needle depth",
    format="percent",
    view="grid",
    grid=("len", "depth"),
)
RULER_LEN = Metric(
    name="ruler/len={len}",
    key="ruler_len",
    title="RULER score by context length",
    unit="fraction",
    group="eval",
    description="RULER-style tasks at one length: mean over tasks of the share of answers found",
    format="percent",
    profile="len",
)
RULER_TASK = Metric(
    name="ruler/{task}/len={len}",
    key="ruler_task",
    title="RULER score by task (rows) and context length (columns)",
    unit="fraction",
    group="eval",
    description="one RULER-style task at one length: share of reference answers found",
    format="percent",
    view="grid",
    grid=("task", "len"),
)
EFFECTIVE_LENGTH = Metric(
    name="effective_length",
    title="Effective context length",
    unit="tokens",
    group="eval",
    description="longest evaluated length whose RULER score is at least 0.856 (0: none)",
    format="si",
    digits=0,
    view="stat",
)
VERIFY_MAX_REL_ERR = Metric(
    name="verify_max_rel_err",
    title="Verification: max relative error",
    unit="",
    group="verification",
    description="before step 1: largest relative error of the ring path against one rank",
    format="exp",
    digits=2,
    view="stat",
)
VERIFY_TOLERANCE = Metric(
    name="verify_tolerance",
    title="Verification: tolerance",
    unit="",
    group="verification",
    description="the largest relative error verification accepts for the job's compute dtype",
    format="exp",
    digits=2,
    view="stat",
)
VERIFY_PASSED = Metric(
    name="verify_passed",
    title="Verification: passed",
    unit="",
    group="verification",
    description="1 when verification passed, 0 when it failed (the job then fails before step 1)",
    format="fixed",
    digits=0,
    view="stat",
)
VERIFY_TOKENS = Metric(
    name="verify_tokens",
    title="Verification: tokens",
    unit="tokens",
    group="verification",
    description="length of the random sequence verification ran through both paths",
    format="fixed",
    digits=0,
    view="stat",
)
VERIFY_SECONDS = Metric(
    name="verify_seconds",
    title="Verification: time",
    unit="s",
    group="verification",
    description="wall time of verification (both paths, forward and backward)",
    format="seconds",
    view="stat",
)
VERIFY_FP32_REL_ERR = Metric(
    name="verify_fp32_rel_err",
    title="Verification: error vs fp32",
    unit="",
    group="verification",
    description="low-precision jobs: largest relative error of the ring path against fp32",
    format="exp",
    digits=2,
    view="stat",
)

CATALOG: tuple[Metric, ...] = (
    LOSS,
    LR,
    GRAD_NORM,
    STAGE,
    WORLD_SIZE,
    TOKENS_PER_S,
    STEP_TIME_S,
    MEM_PEAK_BYTES,
    STATE_BYTES,
    VAL_LOSS,
    VAL_LOSS_POS,
    PASSKEY_ACC,
    PASSKEY_TOKEN_ACC,
    PASSKEY_ACC_CELL,
    PASSKEY_TOKEN_ACC_CELL,
    RULER_LEN,
    RULER_TASK,
    EFFECTIVE_LENGTH,
    VERIFY_MAX_REL_ERR,
    VERIFY_TOLERANCE,
    VERIFY_PASSED,
    VERIFY_TOKENS,
    VERIFY_SECONDS,
    VERIFY_FP32_REL_ERR,
)
# the passkey grid families by the name of their mean (evals builds cell names through these)
PASSKEY_CELLS: dict[str, Metric] = {
    PASSKEY_ACC.name: PASSKEY_ACC_CELL,
    PASSKEY_TOKEN_ACC.name: PASSKEY_TOKEN_ACC_CELL,
}
_EXACT = {m.name: m for m in CATALOG if not m.family}


def lookup(name: str) -> Metric | None:
    """The catalog entry of a metric name: the exact entry, else the first family it is in."""
    exact = _EXACT.get(name)
    if exact is not None:
        return exact
    return next((m for m in CATALOG if m.family and m.match(name) is not None), None)


def catalog_json() -> dict[str, Any]:
    """What `GET /v1/metrics/catalog` serves."""
    return {
        "groups": [{"id": k, "title": v} for k, v in GROUPS.items()],
        "formats": FORMATS,
        "views": VIEWS,
        "metrics": [m.to_json() for m in CATALOG],
    }


def check(catalog: tuple[Metric, ...] = CATALOG) -> None:
    """Raise ValueError on an entry the dashboard could not show (runs at import: fails fast)."""
    keys: set[str] = set()
    for m in catalog:
        where = f"metric {m.name!r}"
        if m.group not in GROUPS:
            raise ValueError(f"{where}: group {m.group!r} is not one of {list(GROUPS)}")
        if m.format not in FORMATS or m.view not in VIEWS:
            raise ValueError(f"{where}: format {m.format!r} / view {m.view!r} unknown")
        if m.family and not m.key:
            raise ValueError(f"{where}: a family needs a key (an id for the dashboard)")
        if not _KEY.match(m.id) or m.id in keys:
            raise ValueError(f"{where}: key {m.id!r} must be unique, [A-Za-z][A-Za-z0-9_-]*")
        keys.add(m.id)
        if len(set(m.fields)) != len(m.fields):
            raise ValueError(f"{where}: a field appears twice")
        grid_ok = m.grid is not None and set(m.grid) == set(m.fields) and len(m.fields) == 2
        if m.view == "grid" and not grid_ok:
            raise ValueError(f"{where}: a grid needs two fields, named in grid=(rows, columns)")
        if m.profile is not None and (m.view != "line" or m.fields != (m.profile,)):
            raise ValueError(f"{where}: a profile is a line family of one field, named in profile=")
        if (m.column or m.progress) and (m.family or m.per_rank):
            raise ValueError(f"{where}: list columns and the progress line show one global value")


check()
