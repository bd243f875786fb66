"""`data.kind: tokens`: training batches from a prepared dataset, reading only what a step needs.

Split: with `validation` v > 0 every k-th document (k = round(1/v); document i with i % k == k - 1)
is held out, so held-out documents are spread over every file and the split never depends on the
seed or on anything but the document count. Training document j is document j + j // (k - 1). With
`validation` a path, the held-out documents are that prepared dataset's and all of `path` trains.

Order: each epoch visits the training material in an affine permutation i -> (a·i + b) mod n with a
coprime to n, a and b drawn from (seed, epoch). It is a true permutation that costs O(1) memory and
O(1) per lookup, so nothing grows with the corpus.

`pack: documents`: documents in permuted order, longer ones cut into seq_len pieces kept in order,
packed next-fit (a piece that no longer fits closes the sequence; its tail is padding). Sequence g
needs the packing of every sequence before it in its epoch, so the source keeps a cursor (epoch,
document, piece) at the last sequence it produced and at every epoch start it met: going forward is
a scan from the nearest cursor, and a checkpoint stores the cursor so a resume starts without
scanning.

`pack: windows`: the training documents concatenated in index order (a stream), cut into seq_len + 1
windows at stride seq_len; the windows are visited in permuted order. Attention and labels cross
document boundaries here, as in `kind: text` windows.

Loss mask: the weight of the label at position i is the mask of token i + 1 (chat: only assistant
tokens are learned); it rides in `Batch.weights` through sharding, the ring and the loss, whose
global token mean divides by the sum of weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from workers.data.batch import Batch
from workers.data.dataset import DatasetError, PreparedDataset, open_dataset
from workers.data.pack import next_fit
from workers.data.passkey import sample_generator


def holdout_every(validation: float) -> int:
    """k: every k-th document is held out (0: none)."""
    return 0 if validation <= 0 else max(2, round(1 / validation))


def affine(n: int, seed: int, epoch: int) -> tuple[int, int]:
    """(a, b) of the permutation i -> (a·i + b) mod n for this epoch; gcd(a, n) = 1."""
    if n <= 1:
        return 1, 0
    g = sample_generator(seed, epoch)
    a = int(torch.randint(1, n, (1,), generator=g))
    while math.gcd(a, n) != 1:
        a = a % (n - 1) + 1
    return a, int(torch.randint(0, n, (1,), generator=g))


@dataclass(frozen=True)
class Cursor:
    """Where the run's sequence `g` starts: in `epoch`, permuted document `j`, its piece `piece`."""

    g: int
    epoch: int
    j: int
    piece: int


class _Split:
    """Training or held-out documents of a dataset, as their own index space."""

    def __init__(self, ds: PreparedDataset, every: int, held_out: bool) -> None:
        self.ds, self.k, self.held_out = ds, every, held_out
        n = len(ds)
        if every == 0:
            self.n = 0 if held_out else n
        else:
            self.n = n // every if held_out else n - n // every

    def doc(self, j: int) -> int:
        """The dataset index of document j of this split."""
        if self.k == 0:
            return j
        return j * self.k + self.k - 1 if self.held_out else j + j // (self.k - 1)


