"""A finished job's exported model (`<checkpoint dir>/<job>/model/`) as a list of downloadable
files.

The control plane reads the directory the trainer wrote (`Trainer.export` renames it into place, so
it is complete whenever it exists). Only regular files are listed — never symlinks, so nothing
outside the directory can be reached through one — and a download must name a listed file, which
rules out `..`, absolute paths and links by construction.

SHA-256 of multi-GB weight files takes seconds, so hashes are cached: in memory, and in a manifest
beside the model directory (`model.manifest.json`, written once, atomically) that survives restarts.
An entry is reused only while the file's size and mtime are unchanged; a re-export replaces the
files and is re-hashed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

log = logging.getLogger("ringtrain.artifacts")

MODEL_DIR = "model"
MANIFEST = "model.manifest.json"


class ArtifactNotFound(LookupError):
    """No exported model, or no such file in it; the message says which, for a person to act on."""


@dataclass(frozen=True)
class ArtifactFile:
    name: str  # POSIX path relative to the model directory
    size: int
    sha256: str


def job_dir(checkpoint_dir: str | Path, job_id: str) -> Path:
    """The job's directory, resolved the way the launcher resolves it for the driver (relative →
    cwd)."""
    base = Path(checkpoint_dir).expanduser()
    return (base if base.is_absolute() else Path.cwd() / base) / job_id


def model_dir(checkpoint_dir: str | Path, job_id: str) -> Path:
    return job_dir(checkpoint_dir, job_id) / MODEL_DIR


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_memo: dict[tuple[str, int, int], str] = {}  # (absolute path, size, mtime_ns) -> sha256


def _lock_for(path: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(str(path), threading.Lock())


def _regular_files(root: Path) -> list[tuple[str, os.stat_result]]:
    """(relative POSIX name, lstat) of every regular file under root, sorted; symlinks are
    skipped."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for fn in filenames:
            p = Path(dirpath) / fn
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                out.append((p.relative_to(root).as_posix(), st))
    return sorted(out)


def list_artifacts(model: Path) -> list[ArtifactFile]:
    """The files of an exported model with size and SHA-256 (cached); ArtifactNotFound without a
    model."""
    if not model.is_dir() or model.is_symlink():
        raise ArtifactNotFound("no exported model: a job's model is written when it succeeds")
    manifest_path = model.parent / MANIFEST
    with _lock_for(model):  # one hashing pass per directory, however many listings ask at once
        cached = _read_manifest(manifest_path)
        files, changed = [], False
        for name, st in _regular_files(model):
            key = (str(model / name), st.st_size, st.st_mtime_ns)
            entry = cached.get(name)
            digest = _memo.get(key)
            if digest is None and entry and (entry.get("size"), entry.get("mtime_ns")) == key[1:]:
                digest = str(entry["sha256"])
            if digest is None:
                digest = sha256_file(model / name)
                changed = True
            _memo[key] = digest
            files.append((ArtifactFile(name, st.st_size, digest), st.st_mtime_ns))
        if changed or set(cached) != {f.name for f, _ in files}:
            _write_manifest(manifest_path, files)
    return [f for f, _ in files]


def resolve_artifact(model: Path, name: str) -> Path:
    """The path of one listed file of the model; ArtifactNotFound for anything else (escapes
    included)."""
    parts = PurePosixPath(name).parts
    if (
        not name
        or "\\" in name
        or "\x00" in name
        or name.startswith("/")
        or any(p in ("..", ".") for p in parts)
    ):
        raise ArtifactNotFound(
            f"{name!r} is not a file of this job's model (paths are relative, without '..')"
        )
    if not model.is_dir() or model.is_symlink():
        raise ArtifactNotFound("no exported model: a job's model is written when it succeeds")
    path = model.joinpath(*parts)
    try:
        st = path.lstat()
    except OSError:
        raise ArtifactNotFound(
            f"no file {name!r} in this job's model; list them at /artifacts"
        ) from None
    root = model.resolve()
    if not stat.S_ISREG(st.st_mode) or not path.resolve().is_relative_to(root):
        raise ArtifactNotFound(f"{name!r} is not a regular file of this job's model")
    for parent in path.relative_to(model).parents:  # no directory on the way may be a link either
        if (model / parent).is_symlink():
            raise ArtifactNotFound(f"{name!r} is not a regular file of this job's model")
    return path


def _read_manifest(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text())
        return {str(e["name"]): e for e in data["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_manifest(path: Path, files: list[tuple[ArtifactFile, int]]) -> None:
    body = {
        "files": [
            {"name": f.name, "size": f.size, "mtime_ns": m, "sha256": f.sha256} for f, m in files
        ]
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, path)
    except (
        OSError
    ) as e:  # a read-only checkpoint volume: the in-memory cache still holds the hashes
        log.info("cannot write %s (%s); hashes stay cached in memory", path, e)
        tmp.unlink(missing_ok=True)
