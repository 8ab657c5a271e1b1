"""ASGI middleware of the server: header limits, shutdown draining, API keys. Each refusal has
OpenAI's error body.

Order, outermost first: CORS (answers preflights), framing, header limits, draining, API key, the app.
"""

from __future__ import annotations

import hmac
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.admission import AdmissionController, shutting_down_error
from pagedllm.entrypoints.openai.errors import APIError

# Paths that answer without an API key and while draining (probes and monitoring). Everything else
# needs the key when --api-key is set, /docs and /openapi.json included.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class AmbiguousFramingMiddleware:
    """A request with both Content-Length and Transfer-Encoding is answered, then its connection is
    closed (RFC 9112 section 6.1): a front proxy may have framed it differently, so bytes after it on
    the connection may belong to a request smuggled past the proxy."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {k for k, _ in scope["headers"]}
        if b"content-length" not in names or b"transfer-encoding" not in names:
            await self.app(scope, receive, send)
            return

        async def send_and_close(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_and_close)


class HeaderLimitMiddleware:
    """431 for a request with more than `max_count` headers, or more than `max_bytes` of them.

    h11 (--h11-max-incomplete-event-size) already refuses, with a plain 400, a header block that
    grows past the size while it is still arriving; one that arrives whole in a single read is
    parsed regardless, so the size is checked again here, where the answer can be OpenAI's body.
    """

    def __init__(self, app: ASGIApp, max_count: int, max_bytes: int) -> None:
        self.app = app
        self.max_count = max_count
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
            problem = None
            if len(headers) > self.max_count:
                problem = f"{len(headers)} headers; the limit is {self.max_count} (--h11-max-header-count)"
            elif size > self.max_bytes:
                problem = f"{size} bytes of headers; the limit is {self.max_bytes} (--h11-max-incomplete-event-size)"
            if problem is not None:
                err = APIError(
                    f"The request has {problem}.", HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                    headers={"Connection": "close"},
                )
                await err.to_json_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class DrainMiddleware:
    """While the server drains for shutdown, every new request but the probes gets 503."""

    def __init__(self, app: ASGIApp, admission: AdmissionController) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.admission.draining and scope["path"] not in OPEN_PATHS:
            self.admission.on_reject("shutting_down")
            await shutting_down_error().to_json_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches one of the keys (constant-time compare;
    every key is compared so timing does not tell which one was close).

    `login_pages` maps a path a browser opens (the web console's /ui) to the HTML answered, with
    401, to a GET without the key: a form that asks for it, instead of a JSON error.
    """

    def __init__(self, app: ASGIApp, keys: list[str], login_pages: dict[str, bytes] | None = None) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.login_pages = login_pages or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(given, key)
        if ok:
            await self.app(scope, receive, send)
            return
        page = self.login_pages.get(scope["path"])
        if page is not None and scope["method"] == "GET":
            await HTMLResponse(page, status_code=HTTPStatus.UNAUTHORIZED)(scope, receive, send)
            return
        message = "Missing API key: send `Authorization: Bearer <key>`." if not auth else "Incorrect API key provided."
        err = APIError(message, HTTPStatus.UNAUTHORIZED, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.to_json_response()(scope, receive, send)
