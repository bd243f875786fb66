"""Pipeline parallel end to end: the same global batch trains the same model as one process.

Each case trains 2 optimizer steps of a tiny native model (d_model 32, 4 layers, seq 64, fp32,
CPU/gloo) on P pipeline ranks (`torch.distributed.pipelining`'s schedules over M microbatches),
alone or with ring, Ulysses, tensor or data parallel inside each stage, and compares with one process on the same
batch: the loss of every step (relative, 1e-5: what the ring equivalence tests allow), the grad
norm of every step (summed over the stages) and every parameter after the last step, read back
from the DCP checkpoint under its whole-model name (atol 5e-5, as in `test_train_equivalence`:
AdamW moves each element by ~lr whatever its gradient, so a ~0 gradient that changes sign under
reordering costs up to that; a wrong or missing microbatch costs ~lr = 3e-3).

Checkpoints reshard across pipeline sizes like every other axis: pp 2 x ring 2 -> ring 2, and
ring 2 -> pp 2 x ring 2, continue the one-process curve and end on its weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.dist import run_distributed
from tests.support.trainutil import final_weights, one_thread, series, tiny_spec, train
from workers.config import JobSpec

assert one_thread  # autouse fixture, imported to apply to this module

K = 2
LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-5
MEASURED: dict[str, tuple[float, float]] = {}


DOCS = [
    f"document {i}: " + " ".join(f"w{(i * 5 + j) % 19}" for j in range(4 + 7 * (i % 6)))
    for i in range(40)
]


def _spec(
    *,
    batch: int = 2,
    layers: int = 4,
    steps: int = K,
    m: int = 1,
    docs: Path | None = None,
    **parallel: Any,
) -> str:
    """The tiny job; `docs`: a JSONL corpus trained as packed documents (seq 96) instead of
    passkeys (seq 64)."""
    data: dict[str, Any] = {"seq_len": 64}
    if docs is not None:
        data = {"kind": "text", "path": str(docs), "seq_len": 96, "pack": "documents"}
    return tiny_spec(
        model={"n_layers": layers},
        data=data,
        parallel={"ring_size": 1, **parallel},
        train={"steps": steps, "batch_size": batch, "microbatches": m, "warmup_steps": 1},
        checkpoint={"every_steps": 0},
        verify={"enabled": False},
    ).model_dump_json()


def _run(world: int, spec: str, ckpt: Path, max_steps: int | None = None) -> dict[str, Any]:
    if world == 1:
        out = [train(0, 1, spec, str(ckpt), max_steps)]
    else:
        out = run_distributed(train, world, spec, str(ckpt), max_steps)
    points = out[0]["points"]  # global series: one rank-less point per step, from rank 0
    loss = [p for p in points if p["name"] == "loss"]
    assert all(p["rank"] is None for p in loss)
    assert all(not any(p["name"] == "loss" for p in o["points"]) for o in out[1:])
    _check_points(out, JobSpec.model_validate_json(spec))
    return {
        "loss": series(points, "loss"),
        "grad_norm": series(points, "grad_norm"),
        "weights": final_weights(ckpt),
    }


def _check_points(out: list[dict[str, Any]], job: Any) -> None:
    """What every rank emits: rank-less points from rank 0 only; on each rank, its per-rank points
    (mem_peak_bytes, state_bytes) once per step under its own rank; `tokens_per_s` counts the
    global batch (rows x seq_len) once, whatever the pipeline and tensor shape."""
    steps = sorted({p["step"] for p in out[0]["points"] if p["name"] == "loss"})
    for rank, o in enumerate(out):
        if rank > 0:
            assert [p["name"] for p in o["points"] if p["rank"] is None] == [], rank
        for name in ("mem_peak_bytes", "state_bytes"):
            mine = [p for p in o["points"] if p["name"] == name]
            assert [p["step"] for p in mine] == steps and {p["rank"] for p in mine} == {rank}
            assert all(p["value"] > 0 for p in mine), (rank, name)
    seconds = {p["step"]: p["value"] for p in out[0]["points"] if p["name"] == "step_time_s"}
    for p in out[0]["points"]:
        if p["name"] == "tokens_per_s":
            tokens = job.train.batch_size * _length(job, p["step"])
            assert p["value"] * seconds[p["step"]] == pytest.approx(tokens, rel=1e-6), p


def _length(job: Any, step: int) -> int:
    """The context length of the batch behind step `step`'s points: a curriculum's stages first."""
    end = 0
    for stage in getattr(job.data, "curriculum", None) or []:
        end += stage.steps
        if step <= end:
            return int(stage.seq_len)
    return int(job.data.seq_len)


def _compare(name: str, got: dict[str, Any], ref: dict[str, Any], steps: int = K) -> None:
    assert len(got["loss"]) == len(ref["loss"]) == steps, (got["loss"], ref["loss"])
    rel = 0.0
    for what in ("loss", "grad_norm"):
        for a, b in zip(got[what], ref[what], strict=True):
            rel = max(rel, abs(a - b) / abs(b))
    assert rel < LOSS_RTOL, (name, got["loss"], ref["loss"], got["grad_norm"], ref["grad_norm"])
    # the same fully-qualified names as without a pipeline: a stage keeps its layers' indices
    assert got["weights"].keys() == ref["weights"].keys()
    worst = 0.0
    for key, w in ref["weights"].items():
        worst = max(worst, float((got["weights"][key] - w).abs().max()))
        torch.testing.assert_close(got["weights"][key], w, rtol=0, atol=PARAM_ATOL, msg=key)
    MEASURED[name] = (rel, worst)
    print(f"MEASURED {name}: loss/grad-norm rel {rel:.1e}, parameter max abs {worst:.1e}")


def _moved(ref: dict[str, Any], spec: str) -> float:
    """How far training moved the weights from their initial values (the comparison is not
    trivial when this is far above the tolerance)."""
    from workers.models import build_model

    job = JobSpec.model_validate_json(spec)
    init = build_model(job.model, job.train.seed).state_dict()
    return max(float((ref["weights"][k] - v).abs().max()) for k, v in init.items())


@pytest.mark.multiprocess
def test_pp2_equals_one_process(tmp_path: Path) -> None:
    """Fast tier: 1F1B on 2 pipeline ranks, 2 microbatches of 2 rows, 6 layers split by the
    planner (`pipeline_split: auto`, resolved as submission resolves it): the first stage holds
    two microbatches in flight, the last one, so the split is uneven."""
    from service.planner import resolve_pipeline_split

    base: dict[str, Any] = {"batch": 4, "layers": 6}
    ref = _run(1, _spec(**base), tmp_path / "ref")
    assert _moved(ref, _spec(**base)) > 20 * PARAM_ATOL
    auto = JobSpec.model_validate_json(_spec(pipeline_size=2, m=2, pipeline_split="auto", **base))
    split = resolve_pipeline_split(auto).parallel.pipeline_split
    assert isinstance(split, list) and sum(split) == 6 and split != [3, 3], split
    got = _run(2, _spec(pipeline_size=2, m=2, pipeline_split=split, **base), tmp_path / "pp2")
    _compare("pp2, pipeline_split auto", got, ref)
    # the export gathers every stage into one transformers directory, as one process writes it
    exported = load_file(tmp_path / "pp2" / "model" / "model.safetensors")
    expected = load_file(tmp_path / "ref" / "model" / "model.safetensors")
    assert exported.keys() == expected.keys()
    for key, w in expected.items():
        torch.testing.assert_close(exported[key], w, rtol=0, atol=PARAM_ATOL, msg=key)


CASES = {
    # name: (world, spec keywords)
    "pp2 x ring2": (4, {"pipeline_size": 2, "m": 2, "ring_size": 2}),
    "pp2 interleaved_1f1b": (
        2,
        {"pipeline_size": 2, "m": 2, "pipeline_schedule": "interleaved_1f1b"},
    ),
    "pp2 zero_bubble": (2, {"pipeline_size": 2, "m": 2, "pipeline_schedule": "zero_bubble"}),
    "pp2 x ulysses2": (4, {"pipeline_size": 2, "m": 2, "ulysses_size": 2}),
    "pp2 x tp2": (4, {"pipeline_size": 2, "m": 2, "tensor_size": 2}),
    "pp2 x ring2, packed documents": (
        4,
        {"pipeline_size": 2, "m": 2, "ring_size": 2, "docs": True},
    ),
    "pp2 x dp2": (4, {"pipeline_size": 2, "m": 2, "data_parallel": 2, "batch": 4}),
    "pp3, 3 layers": (3, {"pipeline_size": 3, "m": 3, "batch": 3, "layers": 3}),
    "pp3, 6 layers split 1/3/2": (
        3,
        {"pipeline_size": 3, "m": 3, "batch": 3, "layers": 6, "pipeline_split": [1, 3, 2]},
    ),
}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_cases_equal_one_process(name: str, tmp_path: Path) -> None:
    world, kw = CASES[name]
    kw = dict(kw)
    if kw.pop("docs", False):
        kw["docs"] = tmp_path / "docs.jsonl"
        kw["docs"].write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    base = {k: kw[k] for k in ("batch", "layers", "docs") if k in kw}
    ref = _run(1, _spec(**base), tmp_path / "ref")
    got = _run(world, _spec(**kw), tmp_path / "got")
    _compare(name, got, ref)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoints_reshard_across_pipeline_sizes(tmp_path: Path) -> None:
    """2 steps on one shape, 2 more resumed on the other, against 4 uninterrupted on one process."""
    ref = _run(1, _spec(steps=4), tmp_path / "ref")
    pp = {"pipeline_size": 2, "m": 2, "ring_size": 2}
    ring = {"ring_size": 2}
    for name, first, second in (
        ("pp2 x ring2 -> ring2", pp, ring),
        ("ring2 -> pp2 x ring2", ring, pp),
    ):
        ckpt = tmp_path / name.replace(" ", "")
        head = _run(2 * first.get("pipeline_size", 1), _spec(steps=4, **first), ckpt, 2)
        tail = _run(2 * second.get("pipeline_size", 1), _spec(steps=4, **second), ckpt)
        got = {
            "loss": head["loss"] + tail["loss"],
            "grad_norm": head["grad_norm"] + tail["grad_norm"],
            "weights": tail["weights"],
        }
        _compare(name, got, ref, steps=4)


def _curriculum(**parallel: Any) -> str:
    train = {"steps": 3, "batch_size": 2, "warmup_steps": 1, **parallel.pop("train", {})}
    return tiny_spec(
        model={"n_layers": 4},
        data={"seq_len": 128, "curriculum": [{"steps": 1, "seq_len": 64}]},
        parallel={"ring_size": 1, **parallel},
        train=train,
        checkpoint={"every_steps": 0},
        verify={"enabled": False},
    ).model_dump_json()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_curriculum_rebuilds_the_stages_for_the_new_length(tmp_path: Path) -> None:
    """A curriculum's shorter context, then the full one: the stages' buffers are sized per
    shape, so the schedule is rebuilt when the length changes, and the run still equals one
    process."""
    ref = _run(1, _curriculum(), tmp_path / "ref", 3)
    got = _run(2, _curriculum(pipeline_size=2, train={"microbatches": 2}), tmp_path / "pp2", 3)
    _compare("pp2, curriculum 64 -> 128", got, ref, steps=3)
