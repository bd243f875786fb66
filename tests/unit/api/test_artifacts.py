"""Model artifacts over the real HTTP server: listing (size, SHA-256), download (owner only, signed links, no
path escapes, HTTP Range), and `pull` (client and CLI) that verifies every checksum and refuses a corrupted
file.

The model directory is what a finished job leaves: a native model exported by the trainer's own
`save_pretrained` into `<checkpoint dir>/<job>/model/`; the pulled copy must load in transformers and give
the same logits as the model that was exported.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from api.cli import main
from api.client import ApiError, Client
from api.pull import ChecksumMismatch
from service.artifacts import MANIFEST
from tests.support.api_harness import ALICE, BOB, TINY_SPEC, Server, running
from workers.config import ModelConfig
from workers.models import build_model, save_pretrained

EXTRA = 3 * (1 << 20) + 12345  # a file larger than one streamed chunk, for ranges and resumed pulls


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, str, Path, torch.nn.Module]]:
    tmp = tmp_path_factory.mktemp("artifacts")
    with running(tmp) as srv:
        with srv.client() as c:
            job_id = c.post("/v1/jobs", json=TINY_SPEC).json()["id"]
        model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2), seed=3).eval()
        out = save_pretrained(model, tmp / "ckpt" / job_id / "model", max_position_embeddings=256)
        (out / "extra").mkdir()
        (out / "extra" / "blob.bin").write_bytes(os.urandom(EXTRA))
        yield srv, job_id, out, model


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def listing(srv: Server, job_id: str, token: str | None = ALICE) -> Any:
    with srv.client(token) as c:
        return c.get(f"/v1/jobs/{job_id}/artifacts")


def test_listing_has_every_file_with_its_hash_cached_in_a_manifest(exported: Any) -> None:
    srv, job_id, out, _ = exported
    r = listing(srv, job_id)
    assert r.status_code == 200, r.text
    body = r.json()
    names = {f["name"] for f in body["files"]}
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert (
        names == on_disk
        and {"config.json", "model.safetensors", "tokenizer.json", "extra/blob.bin"} <= names
    )
    for f in body["files"]:
        assert f["size"] == (out / f["name"]).stat().st_size
        assert f["sha256"] == sha(out / f["name"])
    assert body["total_bytes"] == sum(f["size"] for f in body["files"]) and body[
        "model_path"
    ] == str(out)
    manifest = json.loads((out.parent / MANIFEST).read_text())
    assert {e["name"]: e["sha256"] for e in manifest["files"]} == {
        f["name"]: f["sha256"] for f in body["files"]
    }
    # a second listing reuses the cached hashes: the manifest is not rewritten
    mtime = (out.parent / MANIFEST).stat().st_mtime_ns

    def unsigned(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # each listing signs fresh one-hour links: `expires` moves with the clock second, the path does not
        return [{**f, "url": f["url"].split("?")[0]} for f in files]

    again = listing(srv, job_id).json()["files"]
    assert unsigned(again) == unsigned(body["files"]) and all("sig=" in f["url"] for f in again)
    assert (out.parent / MANIFEST).stat().st_mtime_ns == mtime


def test_download_is_owner_only_and_signed_links_are_scoped(exported: Any) -> None:
    srv, job_id, out, _ = exported
    assert listing(srv, job_id, None).status_code == 401
    r = listing(srv, job_id, BOB)
    assert r.status_code == 404 and r.json()["error"]["field"] == "id"
    path = f"/v1/jobs/{job_id}/artifacts/config.json"
    with srv.client(ALICE) as c:
        r = c.get(path)
        assert r.status_code == 200 and r.content == (out / "config.json").read_bytes()
        assert "attachment" in r.headers["content-disposition"]
    with srv.client(BOB) as c:
        assert c.get(path).status_code == 404
    with srv.client(None) as c:
        assert c.get(path).status_code == 401
        files = {f["name"]: f for f in listing(srv, job_id).json()["files"]}
        url = files["extra/blob.bin"]["url"]
        r = c.get(url)  # the signed link works without a token
        assert r.status_code == 200 and r.content == (out / "extra" / "blob.bin").read_bytes()
        other = url.replace("extra/blob.bin", "config.json")  # a signature is for its own file only
        assert c.get(other).status_code == 401
        assert c.get(url.replace("sig=", "sig=0")).status_code == 401
        expired = int(time.time()) - 1
        assert (
            c.get(url.split("?")[0] + f"?expires={expired}&sig=" + url.split("sig=")[1]).status_code
            == 401
        )


def test_no_path_escapes(exported: Any, tmp_path: Path) -> None:
    srv, job_id, out, _ = exported
    secret = (
        out.parent.parent.parent / "ringtrain.db"
    )  # the store, two levels above the job's directory
    assert secret.is_file()
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    (out / "link.txt").symlink_to(outside)
    (out / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    try:
        names = {f["name"] for f in listing(srv, job_id).json()["files"]}
        assert "link.txt" not in names and not any(n.startswith("linkdir") for n in names)
        base = f"{srv.url}/v1/jobs/{job_id}/artifacts/"
        with srv.client(ALICE) as c:
            for raw in (
                "..%2F..%2F..%2Fringtrain.db",
                "%2e%2e/%2e%2e/%2e%2e/ringtrain.db",
                "extra/..%2F..%2F..%2F..%2Fringtrain.db",
                "%2Fetc%2Fpasswd",
                "link.txt",
                "linkdir/outside.txt",
                "extra",
                "missing.bin",
            ):
                r = c.get(base + raw)
                assert r.status_code == 404, (raw, r.status_code)
                assert (
                    r.json()["error"]["code"] == "no_artifacts"
                    and r.json()["error"]["field"] == "path"
                ), raw
                assert b"SQLite" not in r.content and b"not yours" not in r.content
    finally:
        (out / "link.txt").unlink()
        (out / "linkdir").unlink()


def test_range_requests(exported: Any) -> None:
    srv, job_id, out, _ = exported
    data = (out / "extra" / "blob.bin").read_bytes()
    url = f"/v1/jobs/{job_id}/artifacts/extra/blob.bin"
    with srv.client(ALICE) as c:
        full = c.get(url)
        assert full.headers["accept-ranges"] == "bytes" and full.content == data
        r = c.get(url, headers={"Range": "bytes=1000-1999"})
        assert r.status_code == 206 and r.content == data[1000:2000]
        assert r.headers["content-range"] == f"bytes 1000-1999/{len(data)}"
        r = c.get(url, headers={"Range": f"bytes={len(data) - 100}-"})
        assert r.status_code == 206 and r.content == data[-100:]
        r = c.get(url, headers={"Range": "bytes=-10"})
        assert r.status_code == 206 and r.content == data[-10:]
        r = c.get(url, headers={"Range": f"bytes={len(data)}-"})
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"


def test_no_model_yet_is_a_404_that_says_why(tmp_path: Path) -> None:
    with running(tmp_path) as srv, Client(srv.url, ALICE) as c:
        job = c.submit(TINY_SPEC)
        with pytest.raises(ApiError) as e:
            c.artifacts(job.id)
        assert (
            e.value.status == 404
            and e.value.code == "no_artifacts"
            and "succeeds" in e.value.message
        )


def _logits(model: torch.nn.Module, hf: Any) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([list(b"pull me, the pass key is 4821")])
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1])), hf(tokens).logits


def test_pull_verifies_and_loads_in_transformers(exported: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    srv, job_id, out, model = exported
    seen: dict[str, int] = {}
    with Client(srv.url, ALICE) as c:
        paths = c.pull(
            job_id, tmp_path / "m", progress=lambda n, done, size: seen.__setitem__(n, done)
        )
    assert {p.relative_to(tmp_path / "m").as_posix() for p in paths} == set(seen)
    for p in paths:
        rel = p.relative_to(tmp_path / "m")
        assert sha(p) == sha(out / rel) and seen[rel.as_posix()] == p.stat().st_size
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", attn_implementation="eager", dtype=torch.float32
    ).eval()
    ours, theirs = _logits(model, hf)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5 * float(ours.abs().max()))

    # an interrupted download resumes from its .part file with a Range request
    blob = tmp_path / "m" / "extra" / "blob.bin"
    blob.unlink()
    (blob.parent / "blob.bin.part").write_bytes(
        (out / "extra" / "blob.bin").read_bytes()[: EXTRA // 3]
    )
    with Client(srv.url, ALICE) as c:
        c.pull(job_id, tmp_path / "m")
    assert (
        sha(blob) == sha(out / "extra" / "blob.bin")
        and not (blob.parent / "blob.bin.part").exists()
    )


def test_pull_refuses_a_corrupted_file(
    exported: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv, job_id, out, _ = exported
    target = out / "model.safetensors"
    listing(srv, job_id)  # hashes cached
    st = target.stat()
    original = target.read_bytes()
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0xFF
    target.write_bytes(bytes(corrupted))
    os.utime(
        target, ns=(st.st_atime_ns, st.st_mtime_ns)
    )  # bit rot: same size and mtime, the cache is stale
    try:
        with Client(srv.url, ALICE) as c, pytest.raises(ChecksumMismatch) as e:
            c.pull(job_id, tmp_path / "a")
        assert (
            e.value.name == "model.safetensors"
            and e.value.expected == hashlib.sha256(original).hexdigest()
        )
        assert not (tmp_path / "a" / "model.safetensors").exists()
        assert not (tmp_path / "a" / "model.safetensors.part").exists()

        code = main(["pull", job_id, str(tmp_path / "b"), "--url", srv.url, "--token", ALICE])
        assert code == 1 and "does not match" in capsys.readouterr().out
        assert not (tmp_path / "b" / "model.safetensors").exists()
    finally:
        target.write_bytes(original)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    code = main(["pull", job_id, str(tmp_path / "b"), "--url", srv.url, "--token", ALICE])
    assert (
        code == 0
        and sha(tmp_path / "b" / "model.safetensors") == hashlib.sha256(original).hexdigest()
    )
    assert "from_pretrained" in capsys.readouterr().out
