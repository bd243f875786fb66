"""The report route's answers and counters, driven in process (the route function and the ingest
check on a real store on a temporary SQLite file, the limiter on a fake clock): the 409s carry the
documented code and `acked_seq`, each outcome counts under its own label, the ingested-points
counter counts points (not items: items the server already holds are acknowledged, not stored
again), and failed ingest tokens spend their address's bucket while good ones spend the job's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.security import HTTPAuthorizationCredentials

from api.errors import ApiError
from api.ratelimit import Limit, RateLimiter
from api.routers.reports import _check_ingest, report
from api.telemetry import Telemetry
from service.store import Store, hash_token
from tests.support.stores import sqlite_store
from workers.config import JobSpec
from workers.protocol import JobState, MetricItem, ReportBatch, StateItem

SPEC = JobSpec.model_validate(
    {"name": "tiny", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "train": {"steps": 5}}
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """One database for the module: each test reports to jobs of its own."""
    with sqlite_store(tmp_path_factory.mktemp("reports")) as store:
        yield store


@pytest.fixture
def ctx(store: Store) -> Any:
    now = [0.0]
    limiter = RateLimiter(
        {"api": Limit(0, 1), "report": Limit(0.01, 2), "unauth": Limit(0.01, 1)},
        clock=lambda: now[0],
    )
    return SimpleNamespace(store=store, telemetry=Telemetry(store), limiter=limiter)


def _metric(seq: int) -> MetricItem:
    return MetricItem(seq=seq, time=1.0, step=seq, name="loss", value=0.5)


def _job(ctx: Any, mark: int, end: JobState | None = None) -> str:
    """A running job of alice's (ingest token `ingest-<id>` is set after), whose driver has
    reported through seq `mark` (RUNNING, then points), and then `end` if given."""
    store: Store = ctx.store
    job = store.jobs.create("alice", SPEC, "unused")
    items: list[Any] = [StateItem(seq=1, state=JobState.RUNNING, time=time.time(), reason="up")]
    items += [_metric(s) for s in range(2, mark + 1)]
    if end is not None:
        items.append(StateItem(seq=mark + 1, state=end, time=time.time(), reason="end"))
    store.metrics.apply_report(job.id, items)
    return job.id


def _batch(*seqs: int) -> ReportBatch:
    return ReportBatch(items=[_metric(s) for s in seqs])


BATCH = _batch(10, 11, 12)


def _outcomes(ctx: Any) -> dict[str, float | None]:
    get = ctx.telemetry.registry.get_sample_value
    return {
        k: get("ringtrain_report_batches_total", {"outcome": k}) for k in ("ok", "gap", "ended")
    }


def test_an_applied_batch_counts_its_points_and_answers_the_acked_seq(ctx: Any) -> None:
    j1 = _job(ctx, mark=5)
    # 12 items, of which seqs 1..5 are held already: 7 points stored
    assert report(j1, _batch(*range(1, 13)), ctx).acked_seq == 12
    assert ctx.telemetry.registry.get_sample_value("ringtrain_metric_points_ingested_total") == 7.0
    assert _outcomes(ctx) == {"ok": 1.0, "gap": None, "ended": None}


def test_a_gap_before_the_batch_is_409_with_the_servers_acked_seq(ctx: Any) -> None:
    j1 = _job(ctx, mark=5)
    with pytest.raises(ApiError) as e:
        report(j1, BATCH, ctx)
    assert (e.value.status, e.value.code, e.value.extra) == (409, "sequence_gap", {"acked_seq": 5})
    assert "resend from 6" in e.value.message
    assert _outcomes(ctx) == {"ok": None, "gap": 1.0, "ended": None}


def test_a_gap_inside_the_batch_is_409_after_applying_the_first_part(ctx: Any) -> None:
    j1 = _job(ctx, mark=9)
    with pytest.raises(ApiError) as e:
        report(j1, _batch(10, 12), ctx)  # 11 is missing
    assert (e.value.status, e.value.code, e.value.extra) == (409, "sequence_gap", {"acked_seq": 10})
    assert ctx.telemetry.registry.get_sample_value("ringtrain_metric_points_ingested_total") == 1.0
    assert _outcomes(ctx) == {"ok": None, "gap": 1.0, "ended": None}


def test_a_report_after_the_end_is_409_job_ended_without_acked_seq(ctx: Any) -> None:
    j1 = _job(ctx, mark=9, end=JobState.SUCCEEDED)
    with pytest.raises(ApiError) as e:
        report(j1, BATCH, ctx)
    assert (e.value.status, e.value.code, e.value.extra) == (
        409,
        "job_ended",
        {"state": "SUCCEEDED"},
    )
    assert _outcomes(ctx) == {"ok": None, "gap": None, "ended": 1.0}


def _creds(token: str) -> HTTPAuthorizationCredentials:
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)


def _status(ctx: Any, job_id: str, token: str | None, address: str) -> int:
    try:
        _check_ingest(ctx, job_id, _creds(token) if token else None, address)
    except ApiError as e:
        return e.status
    return 200


def test_bad_ingest_tokens_spend_the_address_and_good_ones_the_job(ctx: Any) -> None:
    j1, j2 = _job(ctx, mark=1), _job(ctx, mark=1)
    for j in (j1, j2):  # each job's token, as a driver attempt gets it
        ctx.store.tokens.replace(j, hash_token(f"ingest-{j}"))
    # a wrong token (another job's) and a missing one: 401, then the address is out (burst 1)
    assert _status(ctx, j1, f"ingest-{j2}", "10.0.0.5") == 401
    assert _status(ctx, j1, None, "10.0.0.5") == 429
    assert _status(ctx, j1, None, "10.0.0.6") == 401  # another address is unaffected
    # the job's own token: the job's bucket (burst 2), not the address's
    assert [_status(ctx, j1, f"ingest-{j1}", "10.0.0.5") for _ in range(3)] == [200, 200, 429]
    assert _status(ctx, j2, f"ingest-{j2}", "10.0.0.5") == 200  # another job is unaffected
