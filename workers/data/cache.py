"""`data.kind: text` through the prepared-dataset cache: tokenized once, read like `kind: tokens`.

The first rank to start on a corpus prepares it (in process: a rank already runs inside Ray or
torchrun, so no nested Ray) into a content-addressed directory of the cache; ranks starting at the
same time wait on a lock and then open it; later starts, of this job or any other on the same
corpus and tokenizer, tokenize nothing. Every rank reads through `TokensSource` (memory maps), so
its memory does not grow with the corpus.

Root: `$RINGTRAIN_DATA_CACHE`; else `.data-cache` beside the job directories of the checkpoint
root (`$RINGTRAIN_CHECKPOINT_DIR/..`, set for ranks the control plane starts, on storage every
node sees); else `$XDG_CACHE_HOME/ringtrain/datasets` (`~/.cache/...`), one per node.

Layout: `<root>/<dataset id>/` is a prepared dataset (`workers.data.prepare`); its id hashes the
source files' sha256, the tokenizer's hash, the format and the text field, so equal inputs share
one directory, and a directory never changes once written (a running job keeps its version).
`<root>/index/<source key>.json` (key: resolved source path, tokenizer, text field) names the
dataset last made from that source, with the files' (path, size, mtime) and the tokenizer hash:
while they match, a start opens the dataset without reading the corpus. Otherwise the files are
hashed again: a touched but unchanged corpus has the same id (nothing tokenized), a changed one is
prepared under a new id with unchanged files' shards hard-linked from the last. Old versions stay
until deleted by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from workers.data.dataset import FORMAT_VERSION, PreparedDataset, open_dataset
from workers.data.prepare import (
    BYTES,
    PrepareError,
    exclusive,
    list_sources,
    plan_dataset,
    prepare,
    read_manifest,
    tokenizer_hash,
)
from workers.data.tokens import TokensSource

INDEX = "index"
FORMAT = "text"  # kind: text corpora are plain text documents (chat sets go through `data prepare`)


def cache_root() -> Path:
    """Where prepared `kind: text` corpora live (see the module docstring)."""
    if root := os.environ.get("RINGTRAIN_DATA_CACHE"):
        return Path(root).expanduser()
    if job := os.environ.get("RINGTRAIN_CHECKPOINT_DIR"):
        return Path(job).expanduser().resolve().parent / ".data-cache"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ringtrain" / "datasets"


def _fingerprint(source: Path, tokenizer: str) -> dict[str, Any]:
    """What must be unchanged for the last prepared version to still be this source's."""
    _, files = list_sources(source)
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return {"files": stats, "tokenizer": tokenizer_hash(tokenizer)}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Atomically: a reader sees the old entry or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _usable(root: Path, entry: dict[str, Any] | None, fingerprint: dict[str, Any]) -> Path | None:
    if entry is None or entry.get("fingerprint") != fingerprint or "dataset" not in entry:
        return None
    out = root / str(entry["dataset"])
    manifest = read_manifest(out)
    return out if manifest is not None and manifest.get("id") == entry["dataset"] else None


def cached_dataset(
    source: str | Path,
    tokenizer: str = BYTES,
    text_field: str = "text",
    root: str | Path | None = None,
) -> PreparedDataset:
    """The prepared dataset of a text corpus, preparing it first when no valid one is cached."""
    src = Path(source)
    if tokenizer != BYTES:
        tokenizer = str(Path(tokenizer).resolve())
    base = Path(root) if root is not None else cache_root()
    key = hashlib.sha256(
        json.dumps(
            [FORMAT_VERSION, str(src.resolve()), tokenizer, FORMAT, text_field], sort_keys=True
        ).encode()
    ).hexdigest()[:24]
    index = base / INDEX / f"{key}.json"
    fingerprint = _fingerprint(src, tokenizer)
    if (hit := _usable(base, _read_json(index), fingerprint)) is not None:
        return open_dataset(hit)
    try:
        return _prepare_once(src, tokenizer, text_field, base, index, key)
    except PrepareError:
        raise
    except OSError as e:  # PermissionError, a full disk, ...: name the cache and how to move it
        raise PrepareError(
            f"data.path {src}: cannot prepare it into the data cache {base} ({e}); "
            "set RINGTRAIN_DATA_CACHE to a writable directory"
        ) from e


def _prepare_once(
    src: Path, tokenizer: str, text_field: str, base: Path, index: Path, key: str
) -> PreparedDataset:
    """Under the source's lock: the dataset another rank just made, or prepare it here."""
    waited_since = time.time()
    with exclusive(base / INDEX / f".{key}.lock"):  # one rank prepares, the others wait for it
        entry = _read_json(index)
        fingerprint = _fingerprint(src, tokenizer)  # what the lock holder before us may have seen
        if (hit := _usable(base, entry, fingerprint)) is not None:
            return open_dataset(hit)
        if (
            entry
            and entry.get("error")
            and entry.get("fingerprint") == fingerprint
            and float(entry.get("time", 0)) >= waited_since  # the rank we waited for just failed
        ):
            raise PrepareError(str(entry["error"]))
        planned = plan_dataset(src, tokenizer=tokenizer, fmt=FORMAT, text_field=text_field)
        out = base / planned.dataset_id
        last = (entry or {}).get("dataset") or (entry or {}).get("previous")
        previous = base / str(last) if last else None  # unchanged files' shards come from it
        started = time.monotonic()
        if read_manifest(out) is None:
            print(
                f"ringtrain: data.path {src}: tokenizing it once into {out} "
                f"({planned.total_bytes / 1e6:.1f} MB; later starts reuse it)",
                file=sys.stderr,
                flush=True,
            )
        try:
            manifest = prepare(src, out, inline=True, planned=planned, reuse_from=previous)
        except PrepareError as e:  # ranks waiting for this one raise it too, without trying again
            failed = {"error": str(e), "fingerprint": fingerprint, "time": time.time()}
            _write_json(index, {**failed, "previous": previous.name if previous else None})
            raise
        _write_json(
            index,
            {
                "dataset": manifest["id"],
                "source": str(src.resolve()),
                "fingerprint": fingerprint,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return open_dataset(out)


class CachedTextSource(TokensSource):
    """`kind: text` batches: a `TokensSource` over the corpus's cached prepared dataset. Its
    checkpoint state keeps the kind's own name (`text`, `text-documents`) and the dataset id, so
    a resume onto another corpus, seed or packing is refused."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        seed: int,
        pack: str,
        text_field: str = "text",
        tokenizer: str = BYTES,
        vocab_size: int | None = None,
    ) -> None:
        self.corpus = str(path)
        self.kind = "text" if pack == "windows" else "text-documents"
        ds = cached_dataset(path, tokenizer, text_field)
        try:
            super().__init__(ds, seq_len, seed, pack, 0.0, vocab_size=vocab_size)
        except ValueError as e:  # name the corpus, not only the cache directory
            raise ValueError(str(e).replace(str(ds.path), f"{path} (prepared in {ds.path})")) from e

    def state_dict(self) -> dict:
        return {**super().state_dict(), "kind": self.kind}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind or "dataset" not in state:
            raise ValueError(
                f"the checkpoint's data position is not one of a {self.kind!r} source over "
                f"prepared {self.corpus} (written by another data kind or packing, or by the "
                "in-memory text reader of an earlier ringtrain); it does not apply"
            )
        super().load_state_dict({**state, "kind": "tokens"})


__all__ = ["CachedTextSource", "cache_root", "cached_dataset"]
