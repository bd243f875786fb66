"""Packed documents in one kernel call per ring step: the plan's blocks gathered into
variable-length batches.

With many short documents a ring step's plan (`plan.ring_plan`) is many small blocks, one kernel
launch each. A varlen kernel (flash-attn's `flash_attn_varlen` forward/backward) takes them all at
once: the blocks' queries and keys are gathered into packed tensors `[total, heads, head_dim]` with
cumulative lengths per block. A kernel call has one `causal` flag, so a step is at most two packs:
its causal blocks and its dense ones. Within one pack no two blocks share a query row
(`_split_causal` gives each document at most one diagonal piece and disjoint dense pieces), so each
pack's result folds into the running output with one gather, one merge and one scatter.

Backends: `FlashAttnVarlen` (CUDA, flash-attn >= 2.6, fp16/bf16) in production; `LoopVarlen` runs a
dense block kernel per segment. It exists so this packing is exercised, exactly, on CPU
(`RINGTRAIN_ATTN_VARLEN=loop`); the default on CPU stays the plain per-block path, which needs no
gather.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from workers.attention.kernels import (
    BlockKernel,
    Grads,
    _flash_attn_api,
    _pad8,
    flash_api,
    select_kernel,
)
from workers.attention.plan import Block, Documents, ring_plan


@dataclass(frozen=True)
class Pack:
    """Blocks of one ring step that one varlen call computes. `q_index`/`k_index` are flat indices
    into the local `[batch · seq_local]` tokens; segment i is `q_index[cu_q[i]:cu_q[i+1]]` against
    `k_index[cu_k[i]:cu_k[i+1]]`."""

    causal: bool
    q_index: torch.Tensor  # int64 [total_q]
    k_index: torch.Tensor  # int64 [total_k]
    cu_q: torch.Tensor  # int32 [segments + 1]
    cu_k: torch.Tensor  # int32 [segments + 1]
    max_q: int
    max_k: int

    def to(self, device: torch.device) -> Pack:
        move = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
        return Pack(
            self.causal,
            move(self.q_index),
            move(self.k_index),
            move(self.cu_q),
            move(self.cu_k),
            self.max_q,
            self.max_k,
        )

    def segments(self) -> list[tuple[int, int, int, int]]:
        """(q0, q1, k0, k1) offsets into the packed tensors, per segment (host ints, for
        per-segment kernels)."""
        cq, ck = self.cu_q.tolist(), self.cu_k.tolist()
        return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _pack(blocks: list[Block], causal: bool, batch: int, n: int) -> Pack:
    qs: list[torch.Tensor] = []
    ks: list[torch.Tensor] = []
    cu_q, cu_k = [0], [0]
    for blk in blocks:
        for row in range(batch)[blk.rows]:
            qs.append(torch.arange(blk.q.start, blk.q.stop) + row * n)
            ks.append(torch.arange(blk.kv.start, blk.kv.stop) + row * n)
            cu_q.append(cu_q[-1] + len(qs[-1]))
            cu_k.append(cu_k[-1] + len(ks[-1]))
    q_index, k_index = torch.cat(qs), torch.cat(ks)
    if (
        q_index.unique().numel() != q_index.numel()
    ):  # the merge below scatters once per row: rows must not repeat
        raise AssertionError(
            "a varlen pack holds one query row twice; plan.py's pieces changed shape"
        )
    return Pack(
        causal,
        q_index,
        k_index,
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32),
        max(len(x) for x in qs),
        max(len(x) for x in ks),
    )


@functools.lru_cache(maxsize=64)
def ring_packs(
    layout: str, causal: bool, rank: int, world: int, n: int, docs: Documents | None, batch: int
) -> list[list[Pack]]:
    """Every ring step's blocks (`ring_plan`) as at most two packs: causal ones, then dense ones."""
    out = []
    for blocks in ring_plan(layout, causal, rank, world, n, docs):
        step = []
        for flag in (True, False):
            chosen = [b for b in blocks if b.causal == flag]
            if chosen:
                step.append(_pack(chosen, flag, batch, n))
        out.append(step)
    return out


