"""Property-based API conformance: schemathesis against /openapi.json of a real server (fixed seed, bounded)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from tests.api_harness import ALICE, RecordingLauncher, make_settings, running

pytestmark = pytest.mark.slow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory):
    with running(tmp_path_factory.mktemp("schemathesis")) as srv:
        yield srv


def _schema_dict() -> dict:
    # the schema is static: build it once from an app on a throwaway store (no server needed at import)
    with tempfile.TemporaryDirectory() as d:
        app = create_app(make_settings(Path(d)), RecordingLauncher())
        return app.openapi()


schema = schemathesis.openapi.from_dict(_schema_dict())


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms(case, api_server):
    case.call_and_validate(base_url=api_server.url, headers={"Authorization": f"Bearer {ALICE}"}, checks=CHECKS,
                           timeout=15)
