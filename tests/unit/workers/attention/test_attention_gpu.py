"""CUDA block backends: out and dq/dk/dv vs the float64 reference, dense and packed documents (skipped
without CUDA). Every CUDA backend is forced in turn with RINGTRAIN_ATTN_BACKEND; head_dim 20 exercises
the padding to a multiple of 8; the fallback rules are checked where the device allows."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.attention_cases import make_inputs, reference_attention, reference_doc_attention
from workers.attention import attention_backend, ring_attention
from workers.attention.kernels import CUDA_BACKENDS, flash_attn_available

pytestmark = pytest.mark.gpu

# bf16 keeps ~3 significant digits: relative error of a bf16 attention vs float64 is ~1e-2 at most
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def _skip_unless_runs(backend: str, dtype: torch.dtype) -> None:
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash-attn >= 2.6 not installed")
    if backend != "torch_math" and dtype == torch.float32:
        pytest.skip("flash kernels take fp16/bf16 only")
    if backend != "torch_math" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash kernels need compute capability >= 8.0")


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_backend_forward_and_backward(
    backend: str, dtype: torch.dtype, head_dim: int, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_unless_runs(backend, dtype)
    monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", backend)
    s = 256
    q, k, v, dout = make_inputs(9, 2, s, 8, 2, head_dim, torch.float32)
    cu = torch.tensor([0, 1, 40, 41, 200, s], dtype=torch.int32) if packed else None
    qd, kd, vd = (t.to("cuda", dtype).requires_grad_() for t in (q, k, v))
    out = ring_attention(qd, kd, vd, causal=True, cu_seqlens=cu)
    out.backward(dout.to("cuda", dtype))
    # the reference starts from the same rounded inputs
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (qd, kd, vd))
    ref = (
        reference_attention(qr, kr, vr, True)
        if cu is None
        else reference_doc_attention(qr, kr, vr, True, cu)
    )
    ref.backward(dout.to(dtype).double())
    for name, a, b in [
        ("out", out, ref),
        ("dq", qd.grad, qr.grad),
        ("dk", kd.grad, kr.grad),
        ("dv", vd.grad, vr.grad),
    ]:
        assert a.dtype == dtype and a.shape == b.shape, name
        err = ((a.double().cpu() - b).norm() / b.norm()).item()
        assert err < TOL[dtype], (
            f"{backend} {dtype} d={head_dim} packed={packed}: {name} rel err {err:.2e}"
        )


def test_fallback_selection() -> None:
    """fp32 and head_dim > 256 go to the exact math kernel; fp16/bf16 flash where the device runs it."""
    assert attention_backend("cuda", torch.float32, 64) == "torch_math"
    assert attention_backend("cuda", torch.bfloat16, 320) == "torch_math"
    flash = "flash_attn" if flash_attn_available() else "torch_cuda_flash"
    want = flash if torch.cuda.get_device_capability() >= (8, 0) else "torch_math"
    assert attention_backend("cuda", torch.bfloat16, 128) == want


def test_bf16_autocast_ring_backward_matches_reference() -> None:
    """fp32 inputs under bf16 autocast (how the trainer runs): the exact math kernel stays fp32."""
    q, k, v, dout = make_inputs(5, 1, 128, 4, 2, 64, torch.float32)
    qd, kd, vd = (t.cuda().requires_grad_() for t in (q, k, v))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = ring_attention(qd, kd, vd, causal=True)
    out.backward(dout.cuda())
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True)
    ref.backward(dout.double())
    for a, b in [(out, ref), (qd.grad, qr.grad), (kd.grad, kr.grad), (vd.grad, vr.grad)]:
        assert ((a.double().cpu() - b).norm() / b.norm()).item() < 1e-5


@pytest.mark.parametrize("varlen", ["", "off"])
def test_packed_documents_through_flash_varlen(
    varlen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many packed documents (length 1 to 97) in bf16: flash-attn's varlen kernels (the default with flash-attn) and
    one call per document piece (`off`) both match the float64 document-masked reference."""
    _skip_unless_runs("flash_attn", torch.bfloat16)
    monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", varlen)
    lengths = [1, 97, 3, 64, 1, 40, 50]
    s = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    q, k, v, dout = make_inputs(11, 2, s, 8, 2, 20, torch.float32)
    qd, kd, vd = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = ring_attention(qd, kd, vd, causal=True, cu_seqlens=cu)
    out.backward(dout.to("cuda", torch.bfloat16))
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (qd, kd, vd))
    ref = reference_doc_attention(qr, kr, vr, True, cu)
    ref.backward(dout.to(torch.bfloat16).double())
    for name, a, b in [
        ("out", out, ref),
        ("dq", qd.grad, qr.grad),
        ("dk", kd.grad, kr.grad),
        ("dv", vd.grad, vr.grad),
    ]:
        err = ((a.double().cpu() - b).norm() / b.norm()).item()
        assert err < TOL[torch.bfloat16], f"varlen={varlen!r}: {name} rel err {err:.2e}"
