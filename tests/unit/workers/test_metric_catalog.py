"""The metric catalog (`workers.metrics`): families build and read names back, bad entries are
refused, every metric a real training run emits has an entry, and the dashboard's code names no
metric."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


def test_the_dashboard_code_names_no_catalog_metric() -> None:
    """Charts, columns and grids come from the catalog: adding a metric needs no JavaScript. Only
    the ring view names the two per-rank figures it draws."""
    ring_view = {metrics.MEM_PEAK_BYTES.name, metrics.STEP_TIME_S.name}
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
