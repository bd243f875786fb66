"""Shared request dependencies: the application context and authentication.

User routes take `Authorization: Bearer <API token>` → owner (constant-time compare against every
configured token). The report route takes the job's ingest token instead; neither kind works on the
other's routes. Tokens are never logged.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError
from api.telemetry import Telemetry
from service.controller import Controller
from service.hub import Hub
from service.launcher import ClusterInfo, Launcher
from service.settings import Settings
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
    _cluster: tuple[float, ClusterInfo] | None = field(default=None, repr=False)

    async def cluster(self, max_age_s: float = 5.0) -> ClusterInfo:
        """The launcher's cluster view, cached briefly; raises whatever the launcher raises."""
        now = time.monotonic()
        if self._cluster is not None and now - self._cluster[0] < max_age_s:
            return self._cluster[1]
        info = await asyncio.wait_for(asyncio.to_thread(self.launcher.cluster), timeout=10)
        self._cluster = (now, info)
        return info


def get_ctx(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx  # set by `api.app.create_app`
    return ctx


bearer = HTTPBearer(auto_error=False, description="an API token (user routes) or a job's ingest token (reports)")

_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


def owner_of(tokens: dict[str, str], presented: str) -> str | None:
    found = None
    for token, owner in tokens.items():  # no early exit: timing does not depend on which token matched
        if hmac.compare_digest(token.encode(), presented.encode()):
            found = owner
    return found


def current_owner(
    ctx: Annotated[AppContext, Depends(get_ctx)],
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    if creds is None or not creds.credentials:
        raise ApiError(
            401,
            "missing API token: send 'Authorization: Bearer <token>' (see ~/.ringtrain/token)",
            headers=_UNAUTHORIZED,
        )
    owner = owner_of(ctx.tokens, creds.credentials)
    if owner is None:
        raise ApiError(401, "invalid API token", headers=_UNAUTHORIZED)
    return owner


Ctx = Annotated[AppContext, Depends(get_ctx)]
Owner = Annotated[str, Depends(current_owner)]
