"""Signed artifact links, driven in process (the route function and the download dependency called
directly on a fake store): a link is an HMAC over job, file and expiry, opens that one file of that
one job until it expires (an hour after listing) and never after; a token-holder who also passes a
stray `expires` is still authenticated by the token; another owner's listing is a 404."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.security import HTTPAuthorizationCredentials

from api.errors import ApiError
from api.ratelimit import Limit, RateLimiter
from api.routers import artifacts as art
from service.artifacts import model_dir
from service.store import JobNotFound
from tests.support.api_harness import ALICE

OFF = Limit(0, 1)


class _Jobs:
    def get(self, job_id: str, owner: str | None = None) -> Any:
        if owner is not None and owner != "alice":
            raise JobNotFound(job_id)
        return SimpleNamespace(id=job_id, state="SUCCEEDED", owner="alice")


def _ctx(tmp: Path) -> Any:
    return SimpleNamespace(
        store=SimpleNamespace(jobs=_Jobs()),
        settings=SimpleNamespace(checkpoint_dir=str(tmp)),
        tokens={ALICE: "alice"},
        limiter=RateLimiter({"api": OFF, "report": OFF, "unauth": OFF}),
    )


def _request(job_id: str, path: str) -> Any:
    return SimpleNamespace(
        path_params={"job_id": job_id, "path": path},
        client=SimpleNamespace(host="127.0.0.1"),
        state=SimpleNamespace(),
    )


def _hand_sig(job_id: str, name: str, expires: int) -> str:
    return hmac.new(art._KEY, f"{job_id}\n{name}\n{expires}".encode(), hashlib.sha256).hexdigest()


def test_the_signature_covers_job_file_and_expiry() -> None:
    assert art.sign("j1", "model.safetensors", 1_700_000_000) == _hand_sig(
        "j1", "model.safetensors", 1_700_000_000
    )


def test_a_link_opens_its_file_of_its_job_until_it_expires(tmp_path: Path) -> None:
    ctx, name = _ctx(tmp_path), "model.safetensors"
    exp = int(time.time()) + 120
    sig = _hand_sig("j1", name, exp)
    assert art._download_owner(_request("j1", name), ctx, None, str(exp), sig) is None
    for job_id, path in (("j2", name), ("j1", "config.json")):  # another job, another file
        with pytest.raises(ApiError) as e:
            art._download_owner(_request(job_id, path), ctx, None, str(exp), sig)
        assert e.value.status == 401
    past = int(time.time()) - 5  # correctly signed, but expired
    with pytest.raises(ApiError) as e:
        art._download_owner(_request("j1", name), ctx, None, str(past), _hand_sig("j1", name, past))
    assert e.value.status == 401


def test_a_token_with_a_stray_expires_is_the_owners_download(tmp_path: Path) -> None:
    creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=ALICE)
    req = _request("j1", "model.safetensors")
    assert art._download_owner(req, _ctx(tmp_path), creds, "1700000000", None) == "alice"


def test_the_listing_signs_quoted_urls_for_an_hour_and_is_owner_only(tmp_path: Path) -> None:
    model = model_dir(tmp_path, "j1")
    model.mkdir(parents=True)
    (model / "my weights.bin").write_bytes(b"w" * 10)
    (model / "config.json").write_bytes(b"{}")
    ctx = _ctx(tmp_path)
    before = int(time.time())
    out = asyncio.run(art.list_job_artifacts("j1", ctx, "alice"))
    after = int(time.time())
    assert before + 3600 <= out.expires_at <= after + 3600
    assert out.total_bytes == 12
    by_name = {f.name: f for f in out.files}
    exp = out.expires_at
    assert by_name["my weights.bin"].url == (
        f"/v1/jobs/j1/artifacts/my%20weights.bin?expires={exp}"
        f"&sig={_hand_sig('j1', 'my weights.bin', exp)}"
    )
    assert by_name["my weights.bin"].sha256 == hashlib.sha256(b"w" * 10).hexdigest()
    with pytest.raises(JobNotFound):
        asyncio.run(art.list_job_artifacts("j1", ctx, "bob"))
