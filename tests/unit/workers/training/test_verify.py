"""Pre-training verification: every supported shape passes, a wrong kernel fails the job early.

The check (`workers.training.verify`) compares the job's distributed forward/backward (FSDP, ring or
Ulysses x ring, packed documents) with the same model on the gathered sequence under dense one-rank
attention. Here it runs on real gloo ranks: rings of 1-4 (3 included) on every layout, Ulysses,
Ulysses x ring, data parallel, activation checkpointing, packed documents, native and pretrained (a
tiny Qwen2 checkpoint) models, fp32 and bf16 (CPU autocast). A test-only kernel that drops every
off-diagonal block, put in charge through the kernel registry (`kernels.use_kernel`), must fail the
job before step 1 naming what diverged, and one right in forward but wrong in backward must fail
naming a gradient (fp32, and bf16 at its documented tolerance); a disabled check emits nothing; the
loss curve is bit-identical with the check on or off; a resume onto another shape checks again, a
retry from a checked start does not. Under pipeline parallel each stage's ranks check their own
stage (pp 2 alone, interleaved and zero bubble, with ring 2 and with tensor 2), the job records one
result, and a kernel wrong on stage 1's ranks only fails the job naming stage 1.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.hf_fixtures import CORPUS, write_checkpoint
from tests.support.trainutil import one_thread, series, tiny_spec, train
from workers.attention.kernels import TorchCpuFlash
from workers.config import JobSpec
from workers.training.verify import Verification

assert one_thread  # autouse fixture, imported to apply to this module


def _document(i: int) -> str:
    return f"document {i}: " + " ".join(f"w{(i * 7 + j) % 23}" for j in range(5 + 9 * (i % 5)))


DOCS = "\n".join(_document(i) for i in range(40))
VERIFY_NAMES = {
    "verify_max_rel_err",
    "verify_tolerance",
    "verify_passed",
    "verify_tokens",
    "verify_seconds",
}


@dataclass(frozen=True)
class DropsOffDiagonal(TorchCpuFlash):
    """A wrong kernel: a block that is not a causal diagonal one adds nothing (a lost ring step)."""

    name: str = "test_drops_off_diagonal"

    def forward(self, q, k, v, causal, scale):
        if causal:
            return super().forward(q, k, v, causal, scale)
        b, sq, h, _ = q.shape
        return torch.zeros_like(q), torch.full((b, h, sq), -1e4, dtype=torch.float32)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        if causal:
            return super().backward(dout, q, k, v, out, lse, causal, scale)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@dataclass(frozen=True)
class WrongBackward(TorchCpuFlash):
    """A kernel right in forward and wrong in backward: dV comes back `dv_scale` times too large,
    so every logit is exact and only gradients show it (one name per scale: the registry refuses a
    different kernel under a name already taken)."""

    name: str = "test_wrong_backward"
    dv_scale: float = 1.01

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = super().backward(dout, q, k, v, out, lse, causal, scale)
        return dq, dk, dv * self.dv_scale


def _docs_spec(tmp: Path, **parallel: Any) -> JobSpec:
    corpus = tmp / "docs.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS.splitlines()))
    return tiny_spec(
        data={"kind": "text", "path": str(corpus), "seq_len": 96, "pack": "documents"},
        parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel},
    )


def _hf_spec(tmp: Path, **parallel: Any) -> JobSpec:
    model_dir = tmp / "qwen2"
    if not model_dir.exists():
        write_checkpoint(model_dir, "qwen2")
    corpus = tmp / "corpus.txt"
    corpus.write_text(CORPUS)
    return tiny_spec(
        model={"kind": "hf", "path": str(model_dir)},
        data={"kind": "text", "path": str(corpus), "seq_len": 128},
        parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel},
    )


def _shape(**parallel: Any) -> JobSpec:
    return tiny_spec(parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel})


def _pp_shape(layers: int = 4, **parallel: Any) -> JobSpec:
    """A pipeline job: 2 stages (4 with an interleaved schedule), 2 microbatches of 1 row."""
    return tiny_spec(
        model={"n_layers": layers},
        parallel={"ring_size": 1, "data_parallel": 1, "layout": "zigzag", **parallel},
        train={"microbatches": 2, "steps": 2},
    )


def _verify_all(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Build each case's trainer and run the check in fp32 and in bf16 (CPU autocast)."""
    from workers.training.trainer import Trainer
    from workers.training.verify import verify

    out = []
    for label, spec_json in cases:
        spec = JobSpec.model_validate_json(spec_json)
        t = Trainer(spec, checkpoint_dir=None, emit=lambda p: None)
        # bf16 under CPU autocast for native models only: with fp32 parameters transformers' RoPE
        # output stays fp32 (q/k fp32, v bf16); bf16 training is CUDA, where parameters are bf16
        for dtype in (None, torch.bfloat16) if spec.model.kind == "native" else (None,):
            v = verify(
                t.model,
                spec,
                t.mesh,
                t.device,
                autocast_dtype=dtype,
                pipeline=t.pipeline,
            )
            assert all(p.grad is None for p in t.model.parameters())  # nothing left for step 1
            out.append({"case": label, **asdict(v), "passed": v.passed})
    return out


