"""Download a job's exported model: every listed file, checked against its SHA-256, or nothing.

Each file streams into `<name>.part` beside its final place while its hash is computed; an
interrupted download resumes from the part already there with an HTTP Range request. A file whose
bytes do not hash to the listed SHA-256 is deleted and the pull fails (`ChecksumMismatch`): a
corrupted file never takes the final name. Files already present with the right hash are not
downloaded again. Names from the server are checked too: none may leave the destination directory.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx

if TYPE_CHECKING:
    from api.routers.artifacts import ArtifactList, ArtifactOut

_CHUNK = 1 << 20

Progress = Callable[[str, int, int], None]  # (file name, bytes done, file size)
Check = Callable[[httpx.Response], object]  # raises the client's ApiError for an error answer


class ChecksumMismatch(Exception):
    def __init__(self, name: str, expected: str, got: str) -> None:
        super().__init__(
            f"{name}: SHA-256 {got} does not match the listed {expected}; the file was discarded"
        )
        self.name = name
        self.expected = expected
        self.got = got


def local_path(dest: Path, name: str) -> Path:
    """Where a listed file goes under `dest`; ValueError for a name that would leave it."""
    parts = PurePosixPath(name).parts
    if (
        not parts
        or name.startswith("/")
        or "\\" in name
        or any(p in ("..", ".", "") for p in parts)
    ):
        raise ValueError(
            f"refusing artifact name {name!r}: not a relative path inside the model directory"
        )
    return dest.joinpath(*parts)


def _hash_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pull_file(
    http: httpx.Client,
    job_id: str,
    art: ArtifactOut,
    dest: Path,
    progress: Progress | None,
    check: Check,
) -> Path:
    final = local_path(dest, art.name)
    if final.is_file() and final.stat().st_size == art.size and _hash_of(final) == art.sha256:
        if progress:
            progress(art.name, art.size, art.size)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(final.name + ".part")
    h = hashlib.sha256()
    done = 0
    if part.is_file() and 0 < part.stat().st_size < art.size:  # resume an interrupted download
        with part.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                done += len(chunk)
    else:
        part.unlink(missing_ok=True)
    headers = {"Range": f"bytes={done}-"} if done else {}
    url = f"/v1/jobs/{job_id}/artifacts/{quote(art.name)}"
    with http.stream("GET", url, headers=headers, timeout=httpx.Timeout(30.0, read=300.0)) as r:
        if r.status_code >= 400:
            r.read()
            check(r)
        if r.status_code != 206:  # the server sent the whole file: start over
            h, done = hashlib.sha256(), 0
        with part.open("ab" if done else "wb") as f:
            for chunk in r.iter_bytes(_CHUNK):
                f.write(chunk)
                h.update(chunk)
                done += len(chunk)
                if progress:
                    progress(art.name, done, art.size)
    got = h.hexdigest()
    if got != art.sha256 or done != art.size:
        part.unlink(missing_ok=True)
        raise ChecksumMismatch(art.name, art.sha256, got)
    os.replace(part, final)
    return final


def pull(
    http: httpx.Client,
    listing: ArtifactList,
    dest: str | Path,
    check: Check,
    progress: Progress | None = None,
) -> list[Path]:
    """Every file of `listing` under `dest`, verified; raises ChecksumMismatch on the first bad
    file."""
    root = Path(dest).expanduser()
    for art in listing.files:
        local_path(root, art.name)  # refuse a bad name before writing anything
    root.mkdir(parents=True, exist_ok=True)
    return [pull_file(http, listing.job_id, art, root, progress, check) for art in listing.files]
