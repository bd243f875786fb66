"""Next-fit packing, the rule of `data.pack: documents`: pieces (documents cut into seq_len pieces)
are visited in order and a piece that no longer fits closes the sequence, whose tail is padding.

`next_fit` is the rule, once, over any lazy stream of (piece, length): `TokensSource`
(workers/data/tokens.py) packs its training sequences (one at a time, from a cursor) and its
held-out sequences with it; `pack_sequences` is the same rule on piece lengths alone, for synthetic
packings (`bench/packing.py`, tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def next_fit(pieces: Iterable[tuple[T, int]], seq_len: int) -> Iterator[tuple[list[T], T | None]]:
    """Next-fit packing of `(piece, length)` (lengths <= seq_len) in order, lazily: each sequence's
    pieces, with the piece that closed it (the first of the next sequence; None for the last one,
    which ends with the stream). The stream is read only up to that closing piece, so a caller that
    takes one sequence knows where the next starts without reading further."""
    group: list[T] = []
    used = 0
    for piece, n in pieces:
        if group and used + n > seq_len:
            yield group, piece
            group, used = [], 0
        group.append(piece)
        used += n
    if group:
        yield group, None


def pack_sequences(lengths: list[int], order: list[int], seq_len: int) -> list[list[int]]:
    """Next-fit packing of pieces (all <= seq_len) visited in `order`: lists of piece indices per
    sequence."""
    return [group for group, _ in next_fit(((i, lengths[i]) for i in order), seq_len)]
