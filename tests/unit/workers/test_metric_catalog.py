"""The metric catalog (`workers.metrics`): families build and read names back, bad entries are
refused, every metric a real training run emits has an entry (passkey eval, held-out loss, fp32 and
bf16 verification), every metric constant the workers name is catalogued, and the dashboard's code
names no metric."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from tests.support.trainutil import one_thread, tiny_spec  # noqa: F401  (one_thread: autouse fixture)
from workers import metrics
from workers.metrics import CATALOG, Metric, lookup

ROOT = Path(__file__).resolve().parents[3]


def test_a_family_builds_and_reads_back_its_names() -> None:
    cell = metrics.PASSKEY_ACC_CELL
    assert cell.fields == ("len", "depth") and cell.family and cell.id == "passkey"
    name = cell.member(len=1024, depth="0.50")
    assert name == "passkey_acc/len=1024/depth=0.50"
    assert cell.match(name) == {"len": "1024", "depth": "0.50"}
    assert cell.match("passkey_acc/len=1024") is None
    assert cell.match("passkey_token_acc/len=1024/depth=0.50") is None
    assert re.match(cell.regex, name).groups() == ("1024", "0.50")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="takes the fields"):
        cell.member(len=1)
    with pytest.raises(ValueError, match="without '/'"):
        cell.member(len="1/2", depth="0.5")
    assert metrics.LOSS.match("loss") == {} and metrics.LOSS.match("loss2") is None


def test_lookup_exact_names_before_families() -> None:
    assert lookup("loss") is metrics.LOSS
    assert lookup("passkey_acc") is metrics.PASSKEY_ACC
    assert lookup("passkey_acc/len=128/depth=0.10") is metrics.PASSKEY_ACC_CELL
    assert lookup("passkey_token_acc/len=128/depth=0.10") is metrics.PASSKEY_TOKEN_ACC_CELL
    assert lookup("val_loss") is metrics.VAL_LOSS
    assert lookup("val_loss/pos=4096-8191") is metrics.VAL_LOSS_POS
    assert lookup("verify_max_rel_err") is metrics.VERIFY_MAX_REL_ERR
    assert lookup("no_such_metric") is None
    assert lookup("val_loss/pos=1/extra") is None


def test_check_refuses_entries_the_dashboard_cannot_show() -> None:
    ok = Metric(name="x", title="X", unit="", group="training", description="d")
    metrics.check((ok,))
    bad = {
        "group": Metric(name="x", title="X", unit="", group="nope", description="d"),
        "needs a key": Metric(name="x/{a}", title="X", unit="", group="training", description="d"),
        "must be unique": ok,
        "two fields": Metric(
            name="x/{a}",
            key="xa",
            title="X",
            unit="",
            group="eval",
            description="d",
            view="grid",
        ),
        "a line family of one field": Metric(
            name="x/{a}/{b}",
            key="xab",
            title="X",
            unit="",
            group="validation",
            description="d",
            profile="a",
        ),
        "one global value": Metric(
            name="y",
            title="Y",
            unit="",
            group="memory",
            description="d",
            per_rank=True,
            column=True,
        ),
    }
    for why, entry in bad.items():
        with pytest.raises(ValueError, match=why):
            metrics.check((ok, entry) if why == "must be unique" else (entry,))


# what verification emits before step 1 for an fp32 job (bf16 jobs add verify_fp32_rel_err)
VERIFY_FP32_JOB = (
    metrics.VERIFY_MAX_REL_ERR,
    metrics.VERIFY_TOLERANCE,
    metrics.VERIFY_PASSED,
    metrics.VERIFY_TOKENS,
    metrics.VERIFY_SECONDS,
)


def test_every_metric_a_real_run_emits_is_in_the_catalog(tmp_path: Path) -> None:
    """The tiny training the other tests use, passkey eval on: every point it emits."""
    from workers.training.trainer import run_training

    spec = tiny_spec(
        train={"steps": 2},
        eval={"enabled": True, "samples": 2, "depths": [0.0, 1.0], "context_lengths": [96, 192]},
    )
    points: list = []
    run_training(spec, checkpoint_dir=tmp_path / "ckpt", emit=points.append)
    names = {p.name for p in points}
    cells = {
        f"{mean}/len={length}/depth={depth}"
        for mean in ("passkey_acc", "passkey_token_acc")
        for length in (96, 192)
        for depth in ("0.00", "1.00")
    }
    assert names == {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "mem_peak_bytes",
        "state_bytes",
        "passkey_acc",
        "passkey_token_acc",
        *(m.name for m in VERIFY_FP32_JOB),
        *cells,
    }
    for p in points:
        entry = lookup(p.name)
        assert entry is not None, f"{p.name} is emitted but has no catalog entry"
        assert entry.per_rank == (p.rank is not None), p
    assert {lookup(n).name for n in cells} == {  # type: ignore[union-attr]
        metrics.PASSKEY_ACC_CELL.name,
        metrics.PASSKEY_TOKEN_ACC_CELL.name,
    }


def _assert_catalogued(names: set[str], per_rank: set[str] | None = None) -> None:
    """Each name has its catalog entry, per-rank exactly when emitted with a rank."""
    for name in sorted(names):
        entry = lookup(name)
        assert entry is not None, f"{name} is emitted but has no catalog entry"
        assert entry in CATALOG
        assert entry.per_rank == (name in (per_rank or set())), name


def test_every_verification_metric_of_fp32_and_bf16_jobs_is_in_the_catalog() -> None:
    """`Verification.metrics()` of a real check, fp32 and bf16 (CPU autocast): bf16 adds
    verify_fp32_rel_err (the attention op against fp32), and that has an entry too."""
    from workers.training.trainer import Trainer
    from workers.training.verify import verify

    spec = tiny_spec()
    t = Trainer(spec, checkpoint_dir=None, emit=lambda p: None)
    fp32 = verify(t.model, spec, t.mesh, t.device).metrics()
    bf16 = verify(t.model, spec, t.mesh, t.device, autocast_dtype=torch.bfloat16).metrics()
    assert set(fp32) == {m.name for m in VERIFY_FP32_JOB}
    assert set(bf16) == {*fp32, "verify_fp32_rel_err"}
    assert 0 < bf16["verify_fp32_rel_err"] < 0.05  # a real measurement, bf16 rounding
    _assert_catalogued(set(bf16))
    for name in bf16:
        assert lookup(name).name == name  # type: ignore[union-attr]  # its own entry, no family's


def test_every_metric_a_run_with_held_out_documents_emits_is_in_the_catalog(
    tmp_path: Path,
) -> None:
    """A prepared dataset with held-out documents: evaluation adds val_loss and one
    val_loss/pos=<bucket> per position bucket (seq_len 256: 0-64, 64-128, 128-256)."""
    from workers.data.prepare import prepare
    from workers.training.trainer import run_training

    src = tmp_path / "docs.jsonl"
    docs = [f"doc {i}: " + "abcdefghij"[i % 10] * (40 + (i * 37) % 400) for i in range(40)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare(src, tmp_path / "ds", tokenizer="bytes", inline=True)
    spec = tiny_spec(
        data={
            "kind": "tokens",
            "path": str(tmp_path / "ds"),
            "seq_len": 256,
            "pack": "documents",
            "validation": 0.2,
        },
        train={"steps": 2},
        eval={"enabled": True, "samples": 1, "depths": [0.5], "context_lengths": [256]},
    )
    points: list = []
    run_training(spec, checkpoint_dir=None, emit=points.append)
    names = {p.name for p in points}
    buckets = {f"val_loss/pos={b}" for b in ("0-64", "64-128", "128-256")}
    assert {"val_loss", *buckets} <= names
    per_rank = {p.name for p in points if p.rank is not None}
    _assert_catalogued(names, per_rank)
    assert {lookup(n).name for n in buckets} == {metrics.VAL_LOSS_POS.name}  # type: ignore[union-attr]


def _metric_constants_named_in(path: Path) -> set[str]:
    """`metrics.X` / `catalog.X` attributes a module of the workers names (X upper case)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("metrics", "catalog")
            and node.attr.isupper()
        ):
            found.add(node.attr)
    return found


