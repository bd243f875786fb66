"""Which parts of each ring step's (local queries × visiting keys) block the mask leaves visible.

This is the only place the layouts differ. At step s rank r holds the K/V of rank j = (r - s) mod W.
A step yields zero or more blocks, each (query slice, key slice, causal[, batch rows]) where
`causal` is only set for square blocks whose key j is visible to query i exactly when j <= i (so the
top-left vs bottom-right alignment of the kernels never matters). Entirely masked parts are never
returned: a block the mask removes is skipped, never merged.

Without documents a step is one dense block (`block_for_step`). With packed documents (`Documents`)
that dense block is refined: every local position belongs to one document, documents are contiguous
runs of a shard (each layout's positions ascend), so a document's queries and keys inside a block
are index ranges, and the visible pairs split into at most three kernel-friendly pieces per
document.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from workers.attention.layouts import shard_positions

ALL_ROWS = slice(None)


@dataclass(frozen=True)
class Block:
    q: slice
    kv: slice
    causal: bool
    rows: slice = field(
        default_factory=lambda: ALL_ROWS
    )  # batch rows (packed rows may differ in documents)

    def cost(self) -> float:
        """Visible (query, key) pairs per batch row: what the kernel must compute."""
        nq = self.q.stop - self.q.start
        nk = self.kv.stop - self.kv.start
        return nq * (nq + 1) / 2 if self.causal else nq * nk


def block_for_step(layout: str, causal: bool, rank: int, src: int, n: int) -> Block | None:
    """The visible block of local queries (n of them) against the K/V of rank `src`, or None."""
    full = slice(0, n)
    if not causal:
        return Block(full, full, False)
    if layout == "contiguous":
        if src == rank:
            return Block(full, full, True)
        return Block(full, full, False) if src < rank else None
    if layout == "zigzag":
        half = n // 2  # local = [chunk rank, chunk 2W-1-rank]
        if src == rank:
            return Block(full, full, True)
        if src < rank:  # everything sees the early chunk of src; nothing sees its late chunk
            return Block(full, slice(0, half), False)
        return Block(slice(half, n), full, False)  # only our late chunk sees src, all of it
    if layout == "striped":
        if src <= rank:  # token t of src precedes or equals our token t
            return Block(full, full, True)
        if n == 1:
            return None
        return Block(slice(1, n), slice(0, n - 1), True)  # strictly causal = shift queries by one
    raise ValueError(f"unknown layout {layout!r}")


@dataclass(frozen=True)
class Documents:
    """Packed documents: for each run of batch rows [first, stop) that share them, the global
    boundaries [0, …, S]. Plain ints and tuples, so a plan can be cached by it."""

    groups: tuple[tuple[int, int, tuple[int, ...]], ...]


def _runs(bounds: tuple[int, ...], positions: torch.Tensor) -> dict[int, tuple[int, int]]:
    """document id -> [start, stop) indices of `positions` (ascending) that fall in it."""
    ids = torch.searchsorted(torch.tensor(bounds, dtype=torch.int64), positions, right=True) - 1
    docs, counts = torch.unique_consecutive(ids, return_counts=True)
    runs, start = {}, 0
    for doc, count in zip(docs.tolist(), counts.tolist(), strict=True):
        runs[doc] = (start, start + count)
        start += count
    return runs


def _split_causal(qa: int, qb: int, ka: int, kb: int) -> list[tuple[int, int, int, int, bool]]:
    """Pairs i in [qa, qb), j in [ka, kb) with j <= i, as (q0, q1, k0, k1, causal) pieces."""
    pieces = []
    m0, m1 = (
        max(qa, ka),
        min(qb, kb),
    )  # rows that see a prefix of the keys, ending on their diagonal
    if m0 < m1:
        if m0 > ka:
            pieces.append((m0, m1, ka, m0, False))
        pieces.append((m0, m1, m0, m1, True))
    f0 = max(qa, kb)  # rows past the last key see every key
    if f0 < qb and ka < kb:
        pieces.append((f0, qb, ka, kb, False))
    return pieces


def _refine(
    dense: Block, q_pos: torch.Tensor, k_pos: torch.Tensor, rows: slice, bounds: tuple[int, ...]
) -> list[Block]:
    """The dense block restricted to pairs within one document."""
    q_runs = _runs(bounds, q_pos[dense.q])
    k_runs = _runs(bounds, k_pos[dense.kv])
    out = []
    for doc, (qa, qb) in q_runs.items():
        if doc not in k_runs:
            continue
        ka, kb = k_runs[doc]
        pieces = _split_causal(qa, qb, ka, kb) if dense.causal else [(qa, qb, ka, kb, False)]
        for q0, q1, k0, k1, causal in pieces:
            qs = slice(dense.q.start + q0, dense.q.start + q1)
            ks = slice(dense.kv.start + k0, dense.kv.start + k1)
            out.append(Block(qs, ks, causal, rows))
    return out


def _rows(first: int, stop: int, docs: Documents) -> slice:
    return ALL_ROWS if len(docs.groups) == 1 else slice(first, stop)


@functools.lru_cache(maxsize=64)
def ring_plan(
    layout: str, causal: bool, rank: int, world: int, n: int, docs: Documents | None
) -> list[list[Block]]:
    """Blocks of every ring step for `rank` (n local tokens): step s visits the K/V of rank
    (rank - s) mod W.

    Cached: every layer of a model asks for the same plan.
    """
    steps: list[list[Block]] = []
    for step in range(world):
        src = (rank - step) % world
        dense = block_for_step(layout, causal, rank, src, n)
        if dense is None:
            steps.append([])
        elif docs is None:
            steps.append([dense])
        else:
            q_pos = shard_positions(n * world, layout, rank, world)
            k_pos = shard_positions(n * world, layout, src, world)
            steps.append(
                [
                    b
                    for first, stop, bounds in docs.groups
                    for b in _refine(dense, q_pos, k_pos, _rows(first, stop, docs), bounds)
                ]
            )
    return steps
