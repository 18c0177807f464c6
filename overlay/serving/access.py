"""One API key on every route of the server.

vLLM's own `--api-key` / `VLLM_API_KEY` guards only paths under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py): /tokenize, /metrics, /load, /server_info
and, with VLLM_SERVER_DEV_MODE=1, /collective_rpc, /pause, /sleep stay open. This middleware,
installed by the overlay's endpoint plugin when `VLLM_API_KEY` is set in the API server's
environment (`moe-overlay serve` puts `server.api_key` there, never on a command line),
guards every path. The key is compared as a hash, in constant time, and never echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .config import API_KEY_ENV

UNAUTHORIZED = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
WEBSOCKET_POLICY_VIOLATION = 1008


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class RequireKey:
    """Pure ASGI middleware: every HTTP and WebSocket request needs `Authorization: Bearer KEY`
    (CORS preflight OPTIONS requests carry no credentials and pass, as in vLLM's own)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._digest = _digest(key)

    def allows(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS"
        if not guarded or self.allows(Headers(scope=scope)):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": WEBSOCKET_POLICY_VIOLATION})
        else:
            await JSONResponse({"error": UNAUTHORIZED}, status_code=401)(scope, receive, send)


def install(app: Any) -> bool:
    """Guard every route of `app` when a key is set; True when it did."""
    key = os.environ.get(API_KEY_ENV)
    if not key:
        return False
    app.add_middleware(RequireKey, key=key)
    return True
