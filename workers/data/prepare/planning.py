"""Planning a prepare: the source's files, each hashed and cut into chunks, and the records a plan
is made of."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUFFIXES = (".txt", ".jsonl", ".parquet")
CHUNK_BYTES = 32 << 20  # a jsonl chunk (one Ray Data row, one shard) is about this large


class PrepareError(ValueError):
    """Bad input to a prepare, with the file (and line) to fix."""


@dataclass(frozen=True)
class Chunk:
    """One unit of tokenization work: a byte range of a jsonl file, a parquet row group, or a whole
    txt file."""

    file_index: int
    part: int
    path: str
    start: int  # byte offset (jsonl), row group (parquet), 0 (txt)
    stop: int  # byte offset (jsonl), row group + 1 (parquet), file size (txt)
    first_line: int  # line number of the first line (jsonl), else 0
    size: int  # bytes of source this chunk covers (progress)


@dataclass
class SourceFile:
    path: str  # absolute
    name: str  # relative to the source root, shown in the manifest
    sha256: str
    size: int
    key: str = ""  # content address of its shards: file hash + tokenizer + format
    chunks: list[Chunk] = field(default_factory=list)


@dataclass(frozen=True)
class Progress:
    """How far a prepare is: bytes of source tokenized, documents and tokens so far."""

    done_bytes: int
    total_bytes: int
    documents: int
    tokens: int
    stage: str  # "hashing" | "tokenizing" | "done" | "unchanged"


ProgressFn = Callable[[Progress], None]


@dataclass
class Plan:
    """What a prepare will produce, known before any tokenizing: the files (hashed, in chunks), the
    tokenizer's record and the dataset id (a content address: the same plan, the same id)."""

    source: str
    tokenizer: str  # "bytes", or the model directory's absolute path
    fmt: str
    text_field: str
    files: list[SourceFile]
    info: dict[str, Any]
    dataset_id: str
    total_bytes: int


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def list_sources(source: str | Path) -> tuple[Path, list[Path]]:
    """(root, files): the file itself, or every .txt/.jsonl/.parquet under a directory in sorted
    path order."""
    root = Path(source)
    if not root.exists():
        raise PrepareError(f"{source}: no such file or directory")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise PrepareError(f"{source}: no .txt, .jsonl or .parquet files in this directory")
        return root, files
    if root.suffix.lower() not in SUFFIXES:
        raise PrepareError(f"{source}: not a .txt, .jsonl or .parquet file")
    return root.parent, [root]


def plan_file(index: int, path: Path, root: Path, chunk_bytes: int) -> SourceFile:
    """Hash a file and cut it into chunks in the same pass (jsonl chunks start at a line)."""
    suffix = path.suffix.lower()
    h = hashlib.sha256()
    chunks: list[Chunk] = []
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if suffix == ".jsonl":
                start, first_line, at, lines_before = 0, 1, 0, 0
                while block := f.read(1 << 20):
                    h.update(block)
                    pos = 0
                    while (want := start + chunk_bytes - 1 - at) < len(block):
                        cut = block.find(b"\n", max(want, pos))
                        if cut < 0:
                            break
                        stop = at + cut + 1
                        chunks.append(
                            Chunk(
                                index, len(chunks), str(path), start, stop, first_line, stop - start
                            )
                        )
                        first_line = lines_before + block.count(b"\n", 0, cut + 1) + 1
                        start, pos = stop, cut + 1
                    lines_before += block.count(b"\n")
                    at += len(block)
                if start < at or not chunks:
                    chunks.append(
                        Chunk(index, len(chunks), str(path), start, at, first_line, at - start)
                    )
            else:
                while block := f.read(1 << 20):
                    h.update(block)
    except OSError as e:
        raise PrepareError(f"{path}: cannot read it ({e.strerror or e})") from e
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            groups = pq.ParquetFile(path).num_row_groups
        except Exception as e:  # pyarrow raises its own error types for a file that is not parquet
            raise PrepareError(f"{path}: not a readable parquet file ({e})") from e
        share = size // max(groups, 1)
        chunks = [Chunk(index, g, str(path), g, g + 1, 0, share) for g in range(groups)]
    elif suffix == ".txt":
        chunks = [Chunk(index, 0, str(path), 0, size, 0, size)]
    return SourceFile(str(path), str(path.relative_to(root)), h.hexdigest(), size, chunks=chunks)
