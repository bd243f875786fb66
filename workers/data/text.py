"""Local text corpora (.txt, .jsonl, .parquet) packed into seq_len + 1 windows.

The corpus is tokenized once with the job's tokenizer (bytes for native models, the model's own for
pretrained ones; documents joined by the tokenizer's `eos_id`) into one flat array and cut into
non-overlapping windows of seq_len + 1 tokens (consecutive windows share no labels). Each epoch visits
the windows in a permutation drawn from (seed, epoch), so sample g of the run — g = step · batch + i —
is a pure function of (corpus, seed, g): the position is just the number of samples consumed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from workers.data.batch import Batch, from_windows
from workers.data.passkey import sample_generator
from workers.data.tokenizer import ByteTokenizer, Tokenizer

DOC_SEPARATOR = 0  # NUL byte between documents (ByteTokenizer's eos_id)


def _documents(path: Path, text_field: str) -> list[bytes]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        docs = []
        with path.open("rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if text_field not in row:
                        raise ValueError(f"{path}:{n}: no field {text_field!r}")
                    docs.append(str(row[text_field]).encode("utf-8"))
        return docs
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - pyarrow is an optional extra
            raise ValueError(
                "reading .parquet needs pyarrow (pip install 'ringtrain[parquet]')"
            ) from e
        column = pq.read_table(path, columns=[text_field]).column(text_field)
        return [str(v).encode("utf-8") for v in column.to_pylist() if v is not None]
    return [path.read_bytes()]  # .txt and anything else: raw bytes


def read_documents(path: str | Path, text_field: str = "text") -> list[bytes]:
    """The raw documents of a file, or of every .txt/.jsonl/.parquet under a directory (sorted)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} does not exist")
    files = (
        sorted(p for p in path.rglob("*") if p.suffix.lower() in (".txt", ".jsonl", ".parquet"))
        if path.is_dir()
        else [path]
    )
    return [d for f in files for d in _documents(f, text_field)]


def load_corpus(
    path: str | Path, text_field: str = "text", tokenizer: Tokenizer | None = None
) -> np.ndarray:
    """One flat token array for a file, or for every .txt/.jsonl/.parquet in a directory (sorted).

    Bytes (uint8) without a tokenizer or with ByteTokenizer; otherwise int32 ids of `tokenizer`.
    """
    docs = read_documents(path, text_field)
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        joined = bytes([DOC_SEPARATOR]).join(docs)
        return np.frombuffer(joined, dtype=np.uint8)
    separator = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    ids: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            ids.extend(separator)
        ids.extend(tokenizer.encode(doc.decode("utf-8", errors="replace")))
    return np.asarray(ids, dtype=np.int32)


class TextSource:
    """Batches of packed windows in a seeded per-epoch order; resumable by sample count."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        seed: int,
        text_field: str = "text",
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.tokens = load_corpus(path, text_field, tokenizer)
        self.seq_len, self.seed = seq_len, seed
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(
                f"corpus {path} has {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}"
            )
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)
        self.samples_consumed = 0

    def _window(self, g: int) -> torch.Tensor:
        epoch, index = divmod(g, self.n_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = torch.randperm(
                self.n_windows, generator=sample_generator(self.seed, epoch)
            )
        start = int(self._order[index]) * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def global_batch(self, step: int, batch_size: int) -> Batch:
        first = step * batch_size
        windows = torch.stack([self._window(first + i) for i in range(batch_size)])
        self.samples_consumed = first + batch_size
        return from_windows(windows)

    def state_dict(self) -> dict:
        return {
            "kind": "text",
            "seed": self.seed,
            "samples_consumed": self.samples_consumed,
            "n_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("n_tokens") != len(self.tokens) or state.get("seed") != self.seed:
            raise ValueError(
                "the corpus or seed changed since the checkpoint; its data position does not apply"
            )
        self.samples_consumed = int(state["samples_consumed"])
