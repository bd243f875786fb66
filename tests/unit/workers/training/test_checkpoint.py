"""Checkpoints (torch.distributed.checkpoint, sharded): atomic step directories, retention, bit-exact resume
in fresh processes, resume on a different world (ring size / data-parallel width), a killed save never used."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.support.trainutil import final_weights, one_thread, series, tiny_spec, train
from workers.models import build_model
from workers.training.checkpoint import (
    latest_step,
    list_steps,
    load_checkpoint,
    read_weights,
    save_checkpoint,
    step_dir,
)
from workers.training.trainer import run_training

assert one_thread  # autouse fixture, imported to apply to this module


def _model(seed: int) -> torch.nn.Module:
    return build_model(tiny_spec().model, seed)


def test_save_load_keep_and_atomicity(tmp_path):
    model = _model(1)
    torch.manual_seed(123)
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, step, model, {"extra": {"loss": float(step)}}, keep=2)
    assert list_steps(tmp_path) == [15, 20] and latest_step(tmp_path) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000015",
        "step-000020",
    ]  # no temp dirs left

    # A crash mid-write leaves a hidden temp dir, or a step dir without its marker: neither is picked up.
    shutil.copytree(step_dir(tmp_path, 20), tmp_path / ".tmp-step-000030")
    shutil.copytree(step_dir(tmp_path, 20), step_dir(tmp_path, 40))
    (step_dir(tmp_path, 40) / "state.pt").unlink()
    assert latest_step(tmp_path) == 20
    weights = read_weights(tmp_path, 20)  # sharded format, read back whole without a process group
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert latest_step(tmp_path / "missing") is None

    expected_rng = torch.rand(
        3
    )  # what the generator produces right after the checkpoint's RNG state
    other = _model(2)
    assert not torch.equal(other.tok_emb.weight, model.tok_emb.weight)
    state = load_checkpoint(tmp_path, 20, other)
    assert state["step"] == 20 and state["extra"]["loss"] == 20.0
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # save_checkpoint(…, 20) ran after torch.rand was seeded and before expected_rng was drawn
    assert torch.equal(torch.rand(3), expected_rng)

    # Re-saving an existing step replaces it whole.
    save_checkpoint(tmp_path, 20, other, {"extra": {"loss": -1.0}}, keep=2)
    assert load_checkpoint(tmp_path, 20, model)["extra"]["loss"] == -1.0


def test_stop_event_checkpoints_and_resumes(tmp_path):
    spec = tiny_spec(data={"seq_len": 128})
    stop = threading.Event()
    stop.set()  # set before the first step: the run finishes that step, checkpoints, returns
    points = []
    result = run_training(spec, checkpoint_dir=tmp_path, emit=points.append, stop=stop)
    assert result.final_step == 1 and result.resumed_from is None and latest_step(tmp_path) == 1
    assert [p.step for p in points if p.name == "loss"] == [1]
    again = run_training(spec, checkpoint_dir=tmp_path, emit=points.append, max_steps=3)
    assert again.resumed_from == 1 and again.final_step == 3
    assert [p.step for p in points if p.name == "loss"] == [1, 2, 3]
    assert again.attention_backend


def _straight_then_first_half(
    rank: int, world: int, spec: str, root: str, k: int
) -> tuple[dict, dict]:
    """One spawn for two runs: all 2K steps into root/a, then K steps into root/b."""
    return train(rank, world, spec, f"{root}/a", None), train(rank, world, spec, f"{root}/b", k)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_is_bit_exact_in_new_processes(tmp_path):
    """2K steps straight vs K steps, new processes, K more: identical bits (ring of 3, striped)."""
    k = 3
    spec = tiny_spec(
        parallel={"ring_size": 3, "layout": "striped"},
        checkpoint={"every_steps": 2, "keep": 3},
        train={"steps": 2 * k, "warmup_steps": 2},
    ).model_dump_json()
    straight, first = zip(
        *run_distributed(_straight_then_first_half, 3, spec, str(tmp_path), k), strict=True
    )
    second = run_distributed(
        train, 3, spec, str(tmp_path / "b"), None
    )  # fresh processes resume at K

    assert first[0]["result"]["final_step"] == k and first[0]["result"]["resumed_from"] is None
    assert second[0]["result"]["resumed_from"] == k and second[0]["result"]["final_step"] == 2 * k
    assert list_steps(tmp_path / "b") == [
        k,
        4,
        6,
    ]  # periodic 2, 4, 6 + end-of-run save at K; keep = 3
    full = series(straight[0]["points"], "loss")
    resumed = series(first[0]["points"], "loss") + series(second[0]["points"], "loss")
    assert len(full) == 2 * k and full[-1] < full[0]
    assert resumed == full  # exact float equality, step by step
    assert series(second[0]["points"], "lr") == series(straight[0]["points"], "lr")[k:]
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- resume on another world ---------------------------------------------------------------------------------------
K = 3


def _resume_spec(ring: int, dp: int = 1, layout: str = "zigzag") -> str:
    return tiny_spec(
        parallel={"ring_size": ring, "data_parallel": dp, "layout": layout},
        train={"steps": 2 * K, "warmup_steps": 2},
    ).model_dump_json()


def _world4(rank: int, world: int, root: str) -> tuple[dict, dict, dict]:
    """Ring 4 trains K steps; a copy of that checkpoint resumes on 2 × 2; the ring-2 checkpoint resumes on ring 4."""
    first = train(rank, world, _resume_spec(4), f"{root}/w4", K)
    if rank == 0:
        shutil.copytree(f"{root}/w4", f"{root}/w4-to-2x2")
    dist.barrier()
    to_2x2 = train(rank, world, _resume_spec(2, 2, "contiguous"), f"{root}/w4-to-2x2", None)
    from_2 = train(rank, world, _resume_spec(4), f"{root}/w2-to-4", None)
    return first, to_2x2, from_2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_on_another_world_continues_the_curve(tmp_path):
    """4 → 2×2, 4 → 3, 2 → 4: the resumed steps follow the single-process curve (fp32, 1e-5 relative)."""
    ref = series(train(0, 1, _resume_spec(1), None, None)["points"], "loss")
    assert len(ref) == 2 * K and ref[-1] < ref[0]
    run_distributed(train, 2, _resume_spec(2), str(tmp_path / "w2"), K)
    shutil.copytree(tmp_path / "w2", tmp_path / "w2-to-4")
    per_rank = run_distributed(_world4, 4, str(tmp_path))
    shutil.copytree(tmp_path / "w4", tmp_path / "w4-to-3")
    to_3 = run_distributed(
        train, 3, _resume_spec(3, layout="striped"), str(tmp_path / "w4-to-3"), None
    )
    first, to_2x2, from_2 = per_rank[0]
    assert series(first["points"], "loss") == pytest.approx(ref[:K], rel=1e-5)
    for what, run in (("4 → 2×2", to_2x2), ("4 → 3", to_3[0]), ("2 → 4", from_2)):
        assert run["result"]["resumed_from"] == K and run["result"]["final_step"] == 2 * K, what
        torch.testing.assert_close(
            torch.tensor(series(run["points"], "loss")),
            torch.tensor(ref[K:]),
            rtol=1e-5,
            atol=0,
            msg=what,
        )


# -- a save killed midway -------------------------------------------------------------------------------------------
KILLED_SAVE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    from workers.config import JobSpec
    from workers.training.trainer import run_training
    torch.set_num_threads(1)
    spec, root, pause = JobSpec.model_validate_json(sys.argv[1]), sys.argv[2], sys.argv[3]
    real_finish = fs.FileSystemWriter.finish
    def finish(self, metadata, results):  # every shard is written; hang before the metadata file
        if str(self.path).endswith(pause):
            open(os.path.join(root, "PAUSED"), "w").close()
            time.sleep(600)
        return real_finish(self, metadata, results)
    fs.FileSystemWriter.finish = finish
    r = run_training(spec, checkpoint_dir=root, emit=lambda p: print(json.dumps(p.model_dump()), flush=True))
    print(json.dumps({"resumed_from": r.resumed_from, "final_step": r.final_step}), flush=True)
""")


