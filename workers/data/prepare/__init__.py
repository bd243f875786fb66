"""Prepare a corpus once: tokenized into memory-mapped shards, an index and a manifest.

`python -m workers.data.prepare SOURCE --tokenizer (MODEL_DIR | bytes) --out DIR
[--format text | chat] [--text-field text] [--ray-address ADDR]`

Plan (this process): list the source files (a file, or every .txt/.jsonl/.parquet under a directory
in sorted path order), hash each one while cutting it into chunks (jsonl: line-aligned byte ranges
that know their first line number; parquet: row groups; txt: the whole file, one document), hash the
tokenizer. The dataset id is a hash of all of that, so preparing the same source with the same
tokenizer again is a no-op, and only files whose hash changed are tokenized again (the others'
shards are hard-linked over).

Tokenize (the Ray cluster): one Ray Data row per chunk, mapped in parallel; each task writes its
chunk's shard (`<file key>-<part>.tokens.npy`, `.offsets.npy` and for chat `.mask.npy`) into a
staging directory beside DIR and returns its counts, or the error with file and line. The manifest
is written last and the staging directory renamed into place (the previous version is renamed aside
first and deleted after), so DIR is either the old dataset or the new one, never half of one; a
prepare that died is cleaned up by the next one. Prepares into one DIR take turns on a lock beside
it (`.<name>.lock`, fcntl, deleted when done): a second one waits, then finds the work done. DIR
must be on a file system every Ray node sees (like the checkpoint directory). `--in-process`
tokenizes in this process (no Ray).

The modules: `planning` (files, hashes, chunks), `tokenizing` (the tokenizer, one chunk into its
shard: the Ray task), `writing` (manifest, staging, swap, lock), `run` (`plan_dataset`, `prepare`),
`command` (the command line; its arguments in `workers.prepare_args`).
"""

from workers.data.prepare.command import format_progress, main
from workers.data.prepare.planning import (
    CHUNK_BYTES,
    SUFFIXES,
    Chunk,
    Plan,
    PrepareError,
    Progress,
    ProgressFn,
    SourceFile,
    list_sources,
    plan_file,
)
from workers.data.prepare.run import plan_dataset, prepare
from workers.data.prepare.tokenizing import (
    BYTES,
    ENCODE_BATCH,
    GENERATION_TAG,
    WEIGHT_SUFFIXES,
    encode_chat,
    encode_text,
    encode_texts,
    tokenize_chunk,
    tokenizer_hash,
    tokenizer_info,
)
from workers.data.prepare.writing import exclusive, read_manifest, recover
from workers.prepare_args import add_arguments

__all__ = [
    "BYTES",
    "CHUNK_BYTES",
    "ENCODE_BATCH",
    "GENERATION_TAG",
    "SUFFIXES",
    "WEIGHT_SUFFIXES",
    "Chunk",
    "Plan",
    "PrepareError",
    "Progress",
    "ProgressFn",
    "SourceFile",
    "add_arguments",
    "encode_chat",
    "encode_text",
    "encode_texts",
    "exclusive",
    "format_progress",
    "list_sources",
    "main",
    "plan_dataset",
    "plan_file",
    "prepare",
    "read_manifest",
    "recover",
    "tokenize_chunk",
    "tokenizer_hash",
    "tokenizer_info",
]
