"""Which rows of a step's global batch each data-parallel replica trains on.

Packed documents (`pack: documents`) make rows unequal: every row is seq_len positions, but one row
may hold a single long document and its neighbour forty short ones and padding. Under causal
masking the attention work of a row is ~ the sum over its documents of len^2 (the varlen kernel
computes every segment of `cu_seqlens`, padding included: it is a document of its own), and the
tokens a row adds to the loss (its nonzero label weights) vary with padding and loss masks.
Replicas wait for each other at every gradient reduce, so a step lasts as long as its slowest
replica: contiguous blocks of rows, as drawn, can leave one replica with much more work.

`replica_rows` is the one place that decides. It assigns rows so that replicas get similar work,
with the same number of rows each (the batch shapes, and so the memory, stay the same everywhere):

- a row's load is two numbers, its share of the batch's tokens (tokens_r / T) and of its attention
  work (attn_r / A); a replica's score is the larger of its summed shares, and the assignment keeps
  the highest score low. (One summed cost balances the sum, not each: replicas came out with high
  tokens and low attention, or the reverse.) Shares are exact integers (tokens_r * A, attn_r * T),
  so every rank of every replica computes the same assignment bit for bit;
- greedy longest-processing-time: rows by decreasing tokens_r / T + attn_r / A (ties: lower row
  first) each go to the replica, among those not yet full, whose score grows least (ties: lower
  summed load, then lower replica), then the best swap of a row of the top-scoring replica with a
  row of another while one lowers both below the top score (within a fixed search budget); each
  replica's rows are kept in increasing row order.

It is a function of the global batch only (never of the rank, the layout or anything else), so the
global batch of a step still depends only on (data spec, seed, step), and the loss, a global token
mean over all rows, is the same sum taken in another order: the math does not change. Batches
without document boundaries (windows, passkey) have equal rows and keep contiguous blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # batch.py's take_shard imports this module
    from workers.data.batch import Batch

# Row pairs the swap search may look at per batch: a few ms of CPU per step, and a count, not a
# clock, so the result stays deterministic.
SWAP_BUDGET = 200_000


def row_costs(batch: Batch) -> tuple[list[int], list[int]]:
    """(tokens, attention work) of every row: nonzero label weights, and the sum of len^2 over the
    row's segments of `cu_seqlens` (one segment of seq_len per row without boundaries)."""
    rows, seq_len = batch.inputs.shape
    tokens = (batch.weights != 0).sum(dim=1).tolist()
    if batch.cu_seqlens is None:
        return tokens, [seq_len * seq_len] * rows
    cu = batch.cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    owner = torch.clamp(cu[:-1] // seq_len, max=rows - 1)
    work = torch.zeros(rows, dtype=torch.int64).index_add_(0, owner, lengths * lengths)
    return [int(t) for t in tokens], [int(w) for w in work.tolist()]


def assign_rows(tokens: list[int], attention: list[int], dp_size: int) -> list[list[int]]:
    """Rows per replica (each in increasing order, len(tokens) / dp_size each) that keep the larger
    of each replica's token share and attention share low (see the module docstring). A permutation
    of range(len(tokens)); deterministic."""
    rows = len(tokens)
    if len(attention) != rows:
        raise ValueError(f"{rows} token counts but {len(attention)} attention costs")
    if dp_size < 1 or rows % dp_size:
        raise ValueError(f"global batch of {rows} is not divisible by data_parallel={dp_size}")
    if dp_size == 1:
        return [list(range(rows))]
    per = rows // dp_size
    # shares scaled by T * A: tokens_r / T -> tokens_r * A, attention_r / A -> attention_r * T
    total_t, total_a = max(1, sum(tokens)), max(1, sum(attention))
    tok = [t * total_a for t in tokens]
    att = [a * total_t for a in attention]
    loads = _Loads([[] for _ in range(dp_size)], [0] * dp_size, [0] * dp_size)
    for r in sorted(range(rows), key=lambda r: (-(tok[r] + att[r]), r)):
        open_ = [k for k in range(dp_size) if len(loads.groups[k]) < per]
        j = min(
            open_,
            key=lambda k: (
                max(loads.tok[k] + tok[r], loads.att[k] + att[r]),
                loads.tok[k] + loads.att[k],
                k,
            ),
        )
        loads.add(j, r, tok[r], att[r])
    budget = SWAP_BUDGET
    while budget > 0 and loads.swap_once(tok, att):
        budget -= rows * per  # the pairs one search looks at
    return [sorted(g) for g in loads.groups]


class _Loads:
    """Each replica's rows and its summed (scaled) token and attention shares."""

    def __init__(self, groups: list[list[int]], tok: list[int], att: list[int]) -> None:
        self.groups, self.tok, self.att = groups, tok, att

    def add(self, j: int, r: int, t: int, a: int) -> None:
        self.groups[j].append(r)
        self.tok[j] += t
        self.att[j] += a

    def score(self, k: int) -> int:
        return max(self.tok[k], self.att[k])

    def swap_once(self, tok: list[int], att: list[int]) -> bool:
        """Make the best swap of a row of the replica with the highest score with a row of another
        replica that brings both below that score; False when there is none."""
        n = len(self.groups)
        top = max(range(n), key=lambda k: (self.score(k), -k))
        limit = self.score(top)
        best: tuple[int, int, int, int] | None = None  # (new max of the pair, replica, x at, y at)
        for k in range(n):
            if k == top:
                continue
            for xi, x in enumerate(self.groups[top]):
                for yi, y in enumerate(self.groups[k]):
                    dt, da = tok[x] - tok[y], att[x] - att[y]
                    pair = max(
                        self.tok[top] - dt, self.att[top] - da, self.tok[k] + dt, self.att[k] + da
                    )
                    if pair < limit and (best is None or pair < best[0]):
                        best = (pair, k, xi, yi)
        if best is None:
            return False
        _, k, xi, yi = best
        x, y = self.groups[top][xi], self.groups[k][yi]
        self.groups[top][xi], self.groups[k][yi] = y, x
        dt, da = tok[x] - tok[y], att[x] - att[y]
        self.tok[top] -= dt
        self.att[top] -= da
        self.tok[k] += dt
        self.att[k] += da
        return True


def replica_rows(batch: Batch, dp_size: int) -> list[list[int]]:
    """The rows of `batch` each data-parallel replica trains on: balanced for packed documents (a
    batch with `cu_seqlens`), contiguous blocks otherwise. The module docstring says why and how."""
    rows = batch.inputs.shape[0]
    if dp_size < 1 or rows % dp_size:
        raise ValueError(f"global batch of {rows} is not divisible by data_parallel={dp_size}")
    per = rows // dp_size
    if batch.cu_seqlens is None or dp_size == 1:
        return [list(range(i * per, (i + 1) * per)) for i in range(dp_size)]
    return assign_rows(*row_costs(batch), dp_size)
