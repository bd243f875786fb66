"""Prepare a corpus once: tokenized into memory-mapped shards, an index and a manifest.

`python -m workers.data.prepare SOURCE --tokenizer (MODEL_DIR | bytes) --out DIR [--format text | chat]
[--text-field text] [--ray-address ADDR]`

Plan (this process): list the source files (a file, or every .txt/.jsonl/.parquet under a directory in
sorted path order), hash each one while cutting it into chunks (jsonl: line-aligned byte ranges that know
their first line number; parquet: row groups; txt: the whole file, one document), hash the tokenizer.
The dataset id is a hash of all of that, so preparing the same source with the same tokenizer again is a
no-op, and only files whose hash changed are tokenized again (the others' shards are hard-linked over).

Tokenize (the Ray cluster): one Ray Data row per chunk, mapped in parallel; each task writes its chunk's
shard (`<file key>-<part>.tokens.npy`, `.offsets.npy` and for chat `.mask.npy`) into a staging directory
beside DIR and returns its counts, or the error with file and line. The manifest is written last and the
staging directory renamed into place (the previous version is renamed aside first and deleted after), so
DIR is either the old dataset or the new one, never half of one; a prepare that died is cleaned up by the
next one. Prepares into one DIR take turns on a lock beside it (`.<name>.lock`, fcntl, deleted
when done): a second one waits, then finds the work done. DIR must be on a file system every Ray
node sees (like the checkpoint directory). `--in-process` tokenizes in this process (no Ray).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workers.data.dataset import FORMAT_VERSION, MANIFEST, SHARDS

SUFFIXES = (".txt", ".jsonl", ".parquet")
CHUNK_BYTES = 32 << 20  # a jsonl chunk (one Ray Data row, one shard) is about this large
ENCODE_BATCH = 256  # text documents per call of the tokenizer
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
BYTES = "bytes"


class PrepareError(ValueError):
    """Bad input to a prepare, with the file (and line) to fix."""


@dataclass(frozen=True)
class Chunk:
    """One unit of tokenization work: a byte range of a jsonl file, a parquet row group, or a whole txt file."""

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


# -- tokenizers ------------------------------------------------------------------------------------------------
def tokenizer_hash(tokenizer: str) -> str:
    """`bytes`, or the hash of a model directory's files other than weights (tokenizer and chat template)."""
    if tokenizer == BYTES:
        return hashlib.sha256(b"ringtrain-bytes-v1").hexdigest()
    root = Path(tokenizer)
    if not root.is_dir():
        raise PrepareError(f"--tokenizer {tokenizer}: not a model directory (or 'bytes')")
    h = hashlib.sha256()
    for p in sorted(root.iterdir()):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES):
            h.update(p.name.encode() + b"\0" + _file_sha256(p).encode() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(path: str) -> Any:
    # one thread per task: Ray runs as many tasks as the cluster has CPUs for, the tokenizer must not add more
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenizer_info(tokenizer: str, fmt: str) -> dict[str, Any]:
    """What the manifest records about the tokenizer; refuses chat without a chat template."""
    if tokenizer == BYTES:
        if fmt == "chat":
            raise PrepareError(
                "--format chat needs a model directory with a chat template, not the bytes tokenizer"
            )
        return {
            "kind": BYTES,
            "path": None,
            "sha256": tokenizer_hash(BYTES),
            "vocab_size": 256,
            "eos_id": 0,
        }
    sha = tokenizer_hash(tokenizer)
    try:
        tok = _hf_tokenizer(str(Path(tokenizer).resolve()))
    except Exception as e:  # transformers raises several kinds for a directory without a tokenizer
        raise PrepareError(f"--tokenizer {tokenizer}: cannot load a tokenizer from it ({e})") from e
    if fmt == "chat" and not getattr(tok, "chat_template", None):
        raise PrepareError(
            f"--tokenizer {tokenizer}: the tokenizer has no chat template, needed by --format chat"
        )
    template = tok.chat_template if fmt == "chat" else None
    mask_rule = None
    if template is not None:
        mask_rule = "generation" if GENERATION_TAG.search(str(template)) else "prefixes"
    return {
        "kind": "hf",
        "path": str(Path(tokenizer).resolve()),
        "sha256": sha,
        "vocab_size": len(tok),
        "eos_id": tok.eos_token_id,
        "mask_rule": mask_rule,
    }


def encode_text(tokenizer: str, text: str) -> list[int]:
    """A text document: the tokenizer's own encoding (with whatever special tokens it adds), then eos once."""
    return encode_texts(tokenizer, [text])[0]


def encode_texts(tokenizer: str, texts: list[str]) -> list[Any]:
    """`encode_text` of each text, in one batch call of the tokenizer (arrays for bytes, lists otherwise)."""
    if tokenizer == BYTES:
        return [np.frombuffer(t.encode("utf-8") + b"\0", dtype=np.uint8) for t in texts]
    if not texts:
        return []
    tok = _hf_tokenizer(tokenizer)
    eos = tok.eos_token_id
    out = []
    for ids in tok(texts, add_special_tokens=True)["input_ids"]:
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        out.append(ids)
    return out


def encode_chat(tokenizer: str, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
    """A conversation through the model's chat template, and which tokens are the assistant's.

    Templates that mark generation (`{% generation %}`) give the mask themselves (transformers'
    `return_assistant_tokens_mask`). Otherwise assistant turn k is the text between the render of turns
    [0, k) with the generation prompt and the render of turns [0, k] (trailing whitespace excluded: it is
    the template's formatting), both prefixes of the whole render; a token is the assistant's when its
    characters overlap that text (transformers maps generation spans to tokens the same way).
    """
    tok = _hf_tokenizer(tokenizer)
    if GENERATION_TAG.search(str(tok.chat_template)):
        out = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    text = _render(tok, messages, add_generation_prompt=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [False] * len(ids)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tok, messages[:k], add_generation_prompt=True)
        through = _render(tok, messages[: k + 1], add_generation_prompt=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise PrepareError(
                "the chat template does not render a conversation's prefixes as prefixes of the whole; "
                "wrap assistant content in {% generation %}...{% endgeneration %} to mark it"
            )
        start, stop = len(before), len(through.rstrip())
        for j, (a, b) in enumerate(spans):
            if a < stop and b > start:
                mask[j] = True
    return ids, mask


def _render(tok: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
    return str(
        tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    )


# -- planning --------------------------------------------------------------------------------------------------
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def list_sources(source: str | Path) -> tuple[Path, list[Path]]:
    """(root, files): the file itself, or every .txt/.jsonl/.parquet under a directory in sorted path order."""
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


# -- tokenizing one chunk (runs in a Ray task) ------------------------------------------------------------------
def _documents(chunk: Chunk, fmt: str, text_field: str) -> Iterator[tuple[int, Any]]:
    """(line, document) of a chunk: a text string, or a list of chat messages."""
    path = Path(chunk.path)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield 0, path.read_bytes().decode("utf-8", errors="replace")
        return
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        column = "messages" if fmt == "chat" else text_field
        table = pq.ParquetFile(path).read_row_group(chunk.start)
        if column not in table.column_names:
            raise PrepareError(f"{path}: row group {chunk.start} has no column {column!r}")
        for value in table.column(column).to_pylist():
            yield 0, value
        return
    with path.open("rb") as f:
        f.seek(chunk.start)
        data = f.read(chunk.stop - chunk.start)
    for n, raw in enumerate(data.split(b"\n"), chunk.first_line):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as e:
            raise PrepareError(f"{path}:{n}: not a JSON object ({e})") from e
        if not isinstance(row, dict):
            raise PrepareError(f"{path}:{n}: not a JSON object")
        key = "messages" if fmt == "chat" else text_field
        if key not in row:
            raise PrepareError(f"{path}:{n}: no field {key!r}")
        yield n, row[key]


def _check_messages(where: str, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise PrepareError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
    for m in messages:
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise PrepareError(f"{where}: every message needs a 'role' and a 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise PrepareError(
            f"{where}: the conversation has no assistant turn (nothing to learn from)"
        )
    return messages


def tokenize_chunk(row: dict[str, Any]) -> dict[str, Any]:
    """Tokenize one chunk into its shard files under row["out_dir"]; the counts, or the error to report.

    Each document becomes a numpy array at once (a chunk's ids never sit in one Python list: 28 bytes an
    int), text documents are encoded in batches (the tokenizer's fast batch path)."""
    chunk = Chunk(**row["chunk"])
    fmt, tokenizer, dtype = row["format"], row["tokenizer"], np.dtype(row["dtype"])
    parts: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    pending: list[str] = []

    def flush() -> None:
        for doc_ids in encode_texts(tokenizer, pending):
            parts.append(np.asarray(doc_ids, dtype=dtype))
            lengths.append(len(doc_ids))
        pending.clear()

    try:
        for line, doc in _documents(chunk, fmt, row["text_field"]):
            where = f"{chunk.path}:{line}" if line else chunk.path
            if fmt == "chat":
                doc_ids, doc_mask = encode_chat(tokenizer, _check_messages(where, doc))
                parts.append(np.asarray(doc_ids, dtype=dtype))
                masks.append(np.asarray(doc_mask, dtype=bool))
                lengths.append(len(doc_ids))
                continue
            if not isinstance(doc, str):
                raise PrepareError(
                    f"{where}: the text field must be a string, got {type(doc).__name__}"
                )
            pending.append(doc)
            if len(pending) >= ENCODE_BATCH:
                flush()
        flush()
        base = Path(row["out_dir"]) / row["shard"]
        np.save(f"{base}.tokens.npy", np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
        np.save(
            f"{base}.offsets.npy",
            np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        )
        if fmt == "chat":
            np.save(f"{base}.mask.npy", np.concatenate(masks) if masks else np.zeros(0, dtype=bool))
    except PrepareError as e:
        return {
            "shard": row["shard"],
            "error": str(e),
            "documents": 0,
            "tokens": 0,
            "size": chunk.size,
        }
    except (OSError, UnicodeDecodeError) as e:
        return {
            "shard": row["shard"],
            "error": f"{chunk.path}: {e}",
            "documents": 0,
            "tokens": 0,
            "size": chunk.size,
        }
    return {
        "shard": row["shard"],
        "error": "",
        "documents": len(lengths),
        "tokens": sum(lengths),
        "size": chunk.size,
    }


# -- the whole prepare -----------------------------------------------------------------------------------------
def _dtype_for(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def _aside(out: Path, what: str) -> Path:
    return out.parent / f".{out.name}.{what}"


def recover(out: Path) -> None:
    """Undo what an interrupted prepare left: its staging directory, and an old version renamed aside."""
    staging, old = _aside(out, "staging"), _aside(out, "old")
    if staging.exists():
        shutil.rmtree(staging)
    if old.exists():
        if out.exists():
            shutil.rmtree(old)
        else:  # died between the two renames: the old dataset goes back into place
            old.rename(out)


def read_manifest(out: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((out / MANIFEST).read_text()))
    except (OSError, ValueError):
        return None


def _ensure_ray(address: str | None, num_cpus: int | None) -> None:
    """Join `address`, or the cluster a Ray job runs on (RAY_ADDRESS), or start a local Ray."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    elif os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def plan(
    source: str | Path,
    *,
    tokenizer: str = BYTES,
    fmt: str = "text",
    text_field: str = "text",
    chunk_bytes: int = CHUNK_BYTES,
    progress: ProgressFn | None = None,
) -> Plan:
    """List, hash and chunk the source and hash the tokenizer: the dataset id before any work."""
    if fmt not in ("text", "chat"):
        raise PrepareError(f"--format must be 'text' or 'chat', got {fmt!r}")
    if tokenizer != BYTES:
        tokenizer = str(Path(tokenizer).resolve())
    root, paths = list_sources(source)
    info = tokenizer_info(tokenizer, fmt)
    total = sum(p.stat().st_size for p in paths)
    if progress is not None:
        progress(Progress(0, total, 0, 0, "hashing"))
    files = [plan_file(i, p, root, chunk_bytes) for i, p in enumerate(paths)]
    recipe = {
        "version": FORMAT_VERSION,
        "format": fmt,
        "text_field": text_field,
        "tokenizer": info["sha256"],
    }
    for f in files:
        f.key = hashlib.sha256(
            json.dumps({**recipe, "file": f.sha256}, sort_keys=True).encode()
        ).hexdigest()[:24]
    dataset_id = hashlib.sha256(
        json.dumps(
            {**recipe, "files": [[f.name, f.sha256] for f in files]}, sort_keys=True
        ).encode()
    ).hexdigest()[:16]
    return Plan(str(source), tokenizer, fmt, text_field, files, info, dataset_id, total)


@contextlib.contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold the lock file `lock` (fcntl; the kernel releases it if this process dies). The holder
    deletes it before letting go, and a waiter that then wins a deleted file tries again, so no
    lock file is left behind and no two holders ever coexist."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            now = os.stat(lock)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                break
        except FileNotFoundError:
            pass  # deleted by the holder we waited for: take the next one
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def prepare(
    source: str | Path,
    out: str | Path,
    *,
    tokenizer: str = BYTES,
    fmt: str = "text",
    text_field: str = "text",
    ray_address: str | None = None,
    num_cpus: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    progress: ProgressFn | None = None,
    inline: bool = False,
    planned: Plan | None = None,
    reuse_from: Path | None = None,
) -> dict[str, Any]:
    """Prepare `source` into `out` (see the module docstring); returns the manifest. Idempotent.

    `inline=True` tokenizes in this process instead of on Ray (a training rank, tests and tiny
    corpora: no cluster start); `planned` is this source's `plan(...)` when the caller made it;
    unchanged files' shards are linked from `reuse_from` (another prepared dataset) as from `out`."""
    report = progress or (lambda p: None)
    p = planned or plan(
        source,
        tokenizer=tokenizer,
        fmt=fmt,
        text_field=text_field,
        chunk_bytes=chunk_bytes,
        progress=report,
    )
    out_dir = Path(out).resolve()
    with exclusive(_aside(out_dir, "lock")):  # one prepare at a time writes into out_dir
        return _prepare_locked(p, out_dir, ray_address, num_cpus, report, inline, reuse_from)


def _prepare_locked(
    p: Plan,
    out_dir: Path,
    ray_address: str | None,
    num_cpus: int | None,
    report: ProgressFn,
    inline: bool,
    reuse_from: Path | None,
) -> dict[str, Any]:
    source, tokenizer, fmt, text_field = p.source, p.tokenizer, p.fmt, p.text_field
    files, info, dataset_id, total = p.files, p.info, p.dataset_id, p.total_bytes
    recover(out_dir)
    old = read_manifest(out_dir)
    if out_dir.exists() and old is None and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PrepareError(
            f"--out {out_dir}: exists and is not a prepared dataset; refusing to replace it"
        )
    if old is not None and old.get("id") == dataset_id:
        report(Progress(total, total, old["documents"], old["tokens"], "unchanged"))
        return old

    staging = _aside(out_dir, "staging")
    (staging / SHARDS).mkdir(parents=True)
    reusable: dict[str, tuple[Path, dict[str, Any]]] = {}  # file key -> (its shards' dir, entry)
    donor = read_manifest(reuse_from) if reuse_from is not None else None
    for where, m in ((reuse_from, donor), (out_dir, old)):
        for entry in (m or {}).get("files", []):
            if where is not None:
                reusable[entry["key"]] = (where / SHARDS, entry)
    dtype = _dtype_for(int(info["vocab_size"]))
    results: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    done_bytes = 0
    scheduled: set[str] = set()  # files with identical content share one set of shards
    for f in files:
        if f.key in scheduled:
            done_bytes += f.size
            continue
        scheduled.add(f.key)
        kept = reusable.get(f.key)
        if kept is not None and _link_shards(kept[0], staging / SHARDS, kept[1]["shards"]):
            for s in kept[1]["shards"]:
                results[s["name"]] = {"documents": s["documents"], "tokens": s["tokens"]}
            done_bytes += f.size
            continue
        for c in f.chunks:
            shard = f"{f.key}-{c.part:05d}"
            rows.append(
                {
                    "chunk": asdict(c),
                    "shard": shard,
                    "out_dir": str(staging / SHARDS),
                    "format": fmt,
                    "tokenizer": tokenizer,
                    "text_field": text_field,
                    "dtype": dtype,
                }
            )
    docs = sum(r["documents"] for r in results.values())
    toks = sum(r["tokens"] for r in results.values())
    report(Progress(done_bytes, total, docs, toks, "tokenizing"))
    try:
        errors = []
        if rows:
            done = map(tokenize_chunk, rows) if inline else _run_rows(rows, ray_address, num_cpus)
            for r in done:
                if r["error"]:
                    errors.append(r["error"])
                    continue
                results[r["shard"]] = r
                done_bytes += int(r["size"])
                docs += int(r["documents"])
                toks += int(r["tokens"])
                report(Progress(done_bytes, total, docs, toks, "tokenizing"))
        if errors:
            raise PrepareError(
                sorted(errors)[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
            )
        manifest = _manifest(dataset_id, source, files, info, fmt, text_field, dtype, results)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_tree(staging)
        _swap(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report(Progress(total, total, manifest["documents"], manifest["tokens"], "done"))
    return manifest


def _run_rows(
    rows: list[dict[str, Any]], address: str | None, num_cpus: int | None
) -> Iterator[dict[str, Any]]:
    """The chunks through one Ray Data map, in parallel; results as they finish."""
    import ray.data

    _ensure_ray(address, num_cpus)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map(tokenize_chunk, num_cpus=1)
    yield from ds.iter_rows()


def _link_shards(old_dir: Path, new_dir: Path, shards: list[dict[str, Any]]) -> bool:
    """Carry an unchanged file's shards over (hard links; copies across file systems). False if any is gone."""
    try:
        for s in shards:
            for p in old_dir.glob(f"{s['name']}.*.npy"):
                if (new_dir / p.name).exists():
                    continue
                try:
                    os.link(p, new_dir / p.name)
                except OSError:
                    shutil.copy2(p, new_dir / p.name)
        return all((new_dir / f"{s['name']}.tokens.npy").exists() for s in shards)
    except OSError:
        return False


def _manifest(
    dataset_id: str,
    source: str | Path,
    files: list[SourceFile],
    info: dict[str, Any],
    fmt: str,
    text_field: str,
    dtype: str,
    results: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    entries = []
    for f in files:
        shards: list[dict[str, Any]] = []
        for name in sorted(n for n in results if n.startswith(f.key + "-")):
            r = results[name]
            shards.append(
                {"name": name, "documents": int(r["documents"]), "tokens": int(r["tokens"])}
            )
        entries.append(
            {
                "path": f.name,
                "sha256": f.sha256,
                "bytes": f.size,
                "key": f.key,
                "documents": sum(s["documents"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards),
                "shards": shards,
            }
        )
    return {
        "id": dataset_id,
        "format_version": FORMAT_VERSION,
        "format": fmt,
        "text_field": text_field,
        "source": str(Path(source).resolve()),
        "tokenizer": info,
        "dtype": dtype,
        "files": entries,
        "documents": sum(e["documents"] for e in entries),
        "tokens": sum(e["tokens"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
        "created": time.time(),
    }


def _fsync_tree(root: Path) -> None:
    for p in [*root.rglob("*"), root]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _swap(staging: Path, out: Path) -> None:
    """Put the new dataset in place: the old one aside, the new one in, the old one deleted."""
    old = _aside(out, "old")
    if out.exists():
        out.rename(old)
    staging.rename(out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


# -- command line ----------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prepare arguments, shared with `ringtrain data prepare`."""
    parser.add_argument("source", help="a .txt/.jsonl/.parquet file, or a directory of them")
    parser.add_argument(
        "--tokenizer", required=True, help="a model directory, or 'bytes' (native models)"
    )
    parser.add_argument("--out", required=True, help="the dataset directory to write")
    parser.add_argument("--format", choices=("text", "chat"), default="text")
    parser.add_argument(
        "--text-field", default="text", help="the field read from .jsonl/.parquet (text format)"
    )
    parser.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local Ray)")


def format_progress(p: Progress) -> str:
    share = p.done_bytes / p.total_bytes if p.total_bytes else 1.0
    bar = "#" * int(share * 30)
    return f"[{bar:<30}] {share:6.1%} {p.stage:<10} {p.documents:,} documents {p.tokens:,} tokens"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.data.prepare", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    parser.add_argument(
        "--json-progress", action="store_true", help="one JSON line per progress update"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="tokenize in this process, without Ray (small corpora, tests)",
    )
    args = parser.parse_args(argv)

    def show(p: Progress) -> None:
        if args.json_progress:
            print(json.dumps({"progress": asdict(p)}), flush=True)
        else:
            print("\r" + format_progress(p), end="", file=sys.stderr, flush=True)

    try:
        manifest = prepare(
            args.source,
            args.out,
            tokenizer=args.tokenizer,
            fmt=args.format,
            text_field=args.text_field,
            ray_address=args.ray_address,
            progress=show,
            inline=args.in_process,
        )
    except PrepareError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    summary = {k: manifest[k] for k in ("id", "format", "documents", "tokens", "bytes")}
    print(
        ("" if args.json_progress else "\n")
        + json.dumps({"dataset": {**summary, "path": str(args.out)}})
    )
    return 0


if __name__ == "__main__":
    # run from the importable module, not __main__: Ray pickles the tasks' functions by module name
    from workers.data.prepare import main as module_main

    sys.exit(module_main())
