"""A prepared dataset on disk: the manifest, shards carried over, the staging directory swapped
into place, the lock that makes prepares into one directory take turns."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workers.data.dataset import FORMAT_VERSION, MANIFEST
from workers.data.prepare.planning import SourceFile


def dtype_for(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def aside(out: Path, what: str) -> Path:
    return out.parent / f".{out.name}.{what}"


def recover(out: Path) -> None:
    """Undo what an interrupted prepare left: its staging directory and an old version set aside."""
    staging, old = aside(out, "staging"), aside(out, "old")
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


def link_shards(old_dir: Path, new_dir: Path, shards: list[dict[str, Any]]) -> bool:
    """Carry an unchanged file's shards over (hard links; copies across file systems). False if any
    is gone."""
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


def build_manifest(
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


def fsync_tree(root: Path) -> None:
    for p in [*root.rglob("*"), root]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def swap(staging: Path, out: Path) -> None:
    """Put the new dataset in place: the old one aside, the new one in, the old one deleted."""
    old = aside(out, "old")
    if out.exists():
        out.rename(old)
    staging.rename(out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)
