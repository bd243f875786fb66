"""GPU check for ring attention (run by bench/gpu_check.sh on a CUDA machine; a few minutes at most).

Single process: exactness of every CUDA block backend (out and dq/dk/dv, dense and packed documents) vs a
float64 reference, block-kernel TFLOP/s (causal forward+backward) against torch SDPA on the same inputs, and
packed documents through flash-attn's varlen kernels vs one call per document piece (`RINGTRAIN_ATTN_VARLEN=off`).
Under torchrun (one process per GPU, NCCL): the ring's exactness (forward and backward) and
per-rank time on every visible GPU for each layout.

`--pipeline`: pipeline parallel (`parallel.pipeline_size` 2) against one process on the same batch,
through the real trainer (`torchrun -m workers.train`): always on CPU (gloo, fp32, the exact
sanity line: loss and grad norm within 1e-5 relative), and on CUDA (NCCL, bf16 autocast: within
2e-2) when 2 or more GPUs are visible; one GPU cannot hold two pipeline ranks, so that case
prints why it is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from workers.attention import attention_backend, ring_attention, shard_sequence, unshard_sequence
from workers.attention.kernels import CUDA_BACKENDS, flash_attn_available


def _ref(q, k, v, cu=None):  # type: ignore[no-untyped-def]
    """Float64 causal attention (document-masked when `cu` is given), on q's device."""
    b, s, h, d = q.shape
    hk = k.shape[2]
    qg = q.double().reshape(b, s, hk, h // hk, d)
    sc = torch.einsum("bqkgd,bskd->bkgqs", qg, k.double()) * d**-0.5
    hidden = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    if cu is not None:
        ids = torch.searchsorted(
            cu.to(q.device).long(), torch.arange(s, device=q.device), right=True
        )
        hidden |= ids[:, None] != ids[None, :]
    sc = sc.masked_fill(hidden, float("-inf"))
    return torch.einsum("bkgqs,bskd->bqkgd", sc.softmax(-1), v.double()).reshape(b, s, h, d)


def _grads_vs_ref(fn, q, k, v, cu=None) -> list[float]:  # type: ignore[no-untyped-def]
    """Relative errors of (out, dq, dk, dv) of `fn(q, k, v)` against float64 autograd on the same inputs."""
    qx, kx, vx = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(qx, kx, vx)
    g = torch.randn_like(out)
    out.backward(g)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _ref(qr, kr, vr, cu)
    ref.backward(g.double())
    return [
        _rel(a, b)
        for a, b in ((out, ref), (qx.grad, qr.grad), (kx.grad, kr.grad), (vx.grad, vr.grad))
    ]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _timed(fn, iters: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def single() -> None:
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"capability {torch.cuda.get_device_capability()}, flash-attn importable: {flash_attn_available()}"
    )
    cu = torch.tensor([0, 1, 100, 101, 700, 1024], dtype=torch.int32)
    for backend in CUDA_BACKENDS:
        if backend == "flash_attn" and not flash_attn_available():
            print(f"exactness {backend:17s} skipped (not installed)")
            continue
        os.environ["RINGTRAIN_ATTN_BACKEND"] = backend
        for dtype in (
            (torch.bfloat16, torch.float32) if backend == "torch_math" else (torch.bfloat16,)
        ):
            for d in (64, 20):
                q, k, v = (torch.randn(1, 1024, n, d, device=dev, dtype=dtype) for n in (8, 2, 2))
                for docs in (None, cu):
                    try:
                        errs = _grads_vs_ref(
                            lambda a, b, c, docs=docs: ring_attention(a, b, c, cu_seqlens=docs),
                            q,
                            k,
                            v,
                            docs,
                        )
                        msg = " ".join(
                            f"{n}={e:.1e}"
                            for n, e in zip(("out", "dq", "dk", "dv"), errs, strict=True)
                        )
                    except Exception as e:  # report every backend, not just the first failure
                        msg = f"FAILED {type(e).__name__}: {e}"
                    print(
                        f"exactness {backend:17s} {dtype!s:15s} d={d:3d} packed={docs is not None!s:5s} {msg}"
                    )
        del os.environ["RINGTRAIN_ATTN_BACKEND"]
    print(
        f"selected: bf16 d=64 {attention_backend(dev, torch.bfloat16, 64)}, d=320 "
        f"{attention_backend(dev, torch.bfloat16, 320)}, fp32 {attention_backend(dev, torch.float32, 64)}"
    )
    s, h, d = 8192, 32, 128
    flops = 3.5 * 2 * 2 * s * s * h * d / 2  # fwd (2 matmuls) + bwd (2.5×), causal half
    q, k, v = (
        torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    g = torch.randn_like(q)

    def ours() -> None:
        ring_attention(q, k, v).backward(g)

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2).backward(g)

    t_ours, t_sdpa = _timed(ours), _timed(sdpa)
    print(
        f"| kernel | S | H | D | fwd+bwd ms | TFLOP/s |\n|---|---|---|---|---|---|\n"
        f"| ring (W=1, {attention_backend(dev, torch.bfloat16)}) | {s} | {h} | {d} | {t_ours * 1e3:.1f} | "
        f"{flops / t_ours / 1e12:.1f} |\n| torch SDPA | {s} | {h} | {d} | {t_sdpa * 1e3:.1f} | "
        f"{flops / t_sdpa / 1e12:.1f} |\nratio ours/SDPA time: {t_ours / t_sdpa:.2f}"
    )


def varlen_vs_blocks() -> None:
    """Packed documents on flash-attn: one varlen call per ring step vs one kernel call per document piece."""
    if not flash_attn_available():
        print("varlen: skipped (flash-attn not installed)")
        return
    dev = torch.device("cuda")
    s, h, d = 8192, 16, 128
    q, k, v = (
        torch.randn(1, s, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for n in (h, 4, 4)
    )
    g = torch.randn_like(q)
    rows = [
        "| documents | varlen ms | per-piece ms | ratio | varlen err out/dq |",
        "|---|---|---|---|---|",
    ]
    for n_docs in (4, 64, 512):
        cu = torch.linspace(0, s, n_docs + 1).round().to(torch.int32)
        times, errs = {}, "-"
        for mode in ("", "off"):
            os.environ["RINGTRAIN_ATTN_VARLEN"] = mode
            try:
                times[mode] = _timed(
                    lambda cu=cu: ring_attention(q, k, v, cu_seqlens=cu).backward(g)
                )
                if mode == "" and n_docs == 64:
                    small = [t[:, :2048].detach() for t in (q, k, v)]
                    head = cu[cu <= 2048]
                    e = _grads_vs_ref(
                        lambda a, b, c, head=head: ring_attention(a, b, c, cu_seqlens=head),
                        *small,
                        head,
                    )
                    errs = f"{e[0]:.1e}/{e[1]:.1e}"
            except Exception as e:  # report, keep going
                times[mode] = float("nan")
                errs = f"FAILED {type(e).__name__}: {e}"
        del os.environ["RINGTRAIN_ATTN_VARLEN"]
        rows.append(
            f"| {n_docs} | {times[''] * 1e3:.1f} | {times['off'] * 1e3:.1f} | {times[''] / times['off']:.2f} | {errs} |"
        )
    print("\n".join(rows))


def ring() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    for layout in ("contiguous", "zigzag", "striped"):
        gen = torch.Generator(device=dev).manual_seed(0)
        small = 1024 * world  # exactness at a size whose float64 reference fits in memory
        q, k, v = (
            torch.randn(1, small, n, 64, device=dev, dtype=torch.bfloat16, generator=gen)
            for n in (8, 2, 2)
        )
        shards = [shard_sequence(t, 1, layout).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*shards, layout=layout)
        g = torch.randn(
            q.shape, device=dev, dtype=torch.bfloat16, generator=gen
        )  # same on every rank
        out.backward(shard_sequence(g, 1, layout))
        full = [unshard_sequence(x, 1, layout) for x in (out.detach(), *(t.grad for t in shards))]
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref = _ref(qr, kr, vr)
        ref.backward(g.double())
        errs = [_rel(a, b) for a, b in zip(full, (ref, qr.grad, kr.grad, vr.grad), strict=True)]
        err = " ".join(f"{n}={e:.1e}" for n, e in zip(("out", "dq", "dk", "dv"), errs, strict=True))
        s = 4096 * world  # timing: 4k tokens per rank
        loc = [
            torch.randn(1, s // world, n, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
            for n in (32, 8, 8)
        ]
        gl = torch.randn_like(loc[0])
        t = _timed(
            lambda loc=loc, gl=gl, layout=layout: ring_attention(*loc, layout=layout).backward(gl)
        )
        times = [torch.zeros(1, device=dev) for _ in range(world)]
        dist.all_gather(times, torch.tensor([t], device=dev))
        if rank == 0:
            ts = [x.item() * 1e3 for x in times]
            print(
                f"ring W={world} {layout:10s} bf16: rel err {err} (S={small}); S={s} per-rank fwd+bwd ms "
                f"{' / '.join(f'{x:.1f}' for x in ts)}; imbalance {max(ts) / (sum(ts) / world):.3f}"
            )
    dist.destroy_process_group()


def _pipeline_spec(pp: int, schedule: str = "1f1b") -> dict[str, Any]:
    """A small native job (d_model 64, 4 layers, seq 256, batch 4, 3 steps); `pp` 2: 4
    microbatches."""
    parallel: dict[str, Any] = {"ring_size": 1}
    if pp > 1:
        parallel |= {"pipeline_size": pp, "pipeline_schedule": schedule}
    return {
        "name": "gpu-check-pipeline",
        "model": {"d_model": 64, "n_layers": 4, "n_heads": 4, "tie_embeddings": False},
        "data": {"kind": "passkey", "seq_len": 256},
        "parallel": parallel,
        "train": {
            "steps": 3,
            "batch_size": 4,
            "microbatches": 4 if pp > 1 else 1,
            "warmup_steps": 1,
        },
        "checkpoint": {"every_steps": 0},
        "eval": {"enabled": False},
        "verify": {"enabled": False},
    }


def _losses(spec: dict[str, Any], world: int, env: dict[str, str]) -> list[float]:
    """The loss and the gradient norm of every step of `spec` trained by `torchrun -m
    workers.train` on `world` ranks (AdamW hides a gradient scaled by a constant from the loss;
    the norm shows it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "spec.yaml", Path(tmp) / "m.jsonl"
        path.write_text(yaml.safe_dump(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={world}", "-m", "workers.train", str(path)]
        cmd += ["--metrics-jsonl", str(out)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        points = [json.loads(line) for line in out.read_text().splitlines()]
    ordered = sorted(points, key=lambda p: p["step"])
    return [p["value"] for name in ("loss", "grad_norm") for p in ordered if p["name"] == name]


def _compare_pipeline(label: str, env: dict[str, str], tolerance: float, schedule: str) -> bool:
    ref = _losses(_pipeline_spec(1), 1, env)
    got = _losses(_pipeline_spec(2, schedule), 2, env)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
    ok = len(got) == len(ref) == 6 and rel <= tolerance
    print(
        f"pipeline {label} pp 2 {schedule} (M 4) vs one process: loss and grad norm rel err "
        f"{rel:.1e} over 3 steps (tolerance {tolerance:.0e}) {'ok' if ok else 'FAILED'}",
        flush=True,
    )
    return ok


def pipeline_check() -> bool:
    """pp 2 against one process: on CPU always, on CUDA where 2 GPUs are visible."""
    ok = _compare_pipeline("cpu gloo fp32", {"CUDA_VISIBLE_DEVICES": ""}, 1e-5, "1f1b")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"pipeline cuda: skipped (pp 2 needs 2 GPUs, {gpus} visible)", flush=True)
        return ok
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(2)))}
    for schedule in ("1f1b", "interleaved_1f1b"):
        ok = _compare_pipeline("cuda nccl bf16", env, 2e-2, schedule) and ok
    return ok


if __name__ == "__main__":
    if "--pipeline" in sys.argv[1:]:
        sys.exit(0 if pipeline_check() else 1)
    if "RANK" in os.environ:
        ring()
    else:
        single()
        varlen_vs_blocks()
