"""--enable-request-id-headers: every response carries `X-Request-Id` (vLLM's flag).

The client's own `X-Request-Id` is echoed back (so a proxy's id follows the request through);
otherwise a new one is made. A pure ASGI middleware: streaming responses pass through untouched.
"""

from __future__ import annotations

import secrets
from typing import Any

HEADER = b"x-request-id"


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k.lower() == HEADER), None)
        request_id = given or secrets.token_hex(16).encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
