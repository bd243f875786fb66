"""`data.pack: documents`: whole documents packed into each sequence, attention kept inside documents.

Each document is tokenized on its own and closed with the tokenizer's `eos_id` (when it has one); a
document longer than seq_len is cut into seq_len pieces, each then a document of its own. Each epoch
visits the pieces in a permutation drawn from (seed, epoch) and packs them next-fit: a piece that no
longer fits closes the sequence, whose tail is padding (a document of its own, weight 0). So sequence g
of the run is a pure function of (corpus, tokenizer, seed, g), whatever the layout.

Per sequence: `inputs` [S]; `labels[i] = inputs[i + 1]` only inside a document (the last token of every
document and the padding have weight 0: no label crosses a boundary); `doc_positions` restart at 0 in
every document (RoPE); `cu_seqlens` are the boundaries [0, …, S] that ring attention restricts to.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workers.data.batch import Batch
from workers.data.passkey import sample_generator
from workers.data.text import read_documents
from workers.data.tokenizer import ByteTokenizer, Tokenizer


def load_documents(path: str | Path, text_field: str, tokenizer: Tokenizer) -> list[np.ndarray]:
    """Every document of a file (or of every .txt/.jsonl/.parquet under a directory, sorted), tokenized,
    each closed by eos."""
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    docs = []
    for raw in read_documents(path, text_field):
        ids = tokenizer.encode(raw.decode("utf-8", errors="replace")) + eos
        if ids:
            docs.append(np.asarray(ids, dtype=np.int64))
    return docs


def pack_sequences(lengths: list[int], order: list[int], seq_len: int) -> list[list[int]]:
    """Next-fit packing of pieces (all <= seq_len) visited in `order`: lists of piece indices per sequence."""
    packs: list[list[int]] = []
    used = seq_len  # forces a new sequence for the first piece
    for i in order:
        if used + lengths[i] > seq_len:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += lengths[i]
    return packs


class PackedTextSource:
    """Batches of whole packed documents with `cu_seqlens`; resumable by sample count."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        seed: int,
        text_field: str = "text",
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 to pack documents, got {seq_len}")
        tokenizer = tokenizer or ByteTokenizer()
        docs = load_documents(path, text_field, tokenizer)
        self.pieces = [d[i : i + seq_len] for d in docs for i in range(0, len(d), seq_len)]
        if not self.pieces:
            raise ValueError(f"corpus {path} holds no documents")
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.seq_len, self.seed = seq_len, seed
        self.n_tokens = sum(len(p) for p in self.pieces)
        self._epochs: list[list[list[int]]] = []  # the packing of each epoch computed so far
        self.samples_consumed = 0

    def _epoch(self, epoch: int) -> list[list[int]]:
        while len(self._epochs) <= epoch:
            e = len(self._epochs)
            order = torch.randperm(
                len(self.pieces), generator=sample_generator(self.seed, e)
            ).tolist()
            self._epochs.append(pack_sequences([len(p) for p in self.pieces], order, self.seq_len))
        return self._epochs[epoch]

    def _locate(self, g: int) -> list[int]:
        epoch = 0
        while g >= len(self._epoch(epoch)):
            g -= len(self._epoch(epoch))
            epoch += 1
        return self._epoch(epoch)[g]

    def sequence(
        self, g: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """(inputs, labels, weights, doc_positions, boundaries) of sequence g of the run."""
        s = self.seq_len
        inputs = torch.full((s,), self.pad_id, dtype=torch.int64)
        labels = torch.full((s,), self.pad_id, dtype=torch.int64)
        weights = torch.zeros(s, dtype=torch.float32)
        positions = torch.zeros(s, dtype=torch.int64)
        bounds, at = [0], 0
        for i in self._locate(g):
            piece = torch.from_numpy(self.pieces[i])
            n = len(piece)
            inputs[at : at + n] = piece
            labels[at : at + n - 1] = piece[1:]
            weights[at : at + n - 1] = 1.0
            positions[at : at + n] = torch.arange(n)
            at += n
            bounds.append(at)
        if at < s:  # padding: a document of its own that nothing learns from
            positions[at:] = torch.arange(s - at)
            bounds.append(s)
        return inputs, labels, weights, positions, bounds

    def global_batch(self, step: int, batch_size: int) -> Batch:
        first = step * batch_size
        seqs = [self.sequence(first + i) for i in range(batch_size)]
        self.samples_consumed = first + batch_size
        cu = [0] + [row * self.seq_len + b for row, seq in enumerate(seqs) for b in seq[4][1:]]
        return Batch(
            torch.stack([x[0] for x in seqs]),
            torch.stack([x[1] for x in seqs]),
            torch.stack([x[2] for x in seqs]),
            torch.arange(self.seq_len),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            doc_positions=torch.stack([x[3] for x in seqs]),
        )

    def state_dict(self) -> dict:
        return {
            "kind": "text-documents",
            "seed": self.seed,
            "samples_consumed": self.samples_consumed,
            "n_tokens": self.n_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        if (
            state.get("kind") != "text-documents"
            or state.get("n_tokens") != self.n_tokens
            or state.get("seed") != self.seed
        ):
            raise ValueError(
                "the corpus, seed or packing changed since the checkpoint; its data position does not apply"
            )
        self.samples_consumed = int(state["samples_consumed"])
