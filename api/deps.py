"""Shared request dependencies: the application context, authentication and rate limits.

User routes take `Authorization: Bearer <API token>` → owner (constant-time compare against every
configured token; a configured `sha256:<hex>` entry is compared with the presented token's digest).
The report route takes the job's ingest token instead; neither kind works on the other's routes.
Tokens are never logged. Each authenticated request takes one unit of its token's rate limit; a
request without a valid token takes one of its client address's (`api.ratelimit`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError
from api.ratelimit import RateLimiter, retry_after
from api.telemetry import Telemetry
from service.controller import Controller
from service.hub import Hub
from service.launcher import ClusterInfo, Launcher
from service.leader import Leadership
from service.settings import HASHED_PREFIX, Settings
from service.store import Store


@dataclass
class AppContext:
    settings: Settings
    store: Store
    hub: Hub
    launcher: Launcher
    controller: Controller
    tokens: dict[str, str]
    telemetry: Telemetry
    limiter: RateLimiter
    leadership: Leadership | None = None  # None: the app runs no control loops (tests)
    # why the last background check could not reach Ray (`api.routers.health`); None: it could
    ray_down: Callable[[], str | None] = field(default=lambda: None, repr=False)
    _cluster: tuple[float, ClusterInfo] | None = field(default=None, repr=False)

    async def cluster(self, max_age_s: float = 5.0) -> ClusterInfo:
        """The launcher's cluster view, cached briefly; raises whatever the launcher raises, and at
        once while the background check finds Ray unreachable (a request never waits on it)."""
        now = time.monotonic()
        if self._cluster is not None and now - self._cluster[0] < max_age_s:
            return self._cluster[1]
        if (why := self.ray_down()) is not None:
            raise ConnectionError(f"the Ray cluster did not answer its last check ({why})")
        info = await asyncio.wait_for(asyncio.to_thread(self.launcher.cluster), timeout=10)
        self._cluster = (now, info)
        return info


def get_ctx(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx  # set by `api.app.create_app`
    return ctx


bearer = HTTPBearer(
    auto_error=False, description="an API token (user routes) or a job's ingest token (reports)"
)

_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


def owner_of(tokens: dict[str, str], presented: str) -> str | None:
    """The owner of the presented token. A hashed entry matches the presented token's SHA-256, never
    the presented text itself: someone who read `sha256:<hex>` from the configuration cannot log in
    with it."""
    raw = presented.encode()
    hashed = (HASHED_PREFIX + hashlib.sha256(raw).hexdigest()).encode()
    found = None
    for (
        entry,
        owner,
    ) in tokens.items():  # no early exit: timing does not depend on which token matched
        if hmac.compare_digest(entry.encode(), hashed if entry.startswith(HASHED_PREFIX) else raw):
            found = owner
    return found


_THROTTLED = {
    "api": "too many requests with this API token",
    "report": "too many report batches for this job",
    "unauth": "too many requests without a valid token from this address",
}


def throttle(ctx: AppContext, kind: str, key: str) -> None:
    """Take one unit of the (kind, key) bucket, or answer 429 with `Retry-After`."""
    wait = ctx.limiter.take(kind, key)
    if wait:
        ctx.telemetry.throttled.labels(kind).inc()
        lim = ctx.limiter.limits[kind]
        after = retry_after(wait)
        raise ApiError(
            429,
            f"{_THROTTLED[kind]} (limit {lim.rate:g}/s, bursts of {lim.burst}); retry in {after} s",
            headers={"Retry-After": after},
        )


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def current_owner(
    request: Request,
    ctx: Annotated[AppContext, Depends(get_ctx)],
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    if creds is None or not creds.credentials:
        throttle(ctx, "unauth", client_address(request))
        raise ApiError(
            401,
            "missing API token: send 'Authorization: Bearer <token>' (see ~/.ringtrain/token)",
            headers=_UNAUTHORIZED,
        )
    owner = owner_of(ctx.tokens, creds.credentials)
    if owner is None:
        throttle(ctx, "unauth", client_address(request))
        raise ApiError(401, "invalid API token", headers=_UNAUTHORIZED)
    throttle(ctx, "api", hashlib.sha256(creds.credentials.encode()).hexdigest())
    request.state.owner = owner  # for the audit trail (api.audit)
    return owner


Ctx = Annotated[AppContext, Depends(get_ctx)]
Owner = Annotated[str, Depends(current_owner)]
