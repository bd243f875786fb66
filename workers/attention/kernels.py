"""Block attention kernels that also return the log-sum-exp, behind one small interface.

Tensors are [batch, seq, heads, head_dim]; `k`/`v` may have fewer heads (GQA). `causal=True` is only
ever requested for square blocks whose queries and keys share positions, so top-left vs bottom-right
alignment of the different kernels never matters. The backward takes the *global* out and lse.

Backends, chosen at run time by device and dtype (override: RINGTRAIN_ATTN_BACKEND):
- ``flash_attn``: flash-attn 2 kernels (CUDA, fp16/bf16), when importable;
- ``torch_cuda_flash``: torch's CUDA flash-attention ops (fp16/bf16), GQA by expanding heads in-kernel;
- ``torch_cpu_flash``: torch's CPU flash-attention op and its backward (any float dtype, GQA native);
- ``torch_math``: exact matmul + logsumexp reference, any device/dtype (fallback, e.g. fp32 on CUDA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BlockKernel(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] in fp32, or fp64 for fp64 inputs)."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> Grads:
        """-> (dq, dk, dv) with the shapes of q, k, v."""
        ...


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


@dataclass(frozen=True)
class TorchCpuFlash:
    name: str = "torch_cpu_flash"

    def forward(self, q, k, v, causal, scale):  # type: ignore[no-untyped-def]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
        )
        return _bhsd(out), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):  # type: ignore[no-untyped-def]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out),
            lse.to(_lse_dtype(q)).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class TorchMath:
    """Reference kernel: scores in fp32 (fp64 for fp64), explicit softmax backward from the global lse."""

    name: str = "torch_math"

    @staticmethod
    def _scores(q, k, causal, scale):  # type: ignore[no-untyped-def]
        b, sq, h, d = q.shape
        hk = k.shape[2]
        acc = _lse_dtype(q)
        qg = q.to(acc).reshape(b, sq, hk, h // hk, d)
        s = torch.einsum("bqkgd,bskd->bkgqs", qg, k.to(acc)) * scale  # [B, Hk, G, Sq, Sk]
        if causal:
            s = s.masked_fill(torch.ones(sq, k.shape[1], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return s

    def forward(self, q, k, v, causal, scale):  # type: ignore[no-untyped-def]
        b, sq, h, _ = q.shape
        s = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # [B, Hk, G, Sq]
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bkgqs,bskd->bqkgd", p, v.to(s.dtype)).reshape(b, sq, h, -1)
        return out.to(q.dtype), lse.reshape(b, h, sq)

    def backward(self, dout, q, k, v, out, lse, causal, scale):  # type: ignore[no-untyped-def]
        b, sq, h, d = q.shape
        hk = k.shape[2]
        g = h // hk
        s = self._scores(q, k, causal, scale)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).reshape(b, hk, g, sq, 1))
        do = dout.to(acc).reshape(b, sq, hk, g, d)
        delta = (do * out.to(acc).reshape(b, sq, hk, g, d)).sum(-1)  # [B, Sq, Hk, G]
        dv = torch.einsum("bkgqs,bqkgd->bskd", p, do)
        dp = torch.einsum("bqkgd,bskd->bkgqs", do, v.to(acc))
        ds = p * (dp - delta.permute(0, 2, 3, 1).unsqueeze(-1)) * scale
        dq = torch.einsum("bkgqs,bskd->bqkgd", ds, k.to(acc)).reshape(b, sq, h, d)
        dk = torch.einsum("bkgqs,bqkgd->bskd", ds, q.to(acc).reshape(b, sq, hk, g, d))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def _fold_heads(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, s, h, d = dx.shape
    return dx if h == kv_heads else dx.reshape(b, s, kv_heads, h // kv_heads, d).sum(3)


@dataclass(frozen=True)
class TorchCudaFlash:
    """torch's own CUDA flash kernels (fp16/bf16). They lack GQA, so heads are expanded inside the block only."""

    name: str = "torch_cuda_flash"

    def forward(self, q, k, v, causal, scale):  # type: ignore[no-untyped-def]
        h = q.shape[2]
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(_expand_heads(k, h)), _bhsd(_expand_heads(v, h)), 0.0, causal, False, scale=scale
        )
        return _bhsd(res[0]), res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):  # type: ignore[no-untyped-def]
        h, hk = q.shape[2], k.shape[2]
        sq, sk = q.shape[1], k.shape[1]
        cum_q = torch.empty(0, dtype=torch.int32, device=q.device)
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout).contiguous(),
            _bhsd(q),
            _bhsd(_expand_heads(k, h)),
            _bhsd(_expand_heads(v, h)),
            _bhsd(out),
            lse.float().contiguous(),
            cum_q,
            cum_q,
            sq,
            sk,
            0.0,
            causal,
            empty,
            empty,
            scale=scale,
        )
        return _bhsd(dq), _fold_heads(_bhsd(dk), hk), _fold_heads(_bhsd(dv), hk)


@dataclass(frozen=True)
class FlashAttn:
    """flash-attn 2 (CUDA, fp16/bf16; GQA native). Uses its private fwd/bwd that expose the lse."""

    name: str = "flash_attn"

    def forward(self, q, k, v, causal, scale):  # type: ignore[no-untyped-def]
        from flash_attn.flash_attn_interface import _flash_attn_forward

        res = _flash_attn_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):  # type: ignore[no-untyped-def]
        from flash_attn.flash_attn_interface import _flash_attn_backward

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            dout.contiguous(),
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out.contiguous(),
            lse.float().contiguous(),
            dq,
            dk,
            dv,
            0.0,
            scale,
            causal,
            -1,
            -1,
            0.0,
            None,
            False,
            None,
        )
        return dq, dk, dv


_BACKENDS: dict[str, BlockKernel] = {k.name: k for k in (TorchCpuFlash(), TorchMath(), TorchCudaFlash(), FlashAttn())}


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def select_kernel(device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The block kernel used for tensors on `device` of `dtype` (see module docstring)."""
    forced = os.environ.get("RINGTRAIN_ATTN_BACKEND", "").strip()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"RINGTRAIN_ATTN_BACKEND={forced!r} is not one of {sorted(_BACKENDS)}")
        return _BACKENDS[forced]
    if device.type == "cpu":
        return _BACKENDS["torch_cpu_flash"]
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return _BACKENDS["flash_attn" if _flash_attn_available() else "torch_cuda_flash"]
    return _BACKENDS["torch_math"]


def attention_backend(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """Name of the block kernel ring attention uses on this device/dtype (reported in job metadata)."""
    return select_kernel(torch.device(device), dtype).name
