"""Ring attention: exact softmax attention over a sequence sharded across a process group.

Each rank keeps its queries; K/V blocks travel around the ring (the next one in flight while the
current one is computed) and partial results are merged with the online-softmax update in fp32.
The backward pass recomputes each block against the *globally merged* out/lse; dK/dV travel in a
buffer one step behind K/V and arrive back at their owner after W steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.attention.comm import RingComm
from workers.attention.kernels import select_kernel
from workers.attention.layouts import _rank_world, check_layout
from workers.attention.merge import merge_
from workers.attention.plan import block_for_step


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(q, k, v, causal, layout, comm, rank, world, scale, kernel, overlap):  # type: ignore[no-untyped-def]
    acc = _acc_dtype(q.dtype)
    n = q.shape[1]
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(world):
        last = step + 1 == world
        if overlap and not last:
            comm.send_recv(kv)
        block = block_for_step(layout, causal, rank, (rank - step) % world, n)
        if block is not None:
            b_out, b_lse = kernel.forward(q[:, block.q], kv[0][:, block.kv], kv[1][:, block.kv], block.causal, scale)
            if out is None:  # step 0: the diagonal block, which covers every query row
                out, lse = b_out.to(acc), b_lse.to(acc).contiguous()
            else:
                merge_(out[:, block.q], lse[:, :, block.q], b_out, b_lse)
        if not last:
            if not overlap:
                comm.send_recv(kv)
            kv = comm.wait()
    return out, lse


def _backward(dout, q, k, v, out, lse, causal, layout, group, rank, world, scale, kernel):  # type: ignore[no-untyped-def]
    acc = _acc_dtype(q.dtype)
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    kv_comm = RingComm(group) if world > 1 else None
    dkv_comm = RingComm(group) if world > 1 else None
    for step in range(world):
        last = step + 1 == world
        if not last:
            kv_comm.send_recv(kv)
        block = block_for_step(layout, causal, rank, (rank - step) % world, n)
        grads = None
        if block is not None:
            grads = kernel.backward(
                dout[:, block.q],
                q[:, block.q],
                kv[0][:, block.kv],
                kv[1][:, block.kv],
                out[:, block.q],
                lse[:, :, block.q],
                block.causal,
                scale,
            )
            dq[:, block.q] += grads[0]
        # The dkv that arrived meanwhile belongs to the K/V block we hold now: add our part, pass it on.
        dkv = dkv_comm.wait() if step > 0 else torch.zeros(kv.shape, dtype=acc, device=q.device)
        if grads is not None:
            dkv[0][:, block.kv] += grads[1]
            dkv[1][:, block.kv] += grads[2]
        if world > 1:
            dkv_comm.send_recv(dkv)
        if not last:
            kv = kv_comm.wait()
    if world > 1:
        dkv = dkv_comm.wait()  # our own block's gradient, summed over every rank's queries
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group, scale, overlap):  # type: ignore[no-untyped-def, override]
        rank, world = _rank_world(group)
        kernel = select_kernel(q.device, q.dtype)
        comm = RingComm(group) if world > 1 else None
        out, lse = _forward(q, k, v, causal, layout, comm, rank, world, scale, kernel, overlap)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, layout, group, rank, world, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def, override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [batch, seq_local, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch, seq_local and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if q.shape[1] == 0:
        raise ValueError("seq_local must be at least 1")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank; seq_local={q.shape[1]} is odd")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"attention needs floating-point tensors; got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole (sharded) sequence.

    q: [batch, seq_local, heads, head_dim]; k, v: [batch, seq_local, kv_heads, head_dim] with
    heads % kv_heads == 0. `layout` names how the global sequence was split (see `shard_sequence`).
    Returns [batch, seq_local, heads, head_dim] in q's dtype; differentiable.
    """
    return _ring_attention(q, k, v, causal=causal, layout=layout, group=group, softmax_scale=softmax_scale)


def _ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    overlap: bool = True,
) -> torch.Tensor:
    """`ring_attention` with the overlap switch exposed (the benchmark measures what overlap hides)."""
    _validate(q, k, v, layout)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _RingAttention.apply(q, k, v, causal, layout, group, float(scale), overlap)
