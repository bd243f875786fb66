"""The torchrun entry point: `python -m torch.distributed.run --nproc-per-node N -m workers.train SPEC`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trainutil import tiny_spec

ROOT = Path(__file__).resolve().parents[4]
STEPS = 3


def _spec_file(tmp_path: Path, ring: int) -> Path:
    spec = tiny_spec(
        parallel={"ring_size": ring, "layout": "zigzag"},
        data={"seq_len": 128},
        train={"steps": 10},
        checkpoint={"every_steps": 2},
        eval={"enabled": True, "samples": 2, "depths": [0.5]},
    )
    path = tmp_path / f"ring{ring}.yaml"
    path.write_text(spec.model_dump_json())  # JSON is YAML
    return path


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # --standalone: a local c10d rendezvous on a free port (no clash with other test runs)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ]
    cmd += ["-m", "workers.train", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the workers it started
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun timed out\n{stderr[-4000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _losses(rows: list[dict]) -> list[float]:
    return [
        r["value"]
        for r in sorted((r for r in rows if r["name"] == "loss"), key=lambda r: r["step"])
    ]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_writes_json_lines_and_matches_single_process(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    ckpt = tmp_path / "ckpt"
    _torchrun(
        2,
        str(_spec_file(tmp_path, 2)),
        "--steps",
        str(STEPS),
        "--metrics-jsonl",
        str(jsonl),
        "--checkpoint-dir",
        str(ckpt),
    )
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert all(set(r) <= {"step", "name", "value", "rank"} for r in rows)
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        got = [r for r in rows if r["name"] == name]
        assert [r["step"] for r in got] == [1, 2, 3] and all("rank" not in r for r in got), name
        assert all(r["value"] > 0 for r in got), name
    mem = {(r["step"], r["rank"]) for r in rows if r["name"] == "mem_peak_bytes"}
    assert mem == {(s, k) for s in (1, 2, 3) for k in (0, 1)}
    evals = {r["name"]: r for r in rows if r["name"].startswith("passkey_acc")}
    assert set(evals) == {"passkey_acc", "passkey_acc/len=128/depth=0.50"}
    assert all(r["step"] == STEPS and 0.0 <= r["value"] <= 1.0 for r in evals.values())
    assert sorted(p.name for p in ckpt.iterdir()) == ["metrics", "step-000002", "step-000003"]
    assert sorted(p.name for p in (ckpt / "metrics").iterdir()) == [
        "rank-00000.jsonl",
        "rank-00001.jsonl",
    ]

    # Same spec on one process (ring of 1), metrics on stdout: the same loss curve (fp32 tolerance).
    done = _torchrun(1, str(_spec_file(tmp_path, 1)), "--steps", str(STEPS))
    single = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert "finished at step 3" in done.stderr
    ring, one = _losses(rows), _losses(single)
    assert len(one) == STEPS and one[-1] < one[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ring, one, strict=True)), (ring, one)


def test_entry_refuses_a_world_that_does_not_match_the_spec(tmp_path, monkeypatch, capsys):
    from workers.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        main([str(_spec_file(tmp_path, 2))])
    assert exc.value.code == 2
    assert "data_parallel x ring_size x ulysses_size x tensor_size = 2" in capsys.readouterr().err