def _child(*args: str) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE_CHILD, *args],
        env=env,
        cwd=root,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_killed_save_is_never_picked_up(tmp_path):
    """SIGKILL while step 4's shards are on disk but not its metadata: step 2 is the newest; a rerun resumes
    there, redoes 3-4, and replaces the debris."""
    root = tmp_path / "ck"
    spec = tiny_spec(
        data={"seq_len": 128}, train={"steps": 4}, checkpoint={"every_steps": 2, "keep": 3}
    )
    p = _child(spec.model_dump_json(), str(root), ".tmp-step-000004")
    deadline = time.monotonic() + 120
    while not (root / "PAUSED").exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert p.poll() is None, p.stderr.read() if p.stderr else ""
    p.send_signal(signal.SIGKILL)
    out, _ = p.communicate(timeout=10)
    assert [json.loads(x)["step"] for x in out.splitlines() if '"name": "loss"' in x] == [
        1,
        2,
        3,
        4,
    ]
    debris = root / ".tmp-step-000004"
    assert any(debris.glob("*.distcp")) and not (debris / ".metadata").exists()
    assert list_steps(root) == [2] and latest_step(root) == 2

    (root / "PAUSED").unlink()
    p = _child(spec.model_dump_json(), str(root), "never")
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    lines = [json.loads(x) for x in out.splitlines()]
    assert lines[-1] == {"resumed_from": 2, "final_step": 4}
    assert [x["step"] for x in lines if x.get("name") == "loss"] == [3, 4]
    assert list_steps(root) == [2, 4] and not debris.exists()


def test_a_crash_while_retention_deletes_a_step_leaves_it_invisible(tmp_path, monkeypatch):
    """Retention deletes old steps file by file; a process killed halfway must not leave a step whose marker is
    still there and whose shards are gone (a resume would pick it up and fail to load it)."""
    import workers.training.checkpoint as ck

    model = _model(1)
    for step in (5, 10):
        save_checkpoint(tmp_path, step, model, {}, keep=2)
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # deletes the shards, then the process dies
        if Path(path).name.endswith("step-000005") and Path(path).exists():
            for shard in Path(path).glob("*.distcp"):
                shard.unlink()
            raise SystemExit("killed while deleting")
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ck.shutil, "rmtree", killed_midway)
    with pytest.raises(SystemExit):
        save_checkpoint(tmp_path, 15, model, {}, keep=2)
    monkeypatch.undo()
    assert list_steps(tmp_path) == [
        10,
        15,
    ]  # step 5 is out of sight although its files are not all gone
    for step in list_steps(tmp_path):
        assert read_weights(tmp_path, step).keys() == model.state_dict().keys()
    save_checkpoint(tmp_path, 20, model, {}, keep=2)  # the next save sweeps the debris
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000015", "step-000020"]
