"""The API key check (`--api-key`), as vLLM's."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from compiled.server.protocol import APIError


class RequireKey:
    """ASGI middleware: a /v1 request without `Authorization: Bearer <key>` is a 401 (as vLLM's
    --api-key; /health, /metrics and the rest stay open). Plain ASGI, so streamed responses and
    disconnects pass through untouched."""

    def __init__(self, app, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(401, "this server needs an API key: send `Authorization: Bearer <key>`")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
