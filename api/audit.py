"""The audit trail: one row per authenticated request to a /v1 route that can change something
(POST, PUT, PATCH, DELETE: create, cancel, and whatever such route comes next), with who (the
token's owner), what (action, route, job id), when, from where (client address) and how it ended
(HTTP status, and `ok` or the error code).

Written by a middleware when the response starts, before the client sees it: a client that reads
/v1/audit after its request always finds the row, and no route can forget to write one. Not written:
requests without a valid token and throttled ones (401/429 cost nothing; access logs and the
rate-limit counters cover them), the drivers' report route (ingest tokens, not people) and routes
that only compute (`/v1/plan`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import status_code_name
from service.store import Store

log = logging.getLogger("ringtrain.audit")

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
NOT_AUDITED = frozenset({"/v1/jobs/{job_id}/report", "/v1/plan"})
ACTIONS = {("POST", "/v1/jobs"): "job.create", ("POST", "/v1/jobs/{job_id}/cancel"): "job.cancel"}


def _location_job(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The created job's id from `Location: /v1/jobs/<id>`."""
    for k, v in headers:
        if k.lower() == b"location":
            path = v.decode("latin-1")
            if path.startswith("/v1/jobs/"):
                return path.removeprefix("/v1/jobs/").split("/", 1)[0] or None
    return None


class AuditMiddleware:
    def __init__(self, app: ASGIApp, store: Store) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in MUTATING
            or not scope["path"].startswith("/v1/")
        ):
            await self.app(scope, receive, send)
            return
        recorded = False

        async def _send(msg: Message) -> None:
            nonlocal recorded
            if msg["type"] == "http.response.start" and not recorded:
                recorded = True
                await self._record(scope, msg["status"], msg.get("headers", []))
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        except Exception:
            if not recorded:
                await self._record(scope, 500, [])
            raise

    async def _record(self, scope: Scope, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        state: dict[str, Any] = scope.get("state") or {}
        owner = state.get("owner")
        route = getattr(scope.get("route"), "path", None)
        if not owner or route is None or route in NOT_AUDITED:
            return
        method = scope["method"]
        job_id = (scope.get("path_params") or {}).get("job_id") or (
            _location_job(headers) if status < 300 else None
        )
        outcome = state.get("audit_outcome") or ("ok" if status < 400 else status_code_name(status))
        client = scope.get("client")
        row = {
            "time": time.time(),
            "owner": str(owner)[:200],
            "action": ACTIONS.get((method, route), f"{method} {route}")[:64],
            "method": method,
            "route": route[:200],
            "job_id": str(job_id)[:64] if job_id else None,
            "status": status,
            "outcome": str(outcome)[:64],
            "client": (client[0] if client else "unknown")[:100],
        }
        try:
            await asyncio.to_thread(self.store.audit.record, **row)
        except (
            Exception
        ) as e:  # the answer is decided already; a store outage must not turn it into a 500
            log.error(
                "audit row not written (%s): %s",
                type(e).__name__,
                {k: row[k] for k in ("owner", "action")},
            )
