"""Ring attention: exact softmax attention over a sequence sharded across a process group.

Each rank keeps its queries; K/V blocks travel around the ring (the next one in flight while the
current one is computed) and partial results are merged with the online-softmax update in fp32.
The backward pass recomputes each block against the *globally merged* out/lse; dK/dV travel in a
buffer one step behind K/V and arrive back at their owner after W steps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist

from workers.attention.comm import RingComm
from workers.attention.kernels import BlockKernel, select_kernel
from workers.attention.layouts import _rank_world, check_layout
from workers.attention.merge import merge_
from workers.attention.plan import ALL_ROWS, Block, Documents, ring_plan
from workers.attention.varlen import Pack, VarlenKernel, ring_packs, select_varlen
from workers.parallel_dims import ring_head_chunks


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _covers_all(block: Block, n: int) -> bool:
    return block.rows == ALL_ROWS and block.q == slice(0, n)


class _Running:
    """The forward's running (out [B, S, H, D], lse [B, H, S]); None before the first block."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None


AddGrads = Callable[[torch.Tensor], None]

# Block-kernel calls made in this process, by (step strategy, "forward" | "backward"): a record
# that lets tests see which path really ran (selection alone can say one thing while `_steps` does
# another). Nothing reads it to decide anything.
kernel_calls: Counter[tuple[str, str]] = Counter()


class _PerBlock:
    """One block-kernel call per plan block (dense steps; documents without a varlen kernel)."""

    def __init__(self, plan: list[list[Block]], kernel: BlockKernel, scale: float) -> None:
        self.plan, self.kernel, self.scale = plan, kernel, scale

    def fold(self, step: int, q: torch.Tensor, kv: torch.Tensor, run: _Running) -> None:
        acc = _acc_dtype(q.dtype)
        b, n, h, _ = q.shape
        for blk in self.plan[step]:
            kernel_calls["per_block", "forward"] += 1
            r = blk.rows
            b_out, b_lse = self.kernel.forward(
                q[r, blk.q], kv[0][r, blk.kv], kv[1][r, blk.kv], blk.causal, self.scale
            )
            if run.out is None and _covers_all(
                blk, n
            ):  # dense step 0: the diagonal block covers every row
                run.out, run.lse = b_out.to(acc), b_lse.to(acc).contiguous()
                continue
            if (
                run.out is None or run.lse is None
            ):  # packed documents: rows start empty and fill block by block
                run.out = torch.zeros(q.shape, dtype=acc, device=q.device)
                run.lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
            merge_(run.out[r, blk.q], run.lse[r, :, blk.q], b_out, b_lse)

    @staticmethod
    def finish(run: _Running, q: torch.Tensor) -> None:
        """Nothing to do: blocks fold in place into out [B, S, H, D], lse [B, H, S]."""

    def whole_block(self, n: int) -> Block | None:
        """The plan's only block when it covers every query and key of a single step (one rank, no
        documents): its gradients need no accumulation buffers."""
        if len(self.plan) == 1 and len(self.plan[0]) == 1:
            blk = self.plan[0][0]
            if _covers_all(blk, n) and blk.kv == slice(0, n):
                return blk
        return None

    def grads(
        self,
        step: int,
        dout: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
    ) -> AddGrads:
        done = []
        for blk in self.plan[step]:
            kernel_calls["per_block", "backward"] += 1
            r = blk.rows
            dq_b, dk_b, dv_b = self.kernel.backward(
                dout[r, blk.q], q[r, blk.q], kv[0][r, blk.kv], kv[1][r, blk.kv], out[r, blk.q],
                lse[r, :, blk.q], blk.causal, self.scale,
            )  # fmt: skip
            dq[r, blk.q] += dq_b
            # the block's dQ is added: only dK/dV wait for their buffer
            done.append((blk, dk_b, dv_b))

        def add(dkv: torch.Tensor) -> None:
            for blk, dk_b, dv_b in done:
                dkv[0][blk.rows, blk.kv] += dk_b
                dkv[1][blk.rows, blk.kv] += dv_b
            done.clear()

        return add


