"""Data-parallel balance of packed documents: how unequal replicas' work is, contiguous vs balanced.

    python -m bench.packing [--seq-len 8192] [--batch 32] [--steps 200] [--median 600] [--sigma 1.4]

A synthetic corpus of lognormal document lengths (median `--median` tokens, log-sd `--sigma`; the
long tail is cut into seq_len pieces like the real packers do) is packed next-fit
(`pack.pack_sequences`) in a seeded order into rows of `--seq-len`, `--batch` rows a step. For each
step and data-parallel size (2, 4, 8) the replicas' rows are taken two ways: contiguous blocks (what
`take_shard` did before) and `balance.replica_rows`. Per replica: tokens (nonzero label weights) and
attention work (sum of segment len^2, `balance.row_costs`). Imbalance = max over replicas / mean
over replicas, averaged over steps (and the worst step). A step lasts as long as its slowest
replica, so 1.00 is the ideal. `assign ms/step`: CPU time of `replica_rows` (costs and assignment)
per step, one thread.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from workers.data.balance import replica_rows, row_costs
from workers.data.batch import Batch
from workers.data.pack import pack_sequences


def corpus_lengths(n_docs: int, median: float, sigma: float, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [max(1, int(x)) for x in rng.lognormal(np.log(median), sigma, n_docs)]


def packed_rows(lengths: list[int], seq_len: int, seed: int) -> list[list[int]]:
    """Every row as its piece lengths: documents cut into seq_len pieces, in a seeded order."""
    pieces = [min(seq_len, n - i) for n in lengths for i in range(0, n, seq_len)]
    order = np.random.default_rng(seed + 1).permutation(len(pieces)).tolist()
    return [[pieces[i] for i in row] for row in pack_sequences(pieces, order, seq_len)]


def make_batch(rows: list[list[int]], seq_len: int) -> Batch:
    """The fields `replica_rows` reads (boundaries and label weights) of a batch of packed rows."""
    weights = torch.zeros(len(rows), seq_len)
    cu = [0]
    for r, pieces in enumerate(rows):
        at = 0
        for n in pieces:
            weights[r, at : at + n - 1] = 1.0  # the last token of a document has no label
            at += n
            cu.append(r * seq_len + at)
        if at < seq_len:
            cu.append((r + 1) * seq_len)  # padding: a segment of its own
    zeros = torch.zeros(len(rows), seq_len, dtype=torch.int64)
    return Batch(
        zeros,
        zeros,
        weights,
        torch.arange(seq_len),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
    )


def imbalance(values: list[int], groups: list[list[int]]) -> float:
    loads = [sum(values[r] for r in g) for g in groups]
    return max(loads) / (sum(loads) / len(loads))


def measure(
    seq_len: int, batch: int, steps: int, median: float, sigma: float, seed: int
) -> list[dict[str, float]]:
    mean_len = median * float(np.exp(sigma**2 / 2))
    n_docs = int(steps * batch * seq_len / mean_len * 1.3) + 10
    rows = packed_rows(corpus_lengths(n_docs, median, sigma, seed), seq_len, seed)
    if len(rows) < steps * batch:
        raise SystemExit(f"the corpus packed into {len(rows)} rows, fewer than {steps * batch}")
    batches = [make_batch(rows[s * batch : (s + 1) * batch], seq_len) for s in range(steps)]
    out = []
    for dp in (2, 4, 8):
        if batch % dp:
            continue
        per = batch // dp
        contiguous = [list(range(i * per, (i + 1) * per)) for i in range(dp)]
        acc: dict[str, list[float]] = {k: [] for k in ("tok_c", "tok_b", "att_c", "att_b", "ms")}
        for b in batches:
            tokens, work = row_costs(b)
            t0 = time.process_time()
            groups = replica_rows(b, dp)
            acc["ms"].append((time.process_time() - t0) * 1e3)
            acc["tok_c"].append(imbalance(tokens, contiguous))
            acc["tok_b"].append(imbalance(tokens, groups))
            acc["att_c"].append(imbalance(work, contiguous))
            acc["att_b"].append(imbalance(work, groups))
        row: dict[str, float] = {"dp": dp, "rows_per_replica": per}
        for k, v in acc.items():
            row[k] = float(np.mean(v))
            row[k + "_worst"] = float(np.max(v))
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--median", type=float, default=600.0)
    ap.add_argument("--sigma", type=float, default=1.4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    results = measure(a.seq_len, a.batch, a.steps, a.median, a.sigma, a.seed)
    print(
        f"seq_len {a.seq_len}, global batch {a.batch} rows, {a.steps} steps, document lengths "
        f"lognormal(median {a.median:g}, sigma {a.sigma:g}); imbalance = max/mean over replicas, "
        "mean over steps (worst step)"
    )
    print(
        "| dp | rows/replica | tokens contiguous | tokens balanced "
        "| attention contiguous | attention balanced | assign ms/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        cells = [
            f"{r[k]:.3f} ({r[k + '_worst']:.2f})" for k in ("tok_c", "tok_b", "att_c", "att_b")
        ]
        print(
            f"| {int(r['dp'])} | {int(r['rows_per_replica'])} | "
            + " | ".join(cells)
            + f" | {r['ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