class TokensSource:
    """Batches from a prepared dataset (`data.kind: tokens`); resumable, with memory O(1) in the
    corpus size."""

    def __init__(
        self,
        path: str | Path | PreparedDataset,
        seq_len: int,
        seed: int,
        pack: str = "documents",
        validation: float | str | Path = 0.0,
        vocab_size: int | None = None,
    ) -> None:
        self.ds = path if isinstance(path, PreparedDataset) else open_dataset(path)
        if vocab_size is not None and self.ds.vocab_size > vocab_size:
            raise ValueError(
                f"data.path {self.ds.path}: its tokenizer has {self.ds.vocab_size} ids, "
                f"more than the model's vocabulary ({vocab_size}); "
                "prepare it with the model's tokenizer"
            )
        self.seq_len, self.seed, self.pack = seq_len, seed, pack
        if isinstance(validation, str | Path):  # a prepared dataset of held-out documents
            self.train, self.val = (
                _Split(self.ds, 0, False),
                _Split(self._held_out(validation), 0, False),
            )
        else:
            every = holdout_every(validation)
            self.train, self.val = _Split(self.ds, every, False), _Split(self.ds, every, True)
        if self.train.n == 0:
            raise ValueError(f"data.path {self.ds.path}: no training documents")
        eos = self.ds.tokenizer.get("eos_id")
        self.pad_id = int(eos) if eos is not None else 0
        self.samples_consumed = 0
        self._cursors: dict[int, Cursor] = {
            0: Cursor(0, 0, 0, 0)
        }  # epoch starts, and the last cursor
        self._last = self._cursors[0]
        self._perm: tuple[int, int, int] = (-1, 1, 0)
        if pack == "windows":
            self._segments = self._stream_segments()
            self.n_windows = (sum(n for _, n in self._segments) - 1) // seq_len
            if self.n_windows < 1:
                raise ValueError(
                    f"data.path {self.ds.path}: fewer training tokens than seq_len + 1"
                )

    def _held_out(self, path: str | Path) -> PreparedDataset:
        try:
            val = open_dataset(path)
        except DatasetError as e:
            raise DatasetError(f"data.validation: not a prepared dataset: {e}") from e
        if val.tokenizer.get("sha256") != self.ds.tokenizer.get("sha256"):
            raise DatasetError(
                f"data.validation {val.path}: prepared with another tokenizer than data.path "
                f"{self.ds.path}; prepare both with the same one"
            )
        return val

    # -- documents ---------------------------------------------------------------------------------
    def _train_doc(self, epoch: int, j: int) -> int:
        if self._perm[0] != epoch:
            self._perm = (epoch, *affine(self.train.n, self.seed, epoch))
        _, a, b = self._perm
        return self.train.doc((a * j + b) % self.train.n)

    def _pieces(self, length: int) -> int:
        return max(1, -(-length // self.seq_len)) if length else 0

    def _walk(self, epoch: int, j: int, piece: int) -> Iterator[tuple[tuple[int, int, int], int]]:
        """The pieces of `epoch` from permuted document j's piece `piece` on, lazily:
        ((document, piece, j), its length)."""
        for jj in range(j, self.train.n):
            doc = self._train_doc(epoch, jj)
            length = self.ds.doc_length(doc)
            for p in range(piece if jj == j else 0, self._pieces(length)):
                yield (doc, p, jj), min(self.seq_len, length - p * self.seq_len)

    def _advance(self, c: Cursor) -> tuple[list[tuple[int, int]], Cursor]:
        """The pieces (document, piece) of sequence c.g, and the cursor of the next sequence:
        next-fit within an epoch (an epoch's last sequence ends with it)."""
        epoch, j, piece = c.epoch, c.j, c.piece
        while True:
            group, closer = next(next_fit(self._walk(epoch, j, piece), self.seq_len), ([], None))
            if group:
                break
            if (j, piece) == (0, 0):
                raise ValueError(f"data.path {self.ds.path}: every training document is empty")
            epoch, j, piece = epoch + 1, 0, 0
            self._cursors.setdefault(epoch, Cursor(c.g, epoch, 0, 0))
        if closer is None:  # the epoch ended with this sequence: the next one starts the next epoch
            epoch, j, piece = epoch + 1, 0, 0
            self._cursors.setdefault(epoch, Cursor(c.g + 1, epoch, 0, 0))
        else:
            _, piece, j = closer
        return [(doc, p) for doc, p, _ in group], Cursor(c.g + 1, epoch, j, piece)

    def _cursor(self, g: int) -> Cursor:
        """The cursor of sequence g: a scan forward from the nearest known one."""
        start = (
            self._last
            if self._last.g <= g
            else max((c for c in self._cursors.values() if c.g <= g), key=lambda c: c.g)
        )
        while start.g < g:
            _, start = self._advance(start)
        return start

    def _packed(
        self, pieces: list[tuple[int, int]], ds: PreparedDataset | None = None
    ) -> tuple[torch.Tensor, ...]:
        ds = ds or self.ds
        s = self.seq_len
        inputs = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        weights = np.zeros(s, dtype=np.float32)
        positions = np.zeros(s, dtype=np.int64)
        bounds, at = [0], 0
        for doc, piece in pieces:
            start, stop = ds.doc_span(doc)
            lo = start + piece * s
            tokens, mask = ds.read(lo, min(stop, lo + s))
            n = len(tokens)
            inputs[at : at + n] = tokens
            labels[at : at + n - 1] = tokens[1:]
            weights[at : at + n - 1] = mask[1:]
            positions[at : at + n] = np.arange(n)
            at += n
            bounds.append(at)
        if at < s:  # padding: a document of its own that nothing learns from
            positions[at:] = np.arange(s - at)
            bounds.append(s)
        return (
            torch.from_numpy(inputs),
            torch.from_numpy(labels),
            torch.from_numpy(weights),
            torch.from_numpy(positions),
            torch.tensor(bounds, dtype=torch.int64),
        )

    def sequence(self, g: int) -> tuple[torch.Tensor, ...]:
        """(inputs, labels, weights, doc_positions, boundaries) of the run's training sequence g."""
        cursor = self._cursor(g)
        pieces, self._last = self._advance(cursor)
        return self._packed(pieces)

    # -- windows -----------------------------------------------------------------------------------
    def _stream_segments(self) -> list[tuple[int, int]]:
        """(start, length) in the dataset's token stream of the runs of training documents between
        held-out ones: the training stream is their concatenation. One entry per held-out
        document."""
        segments, at = [], 0
        for m in range(self.val.n):
            start, stop = self.ds.doc_span(self.val.doc(m))
            segments.append((at, start - at))
            at = stop
        segments.append((at, self.ds.num_tokens - at))
        return segments

    def _read_stream(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, masks, skip = [], [], start
        for seg_start, seg_len in self._segments:
            if length == 0:
                break
            if skip >= seg_len:
                skip -= seg_len
                continue
            take = min(length, seg_len - skip)
            t, m = self.ds.read(seg_start + skip, seg_start + skip + take)
            tokens.append(t)
            masks.append(m)
            length, skip = length - take, 0
        return np.concatenate(tokens), np.concatenate(masks)

    def _window(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        epoch, index = divmod(g, self.n_windows)
        a, b = affine(self.n_windows, self.seed, epoch)
        w = (a * index + b) % self.n_windows
        tokens, mask = self._read_stream(w * self.seq_len, self.seq_len + 1)
        return (
            torch.from_numpy(tokens[:-1].copy()),
            torch.from_numpy(tokens[1:].copy()),
            torch.from_numpy(mask[1:].astype(np.float32)),
        )

    # -- batches -----------------------------------------------------------------------------------
    def global_batch(self, step: int, batch_size: int) -> Batch:
        first = step * batch_size
        self.samples_consumed = first + batch_size
        if self.pack == "windows":
            rows = [self._window(first + i) for i in range(batch_size)]
            return Batch(
                torch.stack([r[0] for r in rows]),
                torch.stack([r[1] for r in rows]),
                torch.stack([r[2] for r in rows]),
                torch.arange(self.seq_len),
            )
        return batch_of([self.sequence(first + i) for i in range(batch_size)], self.seq_len)

    def validation_batches(self, batch_size: int, count: int) -> list[Batch]:
        """`count` batches of held-out sequences (the same every time): held-out documents in order,
        packed (documents) or cut into windows (windows), wrapping around when there are fewer.
        [] without any."""
        if self.val.n == 0:
            return []

        def held_out() -> Iterator[tuple[tuple[int, int], int]]:
            for j in range(self.val.n * 64):  # bounded even when every document is tiny
                doc = self.val.doc(j % self.val.n)
                length = self.val.ds.doc_length(doc)
                for piece in range(self._pieces(length)):
                    yield (doc, piece), min(self.seq_len, length - piece * self.seq_len)

        want = batch_size * count
        packed = islice(next_fit(held_out(), self.seq_len), want)
        seqs = [self._packed(pieces, self.val.ds) for pieces, _ in packed]
        if not seqs:
            return []
        while len(seqs) < want:
            seqs.append(seqs[len(seqs) % max(1, len(seqs))])
        if (
            self.pack == "windows"
        ):  # positions run over the whole window, attention crosses documents
            seqs = [
                (s[0], s[1], s[2], torch.arange(self.seq_len), torch.tensor([0, self.seq_len]))
                for s in seqs
            ]
        return [
            batch_of(seqs[i : i + batch_size], self.seq_len) for i in range(0, want, batch_size)
        ]

    # -- resume ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {
            "kind": "tokens",
            "dataset": self.ds.id,
            "pack": self.pack,
            "seed": self.seed,
            "samples_consumed": self.samples_consumed,
        }
        if self.pack == "documents":
            c = self._cursor(self.samples_consumed)
            state["cursor"] = [c.g, c.epoch, c.j, c.piece]
        return state

    def load_state_dict(self, state: dict) -> None:
        if (
            state.get("kind") != "tokens"
            or state.get("dataset") != self.ds.id
            or state.get("seed") != self.seed
            or state.get("pack") != self.pack
        ):
            raise ValueError(
                "the dataset, seed or packing changed since the checkpoint; "
                "its data position does not apply"
            )
        self.samples_consumed = int(state["samples_consumed"])
        if "cursor" in state:
            g, epoch, j, piece = (int(x) for x in state["cursor"])
            self._last = Cursor(g, epoch, j, piece)


def batch_of(seqs: list[tuple[torch.Tensor, ...]], seq_len: int) -> Batch:
    """Packed sequences (inputs, labels, weights, doc_positions, boundaries) as one batch with
    varlen bounds."""
    cu = [0] + [row * seq_len + int(b) for row, seq in enumerate(seqs) for b in seq[4][1:].tolist()]
    return Batch(
        torch.stack([x[0] for x in seqs]),
        torch.stack([x[1] for x in seqs]),
        torch.stack([x[2] for x in seqs]),
        torch.arange(seq_len),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        doc_positions=torch.stack([x[3] for x in seqs]),
    )
