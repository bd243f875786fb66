"""Tokenizing: the tokenizer's record and encodings, and one chunk into its shard files (the Ray
task)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from workers.data.prepare.planning import Chunk, PrepareError, file_sha256

ENCODE_BATCH = 256  # text documents per call of the tokenizer
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
BYTES = "bytes"


def tokenizer_hash(tokenizer: str) -> str:
    """`bytes`, or the hash of a model directory's files other than weights (tokenizer and chat
    template)."""
    if tokenizer == BYTES:
        return hashlib.sha256(b"ringtrain-bytes-v1").hexdigest()
    root = Path(tokenizer)
    if not root.is_dir():
        raise PrepareError(f"--tokenizer {tokenizer}: not a model directory (or 'bytes')")
    h = hashlib.sha256()
    for p in sorted(root.iterdir()):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES):
            h.update(p.name.encode() + b"\0" + file_sha256(p).encode() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(path: str) -> Any:
    # one thread per task: Ray runs as many tasks as the cluster has CPUs for, the tokenizer must
    # not add more
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenizer_info(tokenizer: str, fmt: str) -> dict[str, Any]:
    """What the manifest records about the tokenizer; refuses chat without a chat template."""
    if tokenizer == BYTES:
        if fmt == "chat":
            raise PrepareError(
                "--format chat needs a model directory with a chat template, "
                "not the bytes tokenizer"
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
    """A text document: the tokenizer's own encoding (with whatever special tokens it adds), then
    eos once."""
    return encode_texts(tokenizer, [text])[0]


def encode_texts(tokenizer: str, texts: list[str]) -> list[Any]:
    """`encode_text` of each text, in one batch call of the tokenizer (arrays for bytes, lists
    otherwise)."""
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
    `return_assistant_tokens_mask`). Otherwise assistant turn k is the text between the render of
    turns [0, k) with the generation prompt and the render of turns [0, k] (trailing whitespace
    excluded: it is the template's formatting), both prefixes of the whole render; a token is the
    assistant's when its characters overlap that text (transformers maps generation spans to tokens
    the same way).
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
                "the chat template does not render a conversation's prefixes as prefixes of the "
                "whole; wrap assistant content in {% generation %}...{% endgeneration %} to mark it"
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
    """Tokenize one chunk into its shard files under row["out_dir"]; the counts, or the error to
    report.

    Each document becomes a numpy array at once (a chunk's ids never sit in one Python list: 28
    bytes an int), text documents are encoded in batches (the tokenizer's fast batch path)."""
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