class VarlenKernel(Protocol):
    @property
    def name(self) -> str: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Pack, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed q [Tq, H, D], k/v [Tk, Hk, D] -> (out [Tq, H, D] in q's dtype, lse [H, Tq]
        fp32/fp64)."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        pack: Pack,
        scale: float,
    ) -> Grads:
        """-> (dq, dk, dv) packed like q, k, v; `out`/`lse` are the global (merged) ones of these
        rows."""
        ...


@dataclass(frozen=True)
class LoopVarlen:
    """One dense block-kernel call per segment: the reference for the packed path (CPU tests, any
    device)."""

    block: BlockKernel

    @property
    def name(self) -> str:
        return f"{self.block.name}+loop"

    def forward(self, q, k, v, pack, scale):
        outs, lses = [], []
        for q0, q1, k0, k1 in pack.segments():
            o, lse = self.block.forward(
                q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], pack.causal, scale
            )
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def backward(self, dout, q, k, v, out, lse, pack, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for q0, q1, k0, k1 in pack.segments():
            g = self.block.backward(
                dout[None, q0:q1],
                q[None, q0:q1],
                k[None, k0:k1],
                v[None, k0:k1],
                out[None, q0:q1],
                lse[None, :, q0:q1],
                pack.causal,
                scale,
            )
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


def _window(split: bool) -> dict[str, Any]:
    return {"window_size_left": -1, "window_size_right": -1} if split else {"window_size": (-1, -1)}


@dataclass(frozen=True)
class FlashAttnVarlen:
    """flash-attn 2 varlen (CUDA, fp16/bf16, GQA native); head_dim padded to 8 like the dense
    wrapper."""

    name: str = "flash_attn_varlen"

    def forward(self, q, k, v, pack, scale):
        fwd, _, split = flash_api("varlen")
        d = q.shape[-1]
        res = fwd(
            _pad8(q), _pad8(k), _pad8(v), pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, 0.0, scale,
            pack.causal, **_window(split), softcap=0.0, alibi_slopes=None, return_softmax=False,
        )  # fmt: skip
        out, lse = (res[0], res[1]) if split else (res[0], res[5])
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(
                f"flash-attn varlen returned lse of shape {tuple(lse.shape)}, "
                "expected [heads, total_q]"
            )
        return out[..., :d], lse

    def backward(self, dout, q, k, v, out, lse, pack, scale):
        _, bwd, split = flash_api("varlen")
        d = q.shape[-1]
        qp, kp, vp = _pad8(q), _pad8(k), _pad8(v)
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        bwd(
            _pad8(dout), qp, kp, vp, _pad8(out), lse.float().contiguous(), dq, dk, dv,
            pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, 0.0, scale, pack.causal,
            **_window(split), softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
        )  # fmt: skip
        return dq[..., :d], dk[..., :d], dv[..., :d]


def select_varlen(device: torch.device, dtype: torch.dtype, head_dim: int) -> VarlenKernel | None:
    """The varlen kernel for packed documents here, or None for the per-block path. Where the block
    kernel is flash-attn, its varlen twin; `RINGTRAIN_ATTN_VARLEN=loop` forces the packed path over
    the block kernel, `off` forbids it."""
    mode = os.environ.get("RINGTRAIN_ATTN_VARLEN", "").strip()
    if mode not in ("", "loop", "off"):
        raise ValueError(f"RINGTRAIN_ATTN_VARLEN={mode!r} is not one of '', 'loop', 'off'")
    block = select_kernel(device, dtype, head_dim)
    if mode == "loop":
        return LoopVarlen(block)
    if mode == "" and block.name == "flash_attn" and _flash_attn_api("varlen") is not None:
        return FlashAttnVarlen()
    return None
