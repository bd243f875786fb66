"""Which part of each ring step's (local queries × visiting keys) block the mask leaves visible.

This is the only place the layouts differ. At step s rank r holds the K/V of rank j = (r - s) mod W.
A step yields zero blocks (entirely masked: skipped, never merged), or one block given as
(query slice, key slice, causal) where `causal` is only set for square blocks with aligned positions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    q: slice
    kv: slice
    causal: bool

    def cost(self) -> float:
        """Visible (query, key) pairs: what the kernel must compute."""
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
