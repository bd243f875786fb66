"""The whole prepare: plan, tokenize the chunks (on Ray or in this process), write the dataset."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workers.data.dataset import FORMAT_VERSION, MANIFEST, SHARDS
from workers.data.prepare.planning import (
    CHUNK_BYTES,
    Plan,
    PrepareError,
    Progress,
    ProgressFn,
    list_sources,
    plan_file,
)
from workers.data.prepare.tokenizing import BYTES, tokenize_chunk, tokenizer_info
from workers.data.prepare.writing import (
    aside,
    build_manifest,
    dtype_for,
    exclusive,
    fsync_tree,
    link_shards,
    read_manifest,
    recover,
    swap,
)


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


def plan_dataset(
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


def prepare(
    source: str | Path,
    out: str | Path,
    *,
    tokenizer: str = BYTES,
    fmt: str = "text",
    text_field: str = "text",
    ray_address: str | None = None,
    num_cpus: int | None = None,
    workers: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    progress: ProgressFn | None = None,
    inline: bool = False,
    planned: Plan | None = None,
    reuse_from: Path | None = None,
) -> dict[str, Any]:
    """Prepare `source` into `out` (see the module docstring); returns the manifest. Idempotent.

    `inline=True` tokenizes in this process instead of on Ray (a training rank, tests and tiny
    corpora: no cluster start); `workers` caps the tokenize tasks running at once on Ray (default:
    as many as the cluster's free CPUs allow; a cap leaves a shared cluster room for its jobs);
    `planned` is this source's `plan_dataset(...)` when the caller made it; unchanged files'
    shards are linked from `reuse_from` (another prepared dataset) as from `out`."""
    report = progress or (lambda p: None)
    p = planned or plan_dataset(
        source,
        tokenizer=tokenizer,
        fmt=fmt,
        text_field=text_field,
        chunk_bytes=chunk_bytes,
        progress=report,
    )
    out_dir = Path(out).resolve()
    with exclusive(aside(out_dir, "lock")):  # one prepare at a time writes into out_dir
        return _prepare_locked(
            p, out_dir, ray_address, num_cpus, workers, report, inline, reuse_from
        )


def _prepare_locked(
    p: Plan,
    out_dir: Path,
    ray_address: str | None,
    num_cpus: int | None,
    workers: int | None,
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

    staging = aside(out_dir, "staging")
    (staging / SHARDS).mkdir(parents=True)
    reusable: dict[str, tuple[Path, dict[str, Any]]] = {}  # file key -> (its shards' dir, entry)
    donor = read_manifest(reuse_from) if reuse_from is not None else None
    for where, m in ((reuse_from, donor), (out_dir, old)):
        for entry in (m or {}).get("files", []):
            if where is not None:
                reusable[entry["key"]] = (where / SHARDS, entry)
    dtype = dtype_for(int(info["vocab_size"]))
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
        if kept is not None and link_shards(kept[0], staging / SHARDS, kept[1]["shards"]):
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
            done = (
                map(tokenize_chunk, rows)
                if inline
                else _run_rows(rows, ray_address, num_cpus, workers)
            )
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
        manifest = build_manifest(dataset_id, source, files, info, fmt, text_field, dtype, results)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync_tree(staging)
        swap(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report(Progress(total, total, manifest["documents"], manifest["tokens"], "done"))
    return manifest


def _run_rows(
    rows: list[dict[str, Any]], address: str | None, num_cpus: int | None, workers: int | None
) -> Iterator[dict[str, Any]]:
    """The chunks through one Ray Data map, in parallel; results as they finish."""
    import ray.data

    _ensure_ray(address, num_cpus)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
        tokenize_chunk, num_cpus=1, concurrency=workers
    )
    yield from ds.iter_rows()