def _check(results: list[dict[str, Any]], cases: list[tuple[str, JobSpec]]) -> None:
    assert len(results) == sum(2 if s.model.kind == "native" else 1 for _, s in cases)
    for r in results:
        fp32 = f"  fp32 ref {r['fp32_rel_err']:.2e}" if r["fp32_rel_err"] is not None else ""
        print(
            f"{r['case']:<32} {r['dtype']:<9} max_rel_err {r['max_rel_err']:.2e} ({r['worst']})"
            f"{fp32} {r['seconds']:.2f}s"
        )
        assert r["passed"], r
        assert r["max_rel_err"] > 0  # the two paths really are different computations
        if r["dtype"] == "float32":
            assert r["max_rel_err"] < 1e-5 and r["fp32_rel_err"] is None
        else:  # bf16 rounding, no more
            assert 1e-4 < r["max_rel_err"] < 3e-2 and 1e-4 < r["fp32_rel_err"] < 3e-2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_supported_shape_passes(tmp_path: Path) -> None:
    one = [("ring 1 native", _shape()), ("ring 1 qwen2", _hf_spec(tmp_path))]
    checkpointed = tiny_spec(parallel={"ring_size": 2}, train={"activation_checkpointing": True})
    two = [
        ("ring 2 zigzag", _shape(ring_size=2)),
        ("ring 2 activation checkpointing", checkpointed),
        ("ulysses 2", _shape(ulysses_size=2)),
        ("ring 2 striped packed docs", _docs_spec(tmp_path, ring_size=2, layout="striped")),
        ("ring 2 qwen2 packed docs", _hf_spec(tmp_path, ring_size=2)),
    ]
    three = [
        ("ring 3 striped", _shape(ring_size=3, layout="striped")),
        ("ring 3 packed docs", _docs_spec(tmp_path, ring_size=3)),
    ]
    two += [
        ("pp 2 interleaved_1f1b", _pp_shape(pipeline_size=2, pipeline_schedule="interleaved_1f1b")),
        ("pp 2 zero_bubble", _pp_shape(pipeline_size=2, pipeline_schedule="zero_bubble")),
    ]
    four = [
        ("ring 4 contiguous", _shape(ring_size=4, layout="contiguous")),
        ("ulysses 2 x ring 2", _shape(ring_size=2, ulysses_size=2)),
        ("dp 2 x ring 2 qwen2", _hf_spec(tmp_path, ring_size=2, data_parallel=2)),
        ("pp 2 x ring 2", _pp_shape(pipeline_size=2, ring_size=2)),
        ("pp 2 x tensor 2", _pp_shape(pipeline_size=2, tensor_size=2)),
    ]
    for world, cases in ((1, one), (2, two), (3, three), (4, four)):
        jobs = [(name, spec.model_dump_json()) for name, spec in cases]
        _check(run_distributed(_verify_all, world, jobs)[0], cases)


def _train_broken(rank: int, world: int, spec_json: str) -> dict[str, Any]:
    from workers.attention.kernels import use_kernel
    from workers.training.trainer import run_training
    from workers.training.verify import VerificationFailed

    spec = JobSpec.model_validate_json(spec_json)
    points: list[Any] = []
    error = None
    with use_kernel(DropsOffDiagonal()):
        try:
            run_training(spec, checkpoint_dir=None, emit=points.append)
        except VerificationFailed as e:
            error = str(e)
    return {"error": error, "points": [p.model_dump() for p in points]}


@pytest.mark.multiprocess
def test_a_kernel_that_drops_a_block_fails_the_job_before_step_1() -> None:
    results = run_distributed(_train_broken, 2, _shape(ring_size=2).model_dump_json())
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors  # every rank raises, with the same reason
    reason = errors.pop()
    assert reason.startswith("verification failed before step 1: ")
    assert "largest difference from the one-rank reference in " in reason
    assert "tolerance 0.0001 for float32" in reason
    points = {p["name"]: p for p in results[0]["points"]}
    assert "loss" not in points  # no step ran
    assert points["verify_passed"]["value"] == 0.0 and points["verify_passed"]["step"] == 0
    assert points["verify_max_rel_err"]["value"] > 0.05  # a lost block is no rounding error
    assert f"{points['verify_max_rel_err']['value']:.3g}" in reason
    assert not results[1]["points"]  # rank 0 reports the job's result


