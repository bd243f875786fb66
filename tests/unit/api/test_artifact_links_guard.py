"""Signed artifact links, driven in process (the route function and the download dependency called
directly, on a real store on a temporary SQLite file): a link is an HMAC over job, file and expiry,
opens that one file of that one job until it expires (an hour after listing) and never after; a
token-holder who also passes a stray `expires` is still authenticated by the token; another owner's
listing is a 404."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.security import HTTPAuthorizationCredentials

from api.errors import ApiError
from api.ratelimit import Limit, RateLimiter
from api.routers import artifacts as art
from service.artifacts import model_dir
from service.settings import Settings
from service.store import JobNotFound, Store
from tests.support.api_harness import ALICE
from tests.support.stores import sqlite_store
from workers.config import JobSpec
from workers.protocol import JobState, StateItem

OFF = Limit(0, 1)
SPEC = JobSpec.model_validate(
    {"name": "tiny", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "train": {"steps": 5}}
)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, str]]:
    """A real store holding one of alice's jobs, which ran and SUCCEEDED (as its driver reports
    it), and that job's id."""
    with sqlite_store(tmp_path_factory.mktemp("artifacts")) as store:
        job = store.jobs.create("alice", SPEC, "ingest-token")
        now = time.time()
        store.metrics.apply_report(
            job.id,
            [
                StateItem(seq=1, state=JobState.RUNNING, time=now, reason="placed"),
                StateItem(seq=2, state=JobState.SUCCEEDED, time=now, reason="done"),
            ],
        )
        assert store.jobs.get(job.id).state == "SUCCEEDED"
        yield store, job.id


@pytest.fixture
def ctx(finished: tuple[Store, str], tmp_path: Path) -> Any:
    """The app context; `ctx.job_id` is the finished job's id, its checkpoints under tmp_path."""
    store, job_id = finished
    return SimpleNamespace(
        store=store,
        settings=Settings(checkpoint_dir=str(tmp_path)),
        tokens={ALICE: "alice"},
        limiter=RateLimiter({"api": OFF, "report": OFF, "unauth": OFF}),
        job_id=job_id,
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


def test_a_link_opens_its_file_of_its_job_until_it_expires(ctx: Any) -> None:
    j1, name = ctx.job_id, "model.safetensors"
    exp = int(time.time()) + 120
    sig = _hand_sig(j1, name, exp)
    assert art._download_owner(_request(j1, name), ctx, None, str(exp), sig) is None
    for job_id, path in (("j2", name), (j1, "config.json")):  # another job, another file
        with pytest.raises(ApiError) as e:
            art._download_owner(_request(job_id, path), ctx, None, str(exp), sig)
        assert e.value.status == 401
    past = int(time.time()) - 5  # correctly signed, but expired
    with pytest.raises(ApiError) as e:
        art._download_owner(_request(j1, name), ctx, None, str(past), _hand_sig(j1, name, past))
    assert e.value.status == 401


def test_a_token_with_a_stray_expires_is_the_owners_download(ctx: Any) -> None:
    creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=ALICE)
    req = _request(ctx.job_id, "model.safetensors")
    assert art._download_owner(req, ctx, creds, "1700000000", None) == "alice"


def test_the_listing_signs_quoted_urls_for_an_hour_and_is_owner_only(
    ctx: Any, tmp_path: Path
) -> None:
    j1 = ctx.job_id
    model = model_dir(tmp_path, j1)
    model.mkdir(parents=True)
    (model / "my weights.bin").write_bytes(b"w" * 10)
    (model / "config.json").write_bytes(b"{}")
    before = int(time.time())
    out = asyncio.run(art.list_job_artifacts(j1, ctx, "alice"))
    after = int(time.time())
    assert before + 3600 <= out.expires_at <= after + 3600
    assert out.total_bytes == 12
    by_name = {f.name: f for f in out.files}
    exp = out.expires_at
    assert by_name["my weights.bin"].url == (
        f"/v1/jobs/{j1}/artifacts/my%20weights.bin?expires={exp}"
        f"&sig={_hand_sig(j1, 'my weights.bin', exp)}"
    )
    assert by_name["my weights.bin"].sha256 == hashlib.sha256(b"w" * 10).hexdigest()
    with pytest.raises(JobNotFound):
        asyncio.run(art.list_job_artifacts(j1, ctx, "bob"))
