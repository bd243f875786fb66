"""A prepared dataset, read through memory maps: nothing is loaded that is not asked for.

`open_dataset(DIR)` reads the manifest and the per-shard document counts (one small list per shard);
each shard's `.tokens.npy`, `.offsets.npy` (document starts, documents + 1 entries) and, for chat,
`.mask.npy` are mapped on first use. Document i lives in the shard found by bisecting the cumulative
document counts; a token range of the whole stream (documents concatenated in order) by bisecting
the cumulative token counts. A rank's memory therefore grows with what it reads, not with the
corpus.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1  # of the files below; a reader refuses other versions
MANIFEST = "manifest.json"
SHARDS = "shards"


class DatasetError(ValueError):
    """A directory that is not a (complete, readable) prepared dataset."""


class _Shard:
    def __init__(self, base: Path, chat: bool) -> None:
        self.tokens = np.load(f"{base}.tokens.npy", mmap_mode="r")
        self.offsets = np.load(f"{base}.offsets.npy", mmap_mode="r")
        self.mask = np.load(f"{base}.mask.npy", mmap_mode="r") if chat else None


class PreparedDataset:
    """`len()` documents, `num_tokens`, `ds[i] -> {"tokens", "loss_mask"}`, and stream reads for
    packing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            manifest: dict[str, Any] = json.loads((self.path / MANIFEST).read_text())
        except FileNotFoundError as e:
            raise DatasetError(
                f"{self.path}: not a prepared dataset (no {MANIFEST}); run `ringtrain data prepare`"
            ) from e
        except (OSError, ValueError) as e:
            raise DatasetError(f"{self.path}/{MANIFEST}: unreadable ({e})") from e
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DatasetError(
                f"{self.path}: prepared with format version {manifest.get('format_version')}, "
                f"this ringtrain reads {FORMAT_VERSION}; prepare it again"
            )
        self.manifest = manifest
        self.id: str = manifest["id"]
        self.format: str = manifest["format"]
        self.tokenizer: dict[str, Any] = manifest["tokenizer"]
        self.vocab_size = int(self.tokenizer["vocab_size"])
        shards = [s for f in manifest["files"] for s in f["shards"]]
        self._names = [s["name"] for s in shards]
        self._doc_starts = np.cumsum([0] + [s["documents"] for s in shards]).tolist()
        self._token_starts = np.cumsum([0] + [s["tokens"] for s in shards]).tolist()
        self.num_documents = int(self._doc_starts[-1])
        self.num_tokens = int(self._token_starts[-1])
        self._open: dict[int, _Shard] = {}

    def _shard(self, s: int) -> _Shard:
        shard = self._open.get(s)
        if shard is None:
            try:
                shard = _Shard(self.path / SHARDS / self._names[s], self.format == "chat")
            except (OSError, ValueError) as e:
                raise DatasetError(
                    f"{self.path}: shard {self._names[s]} is missing or damaged ({e})"
                ) from e
            self._open[s] = shard
        return shard

    def __len__(self) -> int:
        return self.num_documents

    def _locate(self, i: int) -> tuple[_Shard, int]:
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} of {self.num_documents}")
        s = bisect.bisect_right(self._doc_starts, i) - 1
        return self._shard(s), i - self._doc_starts[s]

    def doc_span(self, i: int) -> tuple[int, int]:
        """[start, stop) of document i in the whole token stream."""
        s = bisect.bisect_right(self._doc_starts, i) - 1
        shard, local = self._shard(s), i - self._doc_starts[s]
        base = self._token_starts[s]
        return base + int(shard.offsets[local]), base + int(shard.offsets[local + 1])

    def doc_length(self, i: int) -> int:
        start, stop = self.doc_span(i)
        return stop - start

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        shard, local = self._locate(i)
        a, b = int(shard.offsets[local]), int(shard.offsets[local + 1])
        tokens = np.asarray(shard.tokens[a:b], dtype=np.int64)
        mask = (
            np.ones(b - a, dtype=bool)
            if shard.mask is None
            else np.asarray(shard.mask[a:b], dtype=bool)
        )
        return {"tokens": tokens, "loss_mask": mask}

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64, loss_mask bool) of [start, stop) of the whole stream, across shards."""
        tokens = np.empty(stop - start, dtype=np.int64)
        mask = np.ones(stop - start, dtype=bool)
        at = start
        while at < stop:
            s = bisect.bisect_right(self._token_starts, at) - 1
            shard, base = self._shard(s), self._token_starts[s]
            end = min(stop, self._token_starts[s + 1])
            tokens[at - start : end - start] = shard.tokens[at - base : end - base]
            if shard.mask is not None:
                mask[at - start : end - start] = shard.mask[at - base : end - base]
            at = end
        return tokens, mask


def open_dataset(path: str | Path) -> PreparedDataset:
    """A prepared dataset directory (see `workers.data.prepare`), memory-mapped."""
    return PreparedDataset(path)


__all__ = ["DatasetError", "PreparedDataset", "open_dataset"]
