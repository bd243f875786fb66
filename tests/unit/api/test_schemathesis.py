"""Property-based API conformance: schemathesis against /openapi.json of a real server (fixed seed, bounded)."""

from __future__ import annotations

import itertools
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.meta import TestPhase
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from tests.support.api_harness import (
    ALICE,
    TINY_SPEC,
    Driver,
    RecordingLauncher,
    make_settings,
    roomy_launcher,
    running,
    upgraded,
)

pytestmark = pytest.mark.slow

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory):
    with running(tmp_path_factory.mktemp("schemathesis"), roomy_launcher()) as srv:
        yield srv


def _schema_dict() -> dict:
    # the schema is static: build it once from an app on a throwaway store (no server needed at import)
    with tempfile.TemporaryDirectory() as d:
        app = create_app(upgraded(make_settings(Path(d))), RecordingLauncher())
        return app.openapi()


schema = schemathesis.openapi.from_dict(_schema_dict())


OPEN = {"/healthz", "/readyz"}
_COVERAGE_SEEN: defaultdict[str, itertools.count[int]] = defaultdict(itertools.count)


@schema.exclude(path="/v1/plan", method="POST").parametrize()
@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms(case, api_server):
    _conforms(case, api_server)


@schema.include(path="/v1/plan", method="POST").parametrize()
@settings(
    max_examples=30,
    phases=[Phase.generate],
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_plan_conforms(case, api_server):
    """POST /v1/plan takes the body POST /v1/jobs takes, validated by the same model, whose
    coverage phase (~2400 boundary bodies) runs on POST /v1/jobs: here the generated specs only."""
    _conforms(case, api_server)


def _conforms(case, api_server) -> None:
    """With the owner's token every operation answers as its schema says, whatever the input; the
    same input without a token gets a conformant 401 from every secured operation (open ones stay
    open) and 405 for a method the path does not declare. Without the token go the generated
    inputs, the coverage phase's undeclared methods and every 8th of its boundary cases (valid and
    invalid bodies alike: ~2400 for the job spec, where one in 8 still sends ~300 bodies that must
    meet a 401, never a 422, before they are read)."""
    case.call_and_validate(
        base_url=api_server.url,
        headers={"Authorization": f"Bearer {ALICE}"},
        checks=CHECKS,
        timeout=15,
    )
    undeclared = case.method.upper() != case.operation.method.upper()
    coverage = case.meta is not None and case.meta.phase.name == TestPhase.COVERAGE
    if coverage and not undeclared and next(_COVERAGE_SEEN[case.operation.label]) % 8:
        return
    r = case.call_and_validate(base_url=api_server.url, checks=CHECKS, timeout=15)
    if undeclared:  # schemathesis also tries undeclared methods
        assert r.status_code == 405, r.text[:300]
    else:
        assert r.status_code == (200 if case.operation.path in OPEN else 401), (
            case.method,
            r.text[:300],
        )


@pytest.fixture(scope="module")
def reporting_job(api_server):
    """A real job and its driver's ingest token, so the report route's body is fuzzed past authentication."""
    with api_server.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY_SPEC, "name": "fuzzed-reports"}).json()["id"]
    return job_id, Driver(api_server, job_id).token


@schema.include(path="/v1/jobs/{job_id}/report").parametrize()
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_report_route_with_ingest_token(case, api_server, reporting_job):
    job_id, token = reporting_job
    case.path_parameters = {"job_id": job_id}
    case.call_and_validate(
        base_url=api_server.url,
        headers={"Authorization": f"Bearer {token}"},
        checks=CHECKS,
        timeout=15,
    )
