"""Browser hardening headers on every response.

The dashboard is plain files from /static (no inline script or style; the JS sets styles through the
CSSOM, which CSP allows), so one strict policy fits it and the JSON API alike: everything from this
origin only, no plugins, no <base>, and no framing (clickjacking). FastAPI's /docs and /redoc pages
load Swagger UI / ReDoc from a CDN with an inline bootstrap script; they keep everything but the
CSP's source lists (framing is still refused), because a strict policy would only break them.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "font-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
DOCS_CSP = "frame-ancestors 'none'"
DOCS_PATHS = ("/docs", "/redoc")

HEADERS = {
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",  # frame-ancestors for browsers that predate it
    "cross-origin-opener-policy": "same-origin",
}


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.common = [(k.encode(), v.encode()) for k, v in HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        csp = DOCS_CSP if path.startswith(DOCS_PATHS) else CSP
        extra = [*self.common, (b"content-security-policy", csp.encode())]

        async def _send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                names = {k.lower() for k, _ in msg.get("headers", [])}
                msg["headers"] = [*msg.get("headers", []), *(h for h in extra if h[0] not in names)]
            await send(msg)

        await self.app(scope, receive, _send)