class _Packed:
    """Each ring step's blocks as at most two varlen calls (`varlen.ring_packs`): gather, merge,
    scatter."""

    def __init__(self, packs: list[list[Pack]], kernel: VarlenKernel, scale: float) -> None:
        self.packs, self.kernel, self.scale = packs, kernel, scale

    def fold(self, step: int, q: torch.Tensor, kv: torch.Tensor, run: _Running) -> None:
        acc = _acc_dtype(q.dtype)
        b, n, h, d = q.shape
        qf, kf, vf = (
            q.reshape(b * n, h, d),
            kv[0].reshape(b * n, -1, d),
            kv[1].reshape(b * n, -1, d),
        )
        if run.out is None or run.lse is None:  # flat while folding: [B·S, H, D] and [H, B·S]
            run.out = torch.zeros((b * n, h, d), dtype=acc, device=q.device)
            run.lse = torch.full((h, b * n), float("-inf"), dtype=acc, device=q.device)
        for p in self.packs[step]:
            kernel_calls["packed", "forward"] += 1
            qi, ki = p.q_index, p.k_index
            o, lse = self.kernel.forward(qf[qi], kf[ki], vf[ki], p, self.scale)
            o_run, lse_run = run.out[qi], run.lse[:, qi]
            merge_(o_run[None], lse_run[None], o[None], lse[None])
            run.out.index_copy_(0, qi, o_run)
            run.lse.index_copy_(1, qi, lse_run)

    @staticmethod
    def finish(run: _Running, q: torch.Tensor) -> None:
        """Back from the flat layout to out [B, S, H, D], lse [B, H, S]."""
        if run.out is not None and run.lse is not None:
            b, n, h, d = q.shape
            run.out = run.out.view(b, n, h, d)
            run.lse = run.lse.view(h, b, n).permute(1, 0, 2).contiguous()

    def grads(
        self,
        step: int,
        dout: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
    ) -> AddGrads:
        b, n, h, d = q.shape
        dof, qf, of = (x.reshape(b * n, h, d) for x in (dout, q, out))
        kf, vf = kv[0].reshape(b * n, -1, d), kv[1].reshape(b * n, -1, d)
        lsef = lse.permute(1, 0, 2).reshape(h, b * n)
        dqf = dq.view(b * n, h, d)
        done = []
        for p in self.packs[step]:
            kernel_calls["packed", "backward"] += 1
            qi, ki = p.q_index, p.k_index
            dq_p, dk_p, dv_p = self.kernel.backward(
                dof[qi], qf[qi], kf[ki], vf[ki], of[qi], lsef[:, qi], p, self.scale
            )
            dqf.index_add_(0, qi, dq_p.to(dqf.dtype))
            done.append((ki, dk_p, dv_p))

        def add(dkv: torch.Tensor) -> None:
            dkvf = dkv.view(2, b * n, -1, d)
            for ki, dk_p, dv_p in done:
                dkvf[0].index_add_(0, ki, dk_p.to(dkvf.dtype))
                dkvf[1].index_add_(0, ki, dv_p.to(dkvf.dtype))
            done.clear()

        return add


Steps = _PerBlock | _Packed


def _fold_ring(q, kv, steps: Steps, comm, world, overlap):
    """The forward over this rank's `kv` = stack([k, v]): (out, lse), merged over the whole ring."""
    run = _Running()
    for step in range(world):
        last = step + 1 == world
        if overlap and not last:
            comm.send_recv(kv)
        steps.fold(step, q, kv, run)
        if not last:
            if not overlap:
                comm.send_recv(kv)
            kv = comm.wait()
    steps.finish(run, q)
    return run.out, run.lse


def _head_chunks(kv_heads: int, heads: int, chunks: int) -> list[tuple[slice, slice]]:
    """(K/V heads, query heads sharing them) of each of `chunks` equal K/V-head chunks."""
    per_kv = kv_heads // chunks
    per_q = per_kv * (heads // kv_heads)
    return [
        (slice(c * per_kv, (c + 1) * per_kv), slice(c * per_q, (c + 1) * per_q))
        for c in range(chunks)
    ]


def _forward(q, kv, steps: Steps, comm, world, overlap):
    """(out in q's dtype, lse): the ring folded over K/V-head chunks (`ring_head_chunks`), one
    chunk's full ring after another, so that only a chunk's K/V are in hand and in flight besides
    the rank's own."""
    kv_heads = kv.shape[3]
    chunks = ring_head_chunks(kv_heads, world)
    if chunks == 1:
        out, lse = _fold_ring(q, kv, steps, comm, world, overlap)
        return out.to(q.dtype), lse
    b, n, h, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), dtype=_acc_dtype(q.dtype), device=q.device)
    for ks, hs in _head_chunks(kv_heads, h, chunks):
        out_c, lse_c = _fold_ring(q[:, :, hs], kv[:, :, :, ks], steps, comm, world, overlap)
        out[:, :, hs] = out_c
        lse[:, hs] = lse_c
        del out_c, lse_c
    return out, lse


