"""The browser hardening headers, checked in process against the policy written out by hand (not
against `api.security.CSP` itself, which would agree with any change to it): every directive of the
strict policy, the relaxed one on both documentation pages, and a header a route set itself is kept
rather than doubled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api.security import SecurityHeadersMiddleware

STRICT = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self'",
    "img-src": "'self'",
    "connect-src": "'self'",
    "font-src": "'self'",
    "object-src": "'none'",
    "base-uri": "'none'",
    "form-action": "'self'",
    "frame-ancestors": "'none'",
}


def _headers(path: str, own: list[tuple[bytes, bytes]] | None = None) -> list[tuple[str, str]]:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": own or []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "GET", "path": path, "headers": []}
    asyncio.run(SecurityHeadersMiddleware(app)(scope, receive, send))
    return [(k.decode(), v.decode()) for k, v in sent[0]["headers"]]


def _policy(value: str) -> dict[str, str]:
    return dict(d.strip().split(" ", 1) for d in value.split(";"))


@pytest.mark.parametrize("path", ["/", "/v1/jobs", "/static/js/main.js", "/nope"])
def test_every_directive_of_the_strict_policy_and_the_fixed_headers(path: str) -> None:
    h = dict(_headers(path))
    assert _policy(h["content-security-policy"]) == STRICT
    assert h["x-content-type-options"] == "nosniff"
    assert h["referrer-policy"] == "no-referrer"
    assert h["x-frame-options"] == "DENY"
    assert h["cross-origin-opener-policy"] == "same-origin"


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_both_documentation_pages_only_refuse_framing(path: str) -> None:
    h = dict(_headers(path))
    assert h["content-security-policy"] == "frame-ancestors 'none'"
    assert h["x-frame-options"] == "DENY"


def test_a_header_the_route_set_is_kept_once() -> None:
    got = _headers("/v1/jobs", [(b"Referrer-Policy", b"same-origin")])
    names = [k.lower() for k, _ in got]
    assert names.count("referrer-policy") == 1
    assert ("Referrer-Policy", "same-origin") in got
    assert names.count("x-frame-options") == 1