def test_every_metric_defined_or_named_by_the_workers_is_in_the_catalog() -> None:
    """Every `Metric` the module defines, and every metric constant an emit site names (the
    trainer, evals, validation, verification), is an entry of `CATALOG`: a metric defined but left
    out of it would be emitted with no entry (the dashboard, the CLI and lookup miss it)."""
    defined = {n: v for n, v in vars(metrics).items() if isinstance(v, Metric)}
    missing = sorted(n for n, m in defined.items() if m not in CATALOG)
    assert missing == [], f"defined in workers/metrics.py but not in CATALOG: {missing}"
    named: dict[str, set[str]] = {}
    for path in sorted((ROOT / "workers").rglob("*.py")):
        if path.name == "metrics.py" and path.parent.name == "workers":
            continue
        for attr in _metric_constants_named_in(path):
            named.setdefault(attr, set()).add(str(path.relative_to(ROOT)))
    assert {"VERIFY_FP32_REL_ERR", "VAL_LOSS_POS", "LOSS"} <= set(named)  # the scan sees them
    for attr, where in sorted(named.items()):
        value = getattr(metrics, attr, None)
        if isinstance(value, dict):  # PASSKEY_CELLS: families by the name of their mean
            assert all(m in CATALOG for m in value.values()), (attr, where)
            continue
        assert isinstance(value, Metric) and value in CATALOG, (attr, where)


def test_the_dashboard_code_names_no_catalog_metric() -> None:
    """Charts, columns and grids come from the catalog: adding a metric needs no JavaScript. Only
    the ring view names the two per-rank figures it draws, and the job page the `stage` index it
    skips (a staged job's stage table and chart boundaries show it)."""
    ring_view = {metrics.MEM_PEAK_BYTES.name, metrics.STEP_TIME_S.name, metrics.STAGE.name}
    found = []
    for path in sorted((ROOT / "api" / "static" / "js").glob("*.js")):
        text = path.read_text()
        for m in CATALOG:
            literal = m.name.split("/")[0] if m.family else m.name
            if m.name in ring_view and path.name == "job.js":
                continue
            if re.search(rf"[\"'`/]{re.escape(literal)}[\"'`/]", text):
                found.append((path.name, m.name))
    assert found == []
