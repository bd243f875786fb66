"""Edges of the request-body limit, the spec's content types and the token buckets, driven in
process (the ASGI middleware called directly, the limiter on a fake clock): exactly the limit
passes and one byte more is refused, the report route has its own limit, a streamed body is
counted byte for byte, `+json` types are JSON, and the buckets forget refilled keys before the
recently used ones."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from api.body import BodyLimitMiddleware, parse_spec
from api.errors import ApiError
from api.ratelimit import Limit, RateLimiter, retry_after
from tests.support.api_harness import TINY_SPEC

LIMIT = 1000
REPORT_LIMIT = 5000


async def _echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body, then answers 200 with its length (what a route would do)."""
    n = 0
    while True:
        msg = await receive()
        n += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(n).encode()})


def _post(path: str, chunks: list[bytes], content_length: int | None) -> tuple[int, bytes]:
    """Status and body of one request through the limit; `content_length` None = chunked."""
    mw = BodyLimitMiddleware(_echo_app, max_bytes=LIMIT, max_report_bytes=REPORT_LIMIT)
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    scope = {"type": "http", "path": path, "headers": headers}
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(mw(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_announced_length_at_the_limit_passes_and_one_more_is_refused() -> None:
    assert _post("/v1/jobs", [b"x" * LIMIT], LIMIT) == (200, str(LIMIT).encode())
    status, body = _post("/v1/jobs", [b"x" * (LIMIT + 1)], LIMIT + 1)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "payload_too_large"


def test_streamed_body_is_counted_byte_for_byte() -> None:
    """Chunked: 4 x 250 bytes is the limit exactly; one byte more in the last chunk is 413."""
    assert _post("/v1/jobs", [b"y" * 250] * 4, None) == (200, b"1000")
    status, body = _post("/v1/jobs", [b"y" * 250] * 3 + [b"y" * 251], None)
    assert status == 413
    assert f"{LIMIT} byte limit" in json.loads(body)["error"]["message"]


def test_report_route_has_its_own_larger_limit() -> None:
    """A 3000-byte report batch passes (over the user limit, under the report one)."""
    assert _post("/v1/jobs/j1/report", [b"z" * 3000], 3000) == (200, b"3000")
    assert _post("/v1/jobs/j1/report", [b"z" * 3000], None) == (200, b"3000")
    assert _post("/v1/jobs/j1/report", [b"z" * 5001], 5001)[0] == 413
    assert _post("/v1/jobs/j1/reports-ish", [b"z" * 3000], 3000)[0] == 413
    assert _post("/v1/jobs", [b"z" * 3000], 3000)[0] == 413


def test_vendor_json_and_case_of_the_content_type() -> None:
    """`application/vnd.x+json` and `Application/JSON; charset=utf-8` are JSON; YAML by type."""
    body = json.dumps({**TINY_SPEC, "name": "plus-json"}).encode()
    assert parse_spec(body, "application/vnd.ringtrain+json").name == "plus-json"
    assert parse_spec(body, "Application/JSON; charset=utf-8").name == "plus-json"
    assert parse_spec(b"name: yaml-job\n" + _yaml_rest(), "text/yaml").name == "yaml-job"
    with pytest.raises(ApiError) as e:
        parse_spec(body, "text/plain")
    assert e.value.status == 415


def _yaml_rest() -> bytes:
    import yaml

    rest = {k: v for k, v in TINY_SPEC.items() if k != "name"}
    return yaml.safe_dump(rest).encode()


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert [retry_after(w) for w in (0.0, 0.02, 1.0, 1.2, 2.5)] == ["1", "1", "1", "2", "3"]


def test_pruning_keeps_recent_and_unrefilled_buckets() -> None:
    """Past `max_keys` the refilled buckets go first (a new key's full bucket among them), then
    the least recently used down to 90 %: a key used just now keeps its spent bucket (it is not
    handed a fresh burst), and a key that has not refilled is not forgotten while older ones are."""
    now = [0.0]
    rl = RateLimiter({"k": Limit(1.0, 2)}, max_keys=10, clock=lambda: now[0])
    for i in range(10):  # ten keys, each with one of its two tokens spent
        assert rl.take("k", f"a{i}") == 0.0
    now[0] = 0.5  # half refilled: 1.5 < 2, none of them equals a fresh bucket
    assert rl.take("k", "a0") == 0.0  # a0 is now the most recent key, 0.5 tokens left
    rl.take("k", "new")  # the 11th key: its full bucket is dropped, then a1 (least recent)
    assert sorted(k for _, k in rl._buckets) == [
        "a0",
        "a2",
        "a3",
        "a4",
        "a5",
        "a6",
        "a7",
        "a8",
        "a9",
    ]
    assert rl.take("k", "a0") == pytest.approx(0.5)  # still spent: waits half a token
