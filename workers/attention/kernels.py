"""Block attention kernels that also return the log-sum-exp, behind one small interface.

Tensors are [batch, seq, heads, head_dim]; `k`/`v` may have fewer heads (GQA). `causal=True` is only
ever requested for square blocks whose queries and keys share positions, so top-left vs bottom-right
alignment of the different kernels never matters. The backward takes the *global* out and lse.

Backends, chosen at run time by device, dtype and head_dim (override: RINGTRAIN_ATTN_BACKEND):
- ``flash_attn``: flash-attn 2 kernels (CUDA, fp16/bf16), when
  `flash_attn.flash_attn_interface` imports;
- ``torch_cuda_flash``: torch's CUDA flash-attention ops (fp16/bf16), GQA by expanding heads
  in-kernel;
- ``torch_cpu_flash``: torch's CPU flash-attention op and its backward (any float dtype, GQA
  native);
- ``torch_math``: exact matmul + logsumexp reference, any device/dtype: fp32 on CUDA, and the
  fallback where flash kernels do not run (head_dim > 256, compute capability < 8.0).
The CUDA flash wrappers pad head_dim to a multiple of 8 with zeros (exact: the scale is explicit,
zero columns add nothing to q·k and produce zero output columns that are sliced off).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BlockKernel(Protocol):
    @property
    def name(self) -> str:
        """Backend name (read-only: the kernels are frozen dataclasses)."""
        ...

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

    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
        )
        return _bhsd(out), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
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
    """Reference kernel: scores in fp32 (fp64 for fp64), explicit softmax backward from the global
    lse."""

    name: str = "torch_math"

    @staticmethod
    def _scores(q, k, causal, scale):
        b, sq, h, d = q.shape
        hk = k.shape[2]
        acc = _lse_dtype(q)
        qg = q.to(acc).reshape(b, sq, hk, h // hk, d)
        s = torch.einsum("bqkgd,bskd->bkgqs", qg, k.to(acc)) * scale  # [B, Hk, G, Sq, Sk]
        if causal:
            s = s.masked_fill(
                torch.ones(sq, k.shape[1], dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        return s

    def forward(self, q, k, v, causal, scale):
        with torch.autocast(
            q.device.type, enabled=False
        ):  # else einsum runs in bf16 under autocast
            return self._forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        with torch.autocast(q.device.type, enabled=False):
            return self._backward(dout, q, k, v, out, lse, causal, scale)

    def _forward(self, q, k, v, causal, scale):
        b, sq, h, _ = q.shape
        s = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # [B, Hk, G, Sq]
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bkgqs,bskd->bqkgd", p, v.to(s.dtype)).reshape(b, sq, h, -1)
        return out.to(q.dtype), lse.reshape(b, h, sq)

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
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


FLASH_MAX_HEAD_DIM = 256


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad the last dim to a multiple of 8 (for the flash kernels); contiguous either way."""
    d = x.shape[-1]
    return F.pad(x, (0, -d % 8)).contiguous() if d % 8 else x.contiguous()


@dataclass(frozen=True)
class TorchCudaFlash:
    """torch's own CUDA flash kernels (fp16/bf16). They lack GQA, so heads are expanded inside the
    block only."""

    name: str = "torch_cuda_flash"

    def forward(self, q, k, v, causal, scale):
        h, d = q.shape[2], q.shape[3]
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(_pad8(q)),
            _bhsd(_pad8(_expand_heads(k, h))),
            _bhsd(_pad8(_expand_heads(v, h))),
            0.0,
            causal,
            False,
            scale=scale,
        )
        return _bhsd(res[0])[..., :d], res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        h, hk, d = q.shape[2], k.shape[2], q.shape[3]
        # Dense blocks: cum_seq_q/k must be None (a defined tensor, even empty, selects the varlen
        # path); philox seed/offset are CPU int64 scalars, as the forward itself returns them
        # without dropout.
        no_rng = torch.empty((), dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhsd(_pad8(dout)),
            _bhsd(_pad8(q)),
            _bhsd(_pad8(_expand_heads(k, h))),
            _bhsd(_pad8(_expand_heads(v, h))),
            _bhsd(_pad8(out)),
            lse.float().contiguous(),
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            no_rng,
            no_rng,
            scale=scale,
        )
        dq, dk, dv = (_bhsd(x)[..., :d] for x in (dq, dk, dv))
        return dq, _fold_heads(dk, hk), _fold_heads(dv, hk)


FlashApi = tuple[Callable[..., Any], Callable[..., Any], bool]