def _exchanging(comm: RingComm | None) -> RingComm:
    """The comm of an exchange; it is None only for a single rank, which never exchanges."""
    if comm is None:
        raise RuntimeError("ring exchange with world size 1: no RingComm exists to send or receive")
    return comm


def _backward(dout, saved: list[torch.Tensor], steps: Steps, group, world):
    """dQ, dK, dV. `saved` = [q, kv, out, lse] is emptied here so that, under activation
    checkpointing (whose unpacked tensors nothing else holds), what this rank no longer needs is
    freed: its own K/V once they have left (or, run in head chunks, its storage takes the chunks'
    dK/dV as they come home), and each step's block gradients once they are in the travelling
    dK/dV."""
    q, kv, out, lse = saved
    saved.clear()
    if world == 1 and isinstance(steps, _PerBlock):
        whole = steps.whole_block(q.shape[1])
        if whole is not None:  # one rank, one dense block: the kernel's gradients are the answer
            kernel_calls["per_block", "backward"] += 1
            grads = steps.kernel.backward(
                dout, q, kv[0], kv[1], out, lse, whole.causal, steps.scale
            )
            return tuple(g.to(q.dtype) for g in grads)
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)
    kv_heads = kv.shape[3]
    chunks = ring_head_chunks(kv_heads, world)
    if chunks == 1:
        k_dtype, own = kv.dtype, [kv]
        del kv  # `own` is the only reference now: the ring lets go of it once it has left
        dkv = _ring_backward(dout, q, own, out, lse, dq, steps, group, world)
        return dq.to(q.dtype), dkv[0].to(k_dtype), dkv[1].to(k_dtype)
    for ks, hs in _head_chunks(kv_heads, q.shape[2], chunks):
        dkv = _ring_backward(
            dout[:, :, hs], q[:, :, hs], [kv[:, :, :, ks]], out[:, :, hs], lse[:, hs], dq[:, :, hs],
            steps, group, world,
        )  # fmt: skip
        # these K/V have made their rounds: their storage takes their gradient
        kv[:, :, :, ks] = dkv
        del dkv
    return dq.to(q.dtype), kv[0], kv[1]


def _ring_backward(dout, q, own: list[torch.Tensor], out, lse, dq, steps: Steps, group, world):
    """One full ring of the backward over these heads: adds into `dq`, returns dK/dV stacked (acc
    dtype). `own` = [this rank's K/V stacked], taken out so nothing here keeps it past its send."""
    kv = own.pop()
    acc = _acc_dtype(q.dtype)
    kv_comm = RingComm(group) if world > 1 else None
    dkv_comm = RingComm(group) if world > 1 else None
    for step in range(world):
        last = step + 1 == world
        if not last:
            _exchanging(kv_comm).send_recv(kv)
        add_grads = steps.grads(step, dout, q, kv, out, lse, dq)
        # The dkv that arrived meanwhile belongs to the K/V block we hold now: add ours, pass it on.
        dkv = (
            _exchanging(dkv_comm).wait()
            if step > 0
            else torch.zeros(kv.shape, dtype=acc, device=q.device)
        )
        add_grads(dkv)
        del add_grads
        if world > 1:
            _exchanging(dkv_comm).send_recv(dkv)
        if not last:
            kv = _exchanging(kv_comm).wait()
    if world > 1:
        dkv = _exchanging(
            dkv_comm
        ).wait()  # our own block's gradient, summed over every rank's queries
    return dkv