def _on_off(rank: int, world: int, spec_on: str, spec_off: str) -> dict[str, Any]:
    on = train(rank, world, spec_on, None, 3)["points"]
    off = train(rank, world, spec_off, None, 3)["points"]
    return {"on": on, "off": off}


@pytest.mark.multiprocess
def test_loss_curve_is_bit_identical_with_verification_on_or_off() -> None:
    spec = _shape(ring_size=3, layout="striped")
    off = spec.model_copy(update={"verify": spec.verify.model_copy(update={"enabled": False})})
    r = run_distributed(_on_off, 3, spec.model_dump_json(), off.model_dump_json())[0]
    assert len(series(r["on"], "loss")) == 3
    for name in ("loss", "grad_norm"):
        assert series(r["on"], name) == series(r["off"], name)  # exactly equal, not close
    assert {p["name"] for p in r["on"] if p["name"].startswith("verify_")} == VERIFY_NAMES
    # disabled: nothing run, nothing emitted
    assert not [p for p in r["off"] if p["name"].startswith("verify_")]


def _checked_at(points: list[dict[str, Any]]) -> list[int]:
    return [p["step"] for p in points if p["name"] == "verify_passed"]


def _resume(rank: int, world: int, spec_json: str, ckpt: str) -> list[list[int]]:
    moved = train(rank, world, spec_json, ckpt, 4)["points"]  # a ring-1 checkpoint onto a ring of 2
    same = train(rank, world, spec_json, ckpt, 6)["points"]  # its own ring-2 checkpoint
    return [_checked_at(moved), _checked_at(same)]


