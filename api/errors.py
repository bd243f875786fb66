"""One error shape for every 4xx/5xx answer:

    {"error": {"code": "validation_error", "message": "…", "field": "data.seq_len" | null,
               "details": [...]}}

`field` is the dotted path of the offending input (body fields without a "body." prefix; query and
path parameters by name). `details` lists every problem when there are several.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.store import JobNotFound, StoreError

log = logging.getLogger("ringtrain.api")

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "too_many_requests",
    500: "internal_error",
    503: "unavailable",
}
_UNION_TAGS = {"passkey", "text"}  # discriminator tags pydantic puts into locations of `data`


def status_code_name(status: int) -> str:
    """The error shape's `code` for a status (e.g. 404 → "not_found")."""
    return _STATUS_CODES.get(status, "error")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        field: str | None = None,
        details: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code or _STATUS_CODES.get(status, "error")
        self.message = message
        self.field = field
        self.details = details or []
        self.headers = headers
        self.extra = extra or {}


def error_body(
    code: str,
    message: str,
    field: str | None = None,
    details: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "error": {"code": code, "message": message, "field": field, "details": details or []},
        **extra,
    }


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    if len(parts) >= 2 and parts[0] == "data" and parts[1] in _UNION_TAGS:
        parts = [parts[0], *parts[2:]]
    return ".".join(parts)


def _details(errors: list[Any]) -> list[dict[str, Any]]:
    out = []
    for e in errors:
        loc = e.get("loc", ())
        d = {
            "field": field_path(loc) or None,
            "message": e.get("msg", ""),
            "type": e.get("type", ""),
        }
        if loc and loc[0] in ("query", "path", "header"):
            d["in"] = loc[0]
        out.append(d)
    return out


def validation_error(errors: list[Any], what: str = "request") -> ApiError:
    details = _details(errors)
    first = details[0] if details else {"field": None, "message": "invalid input"}
    where = f"{first['field']}: " if first["field"] else ""
    more = f" (and {len(details) - 1} more problem(s), see details)" if len(details) > 1 else ""
    return ApiError(
        422,
        f"invalid {what}: {where}{first['message']}{more}",
        field=first["field"],
        details=details,
    )


def from_pydantic(e: ValidationError, what: str = "job spec") -> ApiError:
    return validation_error(e.errors(include_input=False, include_url=False), what)


def _respond(err: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(err.code, err.message, err.field, err.details, **err.extra),
        status_code=err.status,
        headers=err.headers,
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return _respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errs):
            return _respond(
                ApiError(
                    400,
                    "the request body is not valid JSON: " + errs[0].get("msg", ""),
                    code="malformed_json",
                )
            )
        return _respond(validation_error(errs))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # our routes answer with ApiError; a Starlette 404 is the router's (or StaticFiles')
        # "no such path"
        if exc.status_code == 404:
            msg = "no such endpoint; see /docs for the API"
        else:
            msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return _respond(ApiError(exc.status_code, msg, headers=getattr(exc, "headers", None)))

    @app.exception_handler(JobNotFound)
    async def _nf(_: Request, exc: JobNotFound) -> JSONResponse:
        return _respond(ApiError(404, f"job {exc.args[0]} not found", field="id"))

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> JSONResponse:
        log.error("store unavailable: %s", exc)
        return _respond(
            ApiError(
                503,
                "the job store is unavailable; retry shortly",
                code="store_unavailable",
                headers={"Retry-After": "5"},
            )
        )

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _respond(ApiError(500, f"internal error ({type(exc).__name__}); see the server log"))