def _steps(q: torch.Tensor, causal, layout, rank, world, scale, docs) -> Steps:
    """How each ring step is computed: packed varlen calls for documents where a varlen kernel runs,
    else blocks."""
    n = q.shape[1]
    varlen = select_varlen(q.device, q.dtype, q.shape[-1]) if docs is not None else None
    if varlen is not None:
        packs = ring_packs(layout, causal, rank, world, n, docs, q.shape[0])
        return _Packed([[p.to(q.device) for p in step] for step in packs], varlen, scale)
    kernel = select_kernel(q.device, q.dtype, q.shape[-1])
    return _PerBlock(ring_plan(layout, causal, rank, world, n, docs), kernel, scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group, scale, overlap, docs):
        rank, world = _rank_world(group)
        comm = RingComm(group) if world > 1 else None
        steps = _steps(q, causal, layout, rank, world, scale, docs)
        # K and V stacked once: the send buffer, and what backward starts from (saved instead of
        # k and v)
        kv = torch.stack([k, v])
        out, lse = _forward(q, kv, steps, comm, world, overlap)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.args = (steps, group, world)
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = _backward(dout, list(ctx.saved_tensors), *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v must be [batch, seq_local, heads, head_dim]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch, seq_local "
            "and head_dim"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
        )
    if q.shape[1] == 0:
        raise ValueError("seq_local must be at least 1")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank; seq_local={q.shape[1]} is odd"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"attention needs floating-point tensors; got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def documents(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> Documents | None:
    """Validate `cu_seqlens` (global document boundaries) and group batch rows that share them.

    Two forms: `[0, l1, l1+l2, …, S]` (every batch row holds the same documents), or flash-attn's
    varlen convention over the flattened batch, `[0, …, S, …, 2S, …, B·S]` (each row its own
    documents; every multiple of S must be a boundary, since a document never crosses rows).
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens must be int32 (flash-attn's convention), got {cu_seqlens.dtype}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be 1-D [0, …, S] with at least 2 entries, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    drops = [i for i in range(1, len(bounds)) if bounds[i] < bounds[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(
            f"cu_seqlens must be non-decreasing; cu_seqlens[{i}]={bounds[i]} < "
            f"cu_seqlens[{i - 1}]={bounds[i - 1]}"
        )
    if bounds[-1] == seq_len:
        return Documents(((0, batch, tuple(bounds)),))
    if bounds[-1] != batch * seq_len:
        extra = (
            f" or batch x S = {batch * seq_len} (one set of documents per row)" if batch > 1 else ""
        )
        raise ValueError(
            f"cu_seqlens must end at the global sequence length S = {seq_len}{extra}, "
            f"got {bounds[-1]}"
        )
    present = set(bounds)
    rows = []
    for row in range(batch):
        lo, hi = row * seq_len, (row + 1) * seq_len
        if lo not in present:
            raise ValueError(
                f"cu_seqlens lacks the row boundary {lo}: a document may not cross batch rows"
            )
        rows.append(tuple(sorted({b - lo for b in bounds if lo <= b <= hi})))
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for row, bnd in enumerate(rows):
        if groups and groups[-1][2] == bnd:
            groups[-1] = (groups[-1][0], row + 1, bnd)
        else:
            groups.append((row, row + 1, bnd))
    return Documents(tuple(groups))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole (sharded) sequence.

    q: [batch, seq_local, heads, head_dim]; k, v: [batch, seq_local, kv_heads, head_dim] with
    heads % kv_heads == 0. `layout` names how the global sequence was split (see `shard_sequence`).
    `cu_seqlens` (int32, global boundaries, identical on every rank; see `documents`) restricts each
    token to its own packed document. Returns [batch, seq_local, heads, head_dim] in q's dtype;
    differentiable.
    """
    return _ring_attention(
        q,
        k,
        v,
        causal=causal,
        layout=layout,
        group=group,
        softmax_scale=softmax_scale,
        cu_seqlens=cu_seqlens,
    )


def _ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    overlap: bool = True,
) -> torch.Tensor:
    """`ring_attention` with the overlap switch exposed (the benchmark measures what it hides)."""
    _validate(q, k, v, layout)
    _, world = _rank_world(group)
    docs = documents(cu_seqlens, q.shape[0], q.shape[1] * world)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _RingAttention.apply(q, k, v, causal, layout, group, float(scale), overlap, docs)
