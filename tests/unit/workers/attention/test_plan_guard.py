"""`_split_causal` against brute force: its pieces cover exactly the pairs j <= i of a query run and a
key run, each once, for every arrangement of the two runs (overlapping, nested, disjoint either way).

The ring-plan tests reach this helper only through the layouts' block shapes, and did not notice when
the rows past the last key lost their first row; here every arrangement is checked directly.
A causal piece is top-left aligned, as the kernels read it: query q0 + a sees key k0 + b iff b <= a.
"""

from __future__ import annotations

import itertools

from workers.attention.plan import _split_causal


def _pairs(pieces: list[tuple[int, int, int, int, bool]]) -> list[tuple[int, int]]:
    out = []
    for q0, q1, k0, k1, causal in pieces:
        assert q0 < q1 and k0 < k1, (q0, q1, k0, k1)
        for i, j in itertools.product(range(q0, q1), range(k0, k1)):
            if not causal or j - k0 <= i - q0:
                out.append((i, j))
    return out


def test_pieces_cover_exactly_the_causal_pairs_once() -> None:
    n = 7
    checked = 0
    for qa, qb, ka, kb in itertools.product(range(n), repeat=4):
        if not (qa < qb and ka < kb):
            continue
        want = sorted((i, j) for i in range(qa, qb) for j in range(ka, kb) if j <= i)  # brute force
        got = _pairs(_split_causal(qa, qb, ka, kb))
        assert sorted(got) == want, (qa, qb, ka, kb)  # duplicates would show as extra pairs
        checked += 1
    assert checked == 21 * 21
