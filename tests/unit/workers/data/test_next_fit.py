"""Next-fit packing is written once (`workers.data.pack.next_fit`) and `TokensSource` packs by it.

The reference is the rule in its plainest form, written separately here: fill a sequence while the
next piece fits, then start the next one. It is compared with `next_fit` on seeded random lengths,
and with the sequences a `TokensSource` makes of a small prepared dataset (training epoch and
held-out batches).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.workers.data.test_tokens_data import SEQ, text_dataset
from workers.data import TokensSource, open_dataset
from workers.data.pack import next_fit, pack_sequences


def reference(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Indices of each sequence: take pieces while their total stays within seq_len."""
    out, i = [], 0
    while i < len(lengths):
        start, total = i, 0
        while i < len(lengths) and (i == start or total + lengths[i] <= seq_len):
            total += lengths[i]
            i += 1
        out.append(list(range(start, i)))
    return out


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_next_fit_equals_the_reference_on_seeded_random_lengths(seq_len: int) -> None:
    for seed in range(30):
        rng = random.Random(seed)
        lengths = [rng.randint(1, seq_len) for _ in range(rng.randint(0, 80))]
        want = reference(lengths, seq_len)
        got = list(next_fit(((i, n) for i, n in enumerate(lengths)), seq_len))
        assert [g for g, _ in got] == want, (seed, lengths)
        # each sequence is closed by the first piece of the next one; the last by the stream's end
        assert [c for _, c in got] == [nxt[0] for nxt in want[1:]] + [None] * bool(want)
        assert pack_sequences(lengths, list(range(len(lengths))), seq_len) == want
        order = rng.sample(range(len(lengths)), len(lengths))
        packed = pack_sequences(lengths, order, seq_len)
        assert packed == [
            [order[i] for i in g] for g in reference([lengths[i] for i in order], seq_len)
        ]


def test_next_fit_reads_the_stream_only_up_to_the_closing_piece() -> None:
    """A caller taking one sequence (`TokensSource._advance`) reads no piece past its closer."""
    read: list[int] = []

    def pieces() -> Iterator[tuple[int, int]]:
        for i in itertools.count():
            read.append(i)
            yield i, 3

    group, closer = next(next_fit(pieces(), 10))
    assert (group, closer, read) == ([0, 1, 2], 3, [0, 1, 2, 3])


def test_tokens_source_packs_by_the_reference(tmp_path: Path) -> None:
    """Training sequences of epoch 0 are the reference packing of the epoch's pieces in visit order
    (the next sequence starts in epoch 1); held-out batches are the reference packing of the
    held-out documents' pieces in order, boundaries and padding included."""
    ds = open_dataset(text_dataset(tmp_path))
    src = TokensSource(ds, SEQ, seed=3, pack="documents", validation=0.1)

    def pieces_of(doc: int) -> list[tuple[tuple[int, int], int]]:
        n = ds.doc_length(doc)
        return [((doc, p), min(SEQ, n - p * SEQ)) for p in range(-(-n // SEQ))]

    visit = [pc for j in range(src.train.n) for pc in pieces_of(src._train_doc(0, j))]
    want = [[visit[i][0] for i in g] for g in reference([n for _, n in visit], SEQ)]
    cursor, got = src._cursor(0), []
    while cursor.epoch == 0 and len(got) <= len(want):  # bounded: a cursor that steps back
        seq, cursor = src._advance(cursor)
        got.append(seq)
    assert got == want and len(want) > 3 and cursor.j == cursor.piece == 0

    batch_size, count = 2, 20  # more sequences than the held-out documents fill once
    held = [pc for m in range(src.val.n * 64) for pc in pieces_of(src.val.doc(m % src.val.n))]
    groups = reference([n for _, n in held], SEQ)[: batch_size * count]
    assert len(groups) == batch_size * count
    for b, batch in enumerate(src.validation_batches(batch_size, count)):
        cu = [0]
        for row, g in enumerate(groups[b * batch_size : (b + 1) * batch_size]):
            ends = list(itertools.accumulate(held[i][1] for i in g))
            cu += [row * SEQ + e for e in ends + [SEQ] * (ends[-1] < SEQ)]
        assert batch.cu_seqlens.tolist() == cu, b
