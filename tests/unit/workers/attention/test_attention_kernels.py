"""Block-kernel wrappers checked on CPU: head_dim padding, the fp32 kernel under autocast, flash-attn's
two call conventions (2.6 and >= 2.7, emulated by a stand-in module whose kernel is torch's CPU flash op)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.support.attention_cases import (
    install_flash_attn,
    make_inputs,
    reference_attention,
    reference_doc_attention,
)
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
    assert _pad8(q).shape[-1] == 16 and torch.equal(
        _pad8(q)[..., 13:], torch.zeros(2, 16, 4, 3, dtype=torch.float64)
    )
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
            args = (
                q,
                k,
                v,
                dropout_p,
                softmax_scale,
                causal,
                window_size_left,
                window_size_right,
                softcap,
            )
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
            calls.append(
                (
                    "bwd",
                    window_size_left,
                    window_size_right,
                    softcap,
                    alibi_slopes,
                    deterministic,
                    rng_state,
                )
            )
            for dst, src in zip(
                (dq, dk, dv),
                cpu.backward(dout, q, k, v, out, lse, causal, softmax_scale),
                strict=True,
            ):
                dst.copy_(src)
            return None
    else:

        def fwd(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            return_softmax,
        ):  # type: ignore[no-untyped-def]
            calls.append(
                (
                    "fwd",
                    q,
                    k,
                    v,
                    dropout_p,
                    softmax_scale,
                    causal,
                    window_size,
                    softcap,
                    alibi_slopes,
                )
            )
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
                (dq, dk, dv),
                cpu.backward(dout, q, k, v, out, lse, causal, softmax_scale),
                strict=True,
            ):
                dst.copy_(src)
            return None

    def segments(cu_q, cu_k):  # type: ignore[no-untyped-def]
        cq, ck = cu_q.tolist(), cu_k.tolist()
        return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):  # type: ignore[no-untyped-def]
        """Packed [T, H, D] in, (out [T, H, D], lse [H, T]) out, one segment at a time."""
        assert (
            max_q == max(b - a for a, b, _, _ in segments(cu_q, cu_k)) and cu_q.dtype == torch.int32
        )
        outs, lses = [], []
        for q0, q1, k0, k1 in segments(cu_q, cu_k):
            o, lse = cpu.forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, scale)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal):  # type: ignore[no-untyped-def]
        assert lse.shape == (q.shape[1], q.shape[0])
        for q0, q1, k0, k1 in segments(cu_q, cu_k):
            g = cpu.backward(
                dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                lse[None, :, q0:q1], causal, scale,
            )  # fmt: skip
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]

    if convention == "2.7":

        def vfwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
            block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False,
        ):  # type: ignore[no-untyped-def]  # fmt: skip
            calls.append(("varlen_fwd", window_size_left, window_size_right, dropout_p, softcap))
            out, lse = varlen_fwd(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                softmax_scale,
                causal,
            )
            return out, lse, None, None

        def vbwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
            deterministic, rng_state=None, zero_tensors=False,
        ):  # type: ignore[no-untyped-def]  # fmt: skip
            calls.append(("varlen_bwd", window_size_left, window_size_right, deterministic))
            varlen_bwd(
                dout,
                q,
                k,
                v,
                out,
                softmax_lse,
                dq,
                dk,
                dv,
                cu_seqlens_q,
                cu_seqlens_k,
                softmax_scale,
                causal,
            )
    else:

        def vfwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
            leftpad_k=None, seqused_k=None,
        ):  # type: ignore[no-untyped-def]  # fmt: skip
            calls.append(("varlen_fwd", *window_size, dropout_p, softcap))
            out, lse = varlen_fwd(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                softmax_scale,
                causal,
            )
            return out, q, k, v, out, lse, None, None  # 2.6: lse at index 5

        def vbwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None,
        ):  # type: ignore[no-untyped-def]  # fmt: skip
            calls.append(("varlen_bwd", *window_size, deterministic))
            varlen_bwd(
                dout,
                q,
                k,
                v,
                out,
                softmax_lse,
                dq,
                dk,
                dv,
                cu_seqlens_q,
                cu_seqlens_k,
                softmax_scale,
                causal,
            )

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_forward = fwd  # type: ignore[attr-defined]
    mod._flash_attn_backward = bwd  # type: ignore[attr-defined]
    mod._flash_attn_varlen_forward = vfwd  # type: ignore[attr-defined]
    mod._flash_attn_varlen_backward = vbwd  # type: ignore[attr-defined]
    return mod, calls


@pytest.mark.parametrize("convention", ["2.6", "2.7"])
def test_flash_attn_both_call_conventions(convention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mod, calls = _fake_flash_attn(convention)
    install_flash_attn(monkeypatch, mod)
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


@pytest.mark.parametrize("convention", ["2.6", "2.7"])
def test_flash_attn_varlen_both_call_conventions(
    convention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed documents with flash-attn selected go through `FlashAttnVarlen`: the call reaches the release's varlen
    signature (by keyword where the conventions differ), the lse comes back [heads, total_q], and the result equals
    the float64 document-masked reference."""
    mod, calls = _fake_flash_attn(convention)
    install_flash_attn(monkeypatch, mod)
    monkeypatch.setenv("RINGTRAIN_ATTN_BACKEND", "flash_attn")
    try:
        q, k, v, dout = make_inputs(4, 2, 24, 4, 2, 12, torch.float32)  # head_dim 12: padded to 16
        cu = torch.tensor([0, 1, 9, 10, 24], dtype=torch.int32)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(qr, kr, vr, causal=True, cu_seqlens=cu)
        out.backward(dout)
        assert {c[0] for c in calls} == {"varlen_fwd", "varlen_bwd"}, (
            "packed documents must not fall back per piece"
        )
        assert all(c[1:3] == (-1, -1) for c in calls)  # no sliding window
        q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference_doc_attention(q2, k2, v2, True, cu)
        ref.backward(dout.double())
        for a, b in [(out, ref), (qr.grad, q2.grad), (kr.grad, k2.grad), (vr.grad, v2.grad)]:
            assert a.shape == b.shape and _rel(a, b) < 1e-5
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
