"""Request-body limits and job-spec parsing (JSON or YAML)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, error_body, from_pydantic
from workers.config import JobSpec, load_spec

YAML_TYPES = {"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"}
JSON_TYPES = {"application/json", ""}


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the limit; handled as a 413 everywhere."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds the {limit} byte limit")


class BodyLimitMiddleware:
    """413 for bodies over the limit, whether announced by Content-Length or streamed (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_report_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_report_bytes = max_report_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_report_bytes if scope["path"].endswith("/report") else self.max_bytes
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = 0
                if n > limit:
                    await _too_large(send, limit)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _too_large(send, limit)


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        error_body("payload_too_large", f"the request body exceeds the {limit} byte limit")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


M = TypeVar("M", bound=BaseModel)


def parse_json_body(body: bytes, model: type[M], what: str) -> M:
    """A request model from a JSON body: 400 when it is not JSON, 422 naming the field when it
    does not validate (`what` names the request in the message)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ApiError(
            400, f"the request body is not valid JSON: {e}", code="malformed_json"
        ) from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_pydantic(e, what) from e


def parse_spec(body: bytes, content_type: str | None) -> JobSpec:
    """A JobSpec from a JSON or YAML body; 400 for unparsable input, 422 naming the field
    otherwise."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, "the request body is not UTF-8 text", code="malformed_body") from e
    if ctype in YAML_TYPES:
        import yaml

        try:
            return load_spec(text)
        except ValidationError as e:
            raise from_pydantic(e) from e
        except (yaml.YAMLError, RecursionError) as e:
            raise ApiError(
                400,
                f"the YAML job spec could not be parsed: {_first_line(e)}",
                code="malformed_yaml",
            ) from e
        except ValueError as e:
            raise ApiError(422, str(e), code="validation_error") from e
    if ctype not in JSON_TYPES and not ctype.endswith("+json"):
        raise ApiError(
            415, f"send the job spec as application/json or application/yaml, not {ctype!r}"
        )
    try:
        data: Any = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise ApiError(
            400, f"the request body is not valid JSON: {_first_line(e)}", code="malformed_json"
        ) from e
    if not isinstance(data, dict):
        raise ApiError(422, "a job spec must be a JSON object", code="validation_error")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise from_pydantic(e) from e


def check_data_path(spec: JobSpec, roots: list[Path]) -> None:
    """`data.path` (and a held-out dataset's `data.validation`) must resolve (symlinks included)
    inside one of the allowed data roots."""
    if spec.data.kind in ("text", "tokens"):
        check_path_in_roots(spec.data.path, roots, "data.path")
    if spec.data.kind == "tokens" and isinstance(spec.data.validation, str):
        check_path_in_roots(spec.data.validation, roots, "data.validation")


def check_path_in_roots(path: str, roots: list[Path], field: str) -> Path:
    """`path` resolved (symlinks included), refused unless inside one of the allowed data roots."""
    # expanduser raises RuntimeError for an unknown ~user; resolve raises ValueError for a NUL byte
    # and OSError/RuntimeError for a symlink loop: all are the caller's bad path, not a server error
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as e:
        raise ApiError(422, f"{field} cannot be resolved: {e}", field=field) from e
    if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise ApiError(
            422,
            f"{field} {resolved} is outside the allowed data roots ({allowed}); "
            "set RINGTRAIN_DATA_ROOTS to allow it",
            field=field,
        )
    return resolved


def _first_line(e: BaseException) -> str:
    s = str(e) or type(e).__name__
    return s.splitlines()[0][:300]