@functools.cache
def _flash_attn_api(kind: str = "") -> FlashApi | None:
    """(forward, backward, split_window) of flash-attn 2's private kernels, or None; `kind` "varlen"
    for the variable-length ones. Probed once: `flash_attn` alone may be a namespace package without
    FA2 (flash-attn-4 ships only `flash_attn.cute`), so import the interface itself.
    flash-attn >= 2.7 takes window_size_left/right and its forward returns (out, lse, S, rng); 2.6
    takes one window_size tuple and returns 8 values (lse at index 5). Both are supported (pyproject
    floor: 2.6)."""
    name = f"_flash_attn{'_' + kind if kind else ''}"
    try:
        import flash_attn.flash_attn_interface as fa

        fwd, bwd = getattr(fa, f"{name}_forward"), getattr(fa, f"{name}_backward")
    except Exception:
        return None
    params = inspect.signature(fwd).parameters
    if "window_size_left" in params:
        return fwd, bwd, True
    if "window_size" in params and "softcap" in params:
        return fwd, bwd, False
    return None  # older than 2.6: no supported convention


def flash_api(kind: str = "") -> FlashApi:
    """`_flash_attn_api(kind)`, or a RuntimeError saying what is missing."""
    api = _flash_attn_api(kind)
    if api is None:
        raise RuntimeError(
            f"flash-attn >= 2.6 {kind or 'dense'} kernels are not importable (flash_attn_interface)"
        )
    return api


@dataclass(frozen=True)
class FlashAttn:
    """flash-attn 2 (CUDA, fp16/bf16; GQA native). Uses its private fwd/bwd that expose the lse."""

    name: str = "flash_attn"

    def forward(self, q, k, v, causal, scale):
        fwd, _, split_window = flash_api()
        d = q.shape[3]
        window = (-1, -1) if split_window else ((-1, -1),)
        res = fwd(_pad8(q), _pad8(k), _pad8(v), 0.0, scale, causal, *window, 0.0, None, False)
        out, lse = (res[0], res[1]) if split_window else (res[0], res[5])
        return out[..., :d], lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _, bwd, split_window = flash_api()
        d = q.shape[3]
        qp, kp, vp = _pad8(q), _pad8(k), _pad8(v)
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        window = (-1, -1) if split_window else ((-1, -1),)
        bwd(
            _pad8(dout), qp, kp, vp, _pad8(out), lse.float().contiguous(), dq, dk, dv,
            0.0, scale, causal, *window, 0.0, None, False, None,
        )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]


_BACKENDS: dict[str, BlockKernel] = {
    k.name: k for k in (TorchCpuFlash(), TorchMath(), TorchCudaFlash(), FlashAttn())
}
CUDA_BACKENDS = ("flash_attn", "torch_cuda_flash", "torch_math")


def flash_attn_available() -> bool:
    return _flash_attn_api() is not None


def _flash_runs(device: torch.device, head_dim: int | None) -> bool:
    """Flash kernels need head_dim <= 256 (after padding to 8) and compute capability >= 8.0."""
    if head_dim is not None and head_dim > FLASH_MAX_HEAD_DIM:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


_IN_USE: list[BlockKernel] = []  # kernels `use_kernel` put in charge here, innermost last


def register_kernel(kernel: BlockKernel) -> None:
    """Add a block kernel to the registry under `kernel.name` (RINGTRAIN_ATTN_BACKEND can name it).

    A name taken by another kernel is refused: a registration never silently replaces a backend."""
    known = _BACKENDS.get(kernel.name)
    if known is not None and known != kernel:
        raise ValueError(f"a different block kernel is already registered as {kernel.name!r}")
    _BACKENDS[kernel.name] = kernel


@contextmanager
def use_kernel(kernel: BlockKernel) -> Iterator[BlockKernel]:
    """Register `kernel` and make `select_kernel` return it, in this process, inside the block.

    The in-process seam for kernels under development and for tests: a deliberately wrong kernel run
    through the whole trainer proves that the pre-training verification catches it. Not a setting:
    nothing outside the calling code can turn it on."""
    register_kernel(kernel)
    _IN_USE.append(kernel)
    try:
        yield kernel
    finally:
        _IN_USE.remove(kernel)


def select_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> BlockKernel:
    """The block kernel used for tensors on `device` of `dtype` (see module docstring)."""
    if _IN_USE:
        return _IN_USE[-1]
    forced = os.environ.get("RINGTRAIN_ATTN_BACKEND", "").strip()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"RINGTRAIN_ATTN_BACKEND={forced!r} is not one of {sorted(_BACKENDS)}")
        return _BACKENDS[forced]
    if device.type == "cpu":
        return _BACKENDS["torch_cpu_flash"]
    if (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and _flash_runs(device, head_dim)
    ):
        return _BACKENDS["flash_attn" if flash_attn_available() else "torch_cuda_flash"]
    return _BACKENDS["torch_math"]


def attention_backend(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
) -> str:
    """Name of the block kernel ring attention uses on this device/dtype/head_dim (reported in job
    metadata)."""
    return select_kernel(torch.device(device), dtype, head_dim).name
