"""Block-kernel wrappers checked on CPU: head_dim padding, the fp32 kernel under autocast, flash-attn's
two call conventions (2.6 and >= 2.7, emulated by a stand-in module whose kernel is torch's CPU flash op)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.attention_cases import make_inputs, reference_attention
from workers.attention import kernels, ring_attention
from workers.attention.kernels import FlashAttn, TorchCpuFlash, _pad8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_zero_padding_head_dim_is_exact() -> None:
    """Padded to a multiple of 8 with zeros and the scale explicit, out/lse/grads equal the unpadded ones."""
    q, k, v, dout = make_inputs(1, 2, 16, 4, 2, 13, torch.float64)
    kern, scale = TorchCpuFlash(), 13**-0.5
    out, lse = kern.forward(q, k, v, True, scale)
    out_p, lse_p = kern.forward(_pad8(q), _pad8(k), _pad8(v), True, scale)
    assert _pad8(q).shape[-1] == 16 and torch.equal(_pad8(q)[..., 13:], torch.zeros(2, 16, 4, 3, dtype=torch.float64))
    assert (out_p[..., :13] - out).abs().max() < 1e-14 and out_p[..., 13:].abs().max() == 0
    assert (lse_p - lse).abs().max() < 1e-14
    grads = kern.backward(dout, q, k, v, out, lse, True, scale)
    grads_p = kern.backward(_pad8(dout), _pad8(q), _pad8(k), _pad8(v), out_p, lse_p, True, scale)
    for g, gp in zip(grads, grads_p, strict=True):
        assert (gp[..., :13] - g).abs().max() < 1e-13


def test_fp32_math_kernel_ignores_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast the exact fallback kernel still computes in fp32 (einsum would run in bf16)."""
    monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", "torch_math")
    q, k, v, dout = make_inputs(2, 1, 32, 4, 2, 16, torch.float32)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(qr, kr, vr, causal=True)
    out.backward(dout)
    q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q2, k2, v2, True)
    ref.backward(dout.double())
    for a, b in [(out, ref), (qr.grad, q2.grad), (kr.grad, k2.grad), (vr.grad, v2.grad)]:
        assert _rel(a, b) < 1e-5  # bf16 would be ~1e-3


def _fake_flash_attn(convention: str) -> tuple[types.ModuleType, list[tuple]]:
    """A stand-in `flash_attn.flash_attn_interface` with the private fwd/bwd of one release line, computing
    with torch's CPU flash op; every call's positional arguments are recorded."""
    calls: list[tuple] = []
    cpu = TorchCpuFlash()

    if convention == "2.7":

        def fwd(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
            return_softmax,
        ):  # type: ignore[no-untyped-def]
            args = (q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap)
            calls.append(("fwd", *args, alibi_slopes, return_softmax))
            out, lse = cpu.forward(q, k, v, causal, softmax_scale)
            return out, lse, None, None

        def bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
            deterministic,
            rng_state=None,
        ):  # type: ignore[no-untyped-def]
            calls.append(("bwd", window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state))
            for dst, src in zip(
                (dq, dk, dv), cpu.backward(dout, q, k, v, out, lse, causal, softmax_scale), strict=True
            ):
                dst.copy_(src)
            return None
    else:

        def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):  # type: ignore[no-untyped-def]
            calls.append(("fwd", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes))
            out, lse = cpu.forward(q, k, v, causal, softmax_scale)
            return out, q, k, v, out, lse, None, None  # 2.6: lse at index 5

        def bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            rng_state=None,
        ):  # type: ignore[no-untyped-def]
            calls.append(("bwd", window_size, softcap, alibi_slopes, deterministic, rng_state))
            for dst, src in zip(
                (dq, dk, dv), cpu.backward(dout, q, k, v, out, lse, causal, softmax_scale), strict=True
            ):
                dst.copy_(src)
            return None

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_forward = fwd  # type: ignore[attr-defined]
    mod._flash_attn_backward = bwd  # type: ignore[attr-defined]
    return mod, calls


@pytest.mark.parametrize("convention", ["2.6", "2.7"])
def test_flash_attn_both_call_conventions(convention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mod, calls = _fake_flash_attn(convention)
    pkg = types.ModuleType("flash_attn")
    pkg.flash_attn_interface = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
    kernels._flash_attn_api.cache_clear()
    try:
        assert kernels.flash_attn_available()
        monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", "flash_attn")
        # fp32 (real flash-attn takes fp16/bf16; its lse, which the wrapper hands back as fp32, is fp32 anyway)
        q, k, v, dout = make_inputs(3, 1, 16, 4, 2, 12, torch.float32)  # head_dim 12: padded to 16
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(qr, kr, vr, causal=True)
        out.backward(dout)
        fwd_call = next(c for c in calls if c[0] == "fwd")
        assert fwd_call[1].shape[-1] == 16  # padded inside the wrapper
        window = fwd_call[7:9] if convention == "2.7" else fwd_call[7]
        assert tuple(window) == (-1, -1) and fwd_call[4] == 0.0  # no sliding window, no dropout
        q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference_attention(q2, k2, v2, True)
        ref.backward(dout.double())
        for a, b in [(out, ref), (qr.grad, q2.grad), (kr.grad, k2.grad), (vr.grad, v2.grad)]:
            assert a.shape == b.shape and _rel(a, b) < 1e-5
        assert {c[0] for c in calls} == {"fwd", "bwd"}
    finally:
        kernels._flash_attn_api.cache_clear()


def test_flash_attn_probe_needs_the_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare `flash_attn` namespace (flash-attn-4 ships only flash_attn.cute) is not FA2."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)  # import fails
    kernels._flash_attn_api.cache_clear()
    try:
        assert not kernels.flash_attn_available()
    finally:
        kernels._flash_attn_api.cache_clear()


def test_flash_attn_probe_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels._flash_attn_api.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    kernels.flash_attn_available()
    kernels.flash_attn_available()
    assert kernels._flash_attn_api.cache_info().misses == 1
    kernels._flash_attn_api.cache_clear()


def test_flash_backend_object_is_importable_without_flash_attn() -> None:
    assert FlashAttn().name == "flash_attn"
