"""The app-wide exception handlers on a tiny in-process FastAPI app (no server, no store): each kind
of failure keeps its documented status, code, field and headers (`WWW-Authenticate` on 401,
`Retry-After` on 503), a wrong method keeps its own message rather than the 404 text, and a body
that is not JSON is a 400, not a 422."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from api.errors import ApiError, field_path, install, validation_error
from service.store import JobNotFound, StoreError


class _Body(BaseModel):
    n: int


def _client() -> TestClient:
    app = FastAPI()
    install(app)

    @app.get("/missing")
    def missing() -> None:
        raise JobNotFound("j9")

    @app.get("/store")
    def store() -> None:
        raise StoreError("db gone")

    @app.get("/auth")
    def auth() -> None:
        raise ApiError(401, "invalid API token", headers={"WWW-Authenticate": "Bearer"})

    @app.post("/body")
    def body(b: _Body) -> int:
        return b.n

    return TestClient(app, raise_server_exceptions=False)


def test_a_missing_job_is_404_naming_id() -> None:
    r = _client().get("/missing")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "code": "not_found",
        "message": "job j9 not found",
        "field": "id",
        "details": [],
    }


def test_a_store_outage_is_503_with_retry_after() -> None:
    r = _client().get("/store")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "store_unavailable"


def test_an_api_error_keeps_its_headers() -> None:
    r = _client().get("/auth")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "unauthorized"


def test_a_wrong_method_is_405_with_its_own_message() -> None:
    r = _client().post("/missing")
    assert r.status_code == 405
    err = r.json()["error"]
    assert err["code"] == "method_not_allowed" and "no such endpoint" not in err["message"]
    assert _client().get("/nope").json()["error"]["message"].startswith("no such endpoint")


def test_a_body_that_is_not_json_is_400_and_a_bad_field_422() -> None:
    c = _client()
    r = c.post("/body", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_json"
    r = c.post("/body", json={"n": "x"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "n"


def test_header_and_path_parameters_are_named_without_their_location() -> None:
    """A bad `Last-Event-ID` header is field `last-event-id` with `in: header`, like a query or
    path parameter is named by itself."""
    err = validation_error(
        [
            {"loc": ("header", "last-event-id"), "msg": "bad", "type": "int_parsing"},
            {"loc": ("path", "job_id"), "msg": "short", "type": "string_too_short"},
        ]
    )
    assert err.field == "last-event-id"
    assert [(d["field"], d["in"]) for d in err.details] == [
        ("last-event-id", "header"),
        ("job_id", "path"),
    ]


def test_a_whole_data_member_error_is_named_data() -> None:
    """A model-level error of the passkey/text data member has loc (body, data, <tag>): the tag
    pydantic adds is not part of the user's spec."""
    assert field_path(("body", "data", "passkey")) == "data"
    assert field_path(("body", "data", "text", "path")) == "data.path"
