"""The report route's answers and counters, driven in process (the route function and the ingest
check on fake stores, the limiter on a fake clock): the 409s carry the documented code and
`acked_seq`, each outcome counts under its own label, the ingested-points counter counts points
(not items), and failed ingest tokens spend their address's bucket while good ones spend the
job's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.security import HTTPAuthorizationCredentials

from api.errors import ApiError
from api.ratelimit import Limit, RateLimiter
from api.routers.reports import _check_ingest, report
from api.telemetry import Telemetry
from service.store import JobEnded, ReportGap
from workers.protocol import ReportBatch


class _Metrics:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def apply_report(self, job_id: str, items: list[Any]) -> Any:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _ctx(outcome: Any = None) -> Any:
    tokens = SimpleNamespace(check=lambda job_id, tok: tok == f"ingest-{job_id}")
    store = SimpleNamespace(
        metrics=_Metrics(outcome), tokens=tokens, jobs=SimpleNamespace(counts_by_state=dict)
    )
    now = [0.0]
    limiter = RateLimiter(
        {"api": Limit(0, 1), "report": Limit(0.01, 2), "unauth": Limit(0.01, 1)},
        clock=lambda: now[0],
    )
    return SimpleNamespace(store=store, telemetry=Telemetry(store), limiter=limiter)


BATCH = ReportBatch.model_validate(
    {
        "items": [
            {"type": "metric", "seq": s, "time": 1.0, "step": s, "name": "loss", "value": 0.5}
            for s in (10, 11, 12)
        ]
    }
)


def _outcomes(ctx: Any) -> dict[str, float | None]:
    get = ctx.telemetry.registry.get_sample_value
    return {
        k: get("ringtrain_report_batches_total", {"outcome": k}) for k in ("ok", "gap", "ended")
    }


def test_an_applied_batch_counts_its_points_and_answers_the_acked_seq() -> None:
    ctx = _ctx(SimpleNamespace(points=7, applied_to=None, acked_seq=12))
    assert report("j1", BATCH, ctx).acked_seq == 12
    assert ctx.telemetry.registry.get_sample_value("ringtrain_metric_points_ingested_total") == 7.0
    assert _outcomes(ctx) == {"ok": 1.0, "gap": None, "ended": None}


def test_a_gap_before_the_batch_is_409_with_the_servers_acked_seq() -> None:
    ctx = _ctx(ReportGap(5))
    with pytest.raises(ApiError) as e:
        report("j1", BATCH, ctx)
    assert (e.value.status, e.value.code, e.value.extra) == (409, "sequence_gap", {"acked_seq": 5})
    assert "resend from 6" in e.value.message
    assert _outcomes(ctx) == {"ok": None, "gap": 1.0, "ended": None}


def test_a_gap_inside_the_batch_is_409_after_applying_the_first_part() -> None:
    ctx = _ctx(SimpleNamespace(points=1, applied_to=10, acked_seq=10))
    with pytest.raises(ApiError) as e:
        report("j1", BATCH, ctx)
    assert (e.value.status, e.value.code, e.value.extra) == (409, "sequence_gap", {"acked_seq": 10})
    assert ctx.telemetry.registry.get_sample_value("ringtrain_metric_points_ingested_total") == 1.0
    assert _outcomes(ctx) == {"ok": None, "gap": 1.0, "ended": None}


def test_a_report_after_the_end_is_409_job_ended_without_acked_seq() -> None:
    ctx = _ctx(JobEnded("SUCCEEDED"))
    with pytest.raises(ApiError) as e:
        report("j1", BATCH, ctx)
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


def test_bad_ingest_tokens_spend_the_address_and_good_ones_the_job() -> None:
    ctx = _ctx()
    # a wrong token (another job's) and a missing one: 401, then the address is out (burst 1)
    assert _status(ctx, "j1", "ingest-j2", "10.0.0.5") == 401
    assert _status(ctx, "j1", None, "10.0.0.5") == 429
    assert _status(ctx, "j1", None, "10.0.0.6") == 401  # another address is unaffected
    # the job's own token: the job's bucket (burst 2), not the address's
    assert [_status(ctx, "j1", "ingest-j1", "10.0.0.5") for _ in range(3)] == [200, 200, 429]
    assert _status(ctx, "j2", "ingest-j2", "10.0.0.5") == 200  # another job is unaffected