@pytest.mark.multiprocess
def test_a_resume_onto_another_parallel_shape_verifies_again(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    every_2 = _shape().checkpoint.model_copy(update={"every_steps": 2})
    ring1 = _shape().model_copy(update={"checkpoint": every_2})
    assert _checked_at(train(0, 1, ring1.model_dump_json(), ckpt, 2)["points"]) == [0]
    two_ranks = ring1.parallel.model_copy(update={"ring_size": 2})
    ring2 = ring1.model_copy(update={"parallel": two_ranks})
    moved, same = run_distributed(_resume, 2, ring2.model_dump_json(), ckpt)[0]
    assert moved == [2]
    assert same == []


def test_a_retry_from_the_same_start_does_not_verify_twice(tmp_path: Path) -> None:
    """A second attempt starting where a verified one did (a driver lost before its first
    checkpoint) finds the passed check in rank 0's journal: its points are stored already."""
    from workers.training.trainer import run_training

    spec = _shape()
    for expected in ([0], []):
        points: list[Any] = []
        run_training(spec, checkpoint_dir=tmp_path, emit=points.append, max_steps=1, resume_step=0)
        assert _checked_at([p.model_dump() for p in points]) == expected


def _bf16_ring(rank: int, world: int) -> dict[str, Any]:
    """bf16 ring attention with every buffer the ring sends recorded, and its merged forward."""
    import workers.attention.ring as ring
    from workers.attention.comm import RingComm
    from workers.attention.layouts import shard_positions
    from workers.training.verify import dense_attention

    sent: list[torch.dtype] = []

    class Recording(RingComm):
        def send_recv(self, send: torch.Tensor) -> None:
            sent.append(send.dtype)
            super().send_recv(send)

    ring.RingComm = Recording  # type: ignore[misc]  # the real exchange, recorded
    gen = torch.Generator().manual_seed(3)
    s = 24 * world
    q, dout = (torch.randn(1, s, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, s, 2, 16, generator=gen) for _ in range(2))
    rows = shard_positions(s, "zigzag", rank, world)
    mine = [x[:, rows].to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    steps = ring._steps(mine[0], True, "zigzag", rank, world, 16**-0.5, None)
    merged_out, merged_lse = ring._fold_ring(
        mine[0], torch.stack(mine[1:]), steps, Recording(None), world, True
    )
    forward_sends = list(sent)
    out = ring.ring_attention(*mine, layout="zigzag")
    ring_forward_sends = sent[len(forward_sends) :]
    out.backward(dout[:, rows].to(torch.bfloat16))
    backward_sends = sent[len(forward_sends) + len(ring_forward_sends) :]
    full = [x.to(torch.bfloat16).float().requires_grad_() for x in (q, k, v)]
    ref = dense_attention(*full)
    ref.backward(dout.to(torch.bfloat16).float())
    grads = [(m.grad, f.grad) for m, f in zip(mine, full, strict=True)]
    pairs = [(out.detach(), ref.detach()), *grads]
    return {
        "merged": [str(merged_out.dtype), str(merged_lse.dtype)],
        "forward_sends": [str(d) for d in forward_sends],
        "ring_forward_sends": [str(d) for d in ring_forward_sends],
        "backward_sends": [str(d) for d in backward_sends],
        "grad_dtypes": [str(m.grad.dtype) for m in mine],
        "errors": [float((a.float() - b[:, rows]).norm() / b[:, rows].norm()) for a, b in pairs],
    }


@pytest.mark.multiprocess
def test_bf16_ring_merges_and_sends_gradients_in_fp32() -> None:
    from workers.parallel_dims import ring_head_chunks

    world = 3
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    for r in run_distributed(_bf16_ring, world):
        assert r["merged"] == [fp32, fp32]  # the online-softmax merge runs in fp32
        assert r["forward_sends"] == [bf16] * (world - 1)  # K/V travel in the compute dtype
        # ring_attention runs per K/V-head chunk (2 K/V heads: 2 chunks). Forward: each chunk's K/V
        # on the way round (world - 1 sends). Backward: K/V again (world - 1), dK/dV one step behind
        # them and all the way back home (world sends)
        chunks = ring_head_chunks(2, world)
        assert chunks == 2
        assert r["ring_forward_sends"] == [bf16] * chunks * (world - 1)
        expected = chunks * ([bf16] * (world - 1) + [fp32] * world)
        assert sorted(r["backward_sends"]) == sorted(expected)
        assert r["grad_dtypes"] == [bf16] * 3  # returned in the input dtype
        assert max(r["errors"]) < 1e-2, r["errors"]  # bf16 inputs against fp32 math: rounding


def _verify_with(
    kernel: TorchCpuFlash, autocast_dtype: torch.dtype | None
) -> tuple[Verification, set[str]]:
    """The check of a one-rank tiny job in this process with `kernel` in charge of its attention
    (the ring path; the reference's dense attention never calls a kernel), and the model's
    parameter names."""
    from workers.attention.kernels import use_kernel
    from workers.training.trainer import Trainer
    from workers.training.verify import verify

    spec = _shape()
    t = Trainer(spec, checkpoint_dir=None, emit=lambda p: None)
    with use_kernel(kernel):
        result = verify(t.model, spec, t.mesh, t.device, autocast_dtype=autocast_dtype)
    return result, {n for n, _ in t.model.named_parameters()}


def test_a_kernel_wrong_only_in_backward_fails_naming_a_gradient() -> None:
    """Exact logits are not enough: a dV 1% off fails fp32 verification, and the reason names the
    parameter whose gradient diverged most."""
    result, params = _verify_with(WrongBackward("test_dv_1pct_off", 1.01), None)
    reason = result.reason()
    assert not result.passed, reason
    assert result.worst.startswith("gradient of "), reason
    assert result.worst.removeprefix("gradient of ") in params, (result.worst, sorted(params))
    assert reason.startswith("verification failed before step 1: ")
    assert f"reference in {result.worst}: " in reason
    assert "tolerance 0.0001 for float32" in reason
    assert 1e-3 < result.max_rel_err < 1.0  # about the 1% the kernel adds, no numerical blow-up


BF16_DOCUMENTED = 5e-2  # README "Verification": "fp32 1e-4, bf16 5e-2"


def test_a_bf16_error_far_below_100x_the_tolerance_fails_at_the_documented_one() -> None:
    """bf16's tolerance is the documented 5e-2: a kernel 50% off in dV (error several times the
    tolerance, a twentieth of 100x it) fails, in bf16 (CPU autocast)."""
    result, params = _verify_with(WrongBackward("test_dv_50pct_off", 1.5), torch.bfloat16)
    reason = result.reason()
    assert result.dtype == "bfloat16"
    assert 4 * BF16_DOCUMENTED < result.max_rel_err < 100 * BF16_DOCUMENTED / 5, reason
    assert not result.passed, reason
    assert result.tolerance == BF16_DOCUMENTED
    assert "tolerance 0.05 for bfloat16" in reason
    assert result.worst.removeprefix("gradient of ") in params, reason


def _input_gradient_1pct_off(module: Any, args: tuple[Any, ...]) -> None:
    """A stage's forward pre-hook: the gradient it sends back to the previous stage comes out 1%
    too large on the job's own attention path (not under the check's one-rank reference); its
    output and its parameters' gradients stay right."""
    from workers.training.verify import OneRankAttention

    if args[0].requires_grad and not isinstance(module.sp, OneRankAttention):
        args[0].register_hook(lambda grad: grad * 1.01)


def _pipeline_job(rank: int, world: int, spec_json: str) -> dict[str, Any]:
    """One pipeline job's check four ways on the same trainer: with a kernel whose dV is 1% off
    in charge on stage 1's ranks only (right logits, wrong gradients there), with stage 1 sending
    back an input gradient 1% off (nothing else wrong), then as it is, then one step of training;
    and one step of the same job with the check off."""
    from workers.attention.kernels import use_kernel
    from workers.training.trainer import Trainer
    from workers.training.verify import VerificationFailed

    spec = JobSpec.model_validate_json(spec_json)
    points: list[Any] = []
    t = Trainer(spec, checkpoint_dir=None, emit=points.append)
    out: dict[str, Any] = {"broken": None, "input_broken": None}
    wrong = WrongBackward("test_dv_1pct_off_on_stage_1", 1.01)
    with use_kernel(wrong) if t.mesh.pp_rank == 1 else nullcontext():
        try:
            t.verify()
        except VerificationFailed as e:
            out["broken"] = str(e)
    out["broken_points"] = [p.model_dump() for p in points]
    assert t.pipeline is not None
    stage = t.pipeline.model.stage_modules[0]
    hook = stage.register_forward_pre_hook(_input_gradient_1pct_off) if t.mesh.pp_rank else None
    try:
        t.verify()
    except VerificationFailed as e:
        out["input_broken"] = str(e)
    finally:
        if hook is not None:
            hook.remove()
    points.clear()
    t.needs_verification = True
    t.train(max_steps=1)  # checks first, then step 1
    out["points"] = [p.model_dump() for p in points]
    off_spec = spec.model_copy(update={"verify": spec.verify.model_copy(update={"enabled": False})})
    off: list[Any] = []
    Trainer(off_spec, checkpoint_dir=None, emit=off.append).train(max_steps=1)
    out["off"] = [p.model_dump() for p in off]
    return out


@pytest.mark.multiprocess
def test_pipeline_stages_verify_their_own_layers_and_a_broken_stage_fails_naming_it() -> None:
    """pp 2 (one layer per stage): each stage's ranks check their own stage; the job records one
    rank-less result, rank 0's. A kernel 1% off in dV on stage 1's ranks only fails every rank
    with the same reason, naming a gradient of stage 1, and so does a stage 1 right but for the
    input gradient it sends back; the check leaves training as it was."""
    spec = _pp_shape(layers=2, pipeline_size=2)
    r0, r1 = run_distributed(_pipeline_job, 2, spec.model_dump_json())
    reason = r0["broken"]
    assert reason is not None and r1["broken"] == reason  # every rank, the same reason
    assert reason.startswith("verification failed before step 1: ")
    worst = reason.split("largest difference from the one-rank reference in ")[1].split(": ")[0]
    assert worst.startswith("gradient of ") and worst.endswith("stage 1 (layers 1-1)"), reason
    broken = {p["name"]: p["value"] for p in r0["broken_points"]}
    assert broken["verify_passed"] == 0.0
    assert 1e-3 < broken["verify_max_rel_err"] < 1.0, reason  # the kernel's 1%, no blow-up
    # only the gradient stage 1 sends back wrong: the check fails naming it, with its whole 1%
    reason = r0["input_broken"]
    assert reason is not None and r1["input_broken"] == reason, reason
    worst = reason.split("largest difference from the one-rank reference in ")[1]
    assert worst.startswith("gradient of the input of stage 1 (layers 1-1): 0.01 relative"), reason

    checked = [p for p in r0["points"] if p["name"].startswith("verify_")]
    assert {p["name"] for p in checked} == VERIFY_NAMES
    assert all(p["rank"] is None and p["step"] == 0 for p in checked)  # one job-level point each
    figures = {p["name"]: p["value"] for p in checked}
    print(f"pp 2: max_rel_err {figures['verify_max_rel_err']:.2e}")
    assert figures["verify_passed"] == 1.0
    assert 0 < figures["verify_max_rel_err"] < 1e-5  # different computations, fp32 rounding
    assert figures["verify_tolerance"] == 1e-4 and figures["verify_tokens"] == 192
    assert not [p for p in r1["points"] + r1["broken_points"] if p["name"].startswith("verify_")]
    # neither check (failed or passed) disturbed training: step 1 as with the check off
    for name in ("loss", "grad_norm"):
        assert len(series(r0["points"], name)) == 1
        assert series(r0["points"], name) == series(r0["off"], name)
