"""Reading request bodies and writing streams, safely against careless or hostile clients.

- Bodies: 413 past the size limit before they are buffered, 400 for anything but a JSON object;
  decoding and validation in bounded time (json_body.py, limits.py), large bodies in a thread.
- A client that disconnects while its answer is computed cancels that work (its engine requests
  are aborted and their KV blocks freed).
- A stream whose client leaves, or stops reading (a send that makes no progress for
  `write_timeout` seconds), ends; the engine requests behind it are aborted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import APIError, from_validation_error
from pagedllm.entrypoints.openai.json_body import check_json_size, decode_json, json_kind
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.serving_engine import EventStream

logger = logging.getLogger("pagedllm.entrypoints.openai")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in a thread,
# in bounded time (json_body.py), so that one thread's hold on the GIL stays short.
PARSE_INLINE_BYTES = 64 * 1024
# Scope key through which a stream reports that its client stopped reading.
STALL_KEY = "pagedllm.stalled"


# -- request bodies -----------------------------------------------------------------------------------
async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, or APIError: 413 past max_bytes (checked before buffering when Content-Length
    says so), 400 for a non-JSON content type or an empty body."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        main = ctype.split(";", 1)[0].strip().lower()
        if main != "application/json" and not main.endswith("+json"):
            raise APIError(f"Content-Type must be application/json, got {main[:64]!r}.")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(
            f"The request body is {int(length)} bytes; the limit is {max_bytes} bytes (--max-request-body-bytes).",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(
                    f"The request body is larger than the limit of {max_bytes} bytes (--max-request-body-bytes).",
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                )
            chunks.append(chunk)
    except ClientDisconnect:
        # Gone, or closed by --timeout-request-read while its body trickled in: nobody reads an answer.
        raise APIError("The client disconnected before sending the whole body.") from None
    body = b"".join(chunks)
    if not body.strip():
        raise APIError("The request body is empty; send a JSON object.")
    return body


def parse_request(body: bytes, select: Callable[[dict[str, Any]], type[M]], limits: ServerLimits) -> M:
    """Bounded work whatever the body: size estimate, decode, list counts, then typed validation of
    the model `select(obj)` picks."""
    check_json_size(body, limits.max_json_values)
    obj = decode_json(body)
    if not isinstance(obj, dict):
        raise APIError(f"The request body must be a JSON object, got {json_kind(obj)}.")
    limits.check_counts(obj)
    try:
        return select(obj).model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _parse_in_thread(
    body: bytes, select: Callable[[dict[str, Any]], type[M]], limits: ServerLimits
) -> tuple[M | None, APIError | None]:
    """parse_request, returning its error instead of raising it: the decoded body is freed here, in the
    thread (freeing millions of objects takes time too), not by a traceback later on the loop."""
    try:
        return parse_request(body, select, limits), None
    except APIError as e:
        e.__traceback__ = e.__context__ = e.__cause__ = None
        return None, e


async def read_request(
    request: Request, select: type[M] | Callable[[dict[str, Any]], type[M]], max_bytes: int, limits: ServerLimits
) -> M:
    """Read, decode and validate a request body as the model `select` is (or returns for the object)."""
    pick = (lambda _: select) if isinstance(select, type) else select
    body = await read_body(request, max_bytes)
    if len(body) <= PARSE_INLINE_BYTES:
        return parse_request(body, pick, limits)
    parsed, err = await asyncio.to_thread(_parse_in_thread, body, pick, limits)
    if err is not None:
        raise err
    assert parsed is not None
    return parsed


# -- disconnects ----------------------------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _discard(result: Any) -> None:
    """A result nobody will send: a stream must still be closed, or its requests would run on."""
    if isinstance(result, EventStream):
        result.close()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (its requests are aborted) and
    return None. The body must already have been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            _discard(await task)  # it may have finished before the cancel landed
        except (asyncio.CancelledError, Exception):
            pass
        return None
    finally:
        watcher.cancel()
        task.cancel()


class SSEResponse(StreamingResponse):
    """text/event-stream that watches for the client leaving (Starlette only does on ASGI spec
    < 2.4) or no longer reading, and aborts the engine requests behind the stream however it ends.

    A client that keeps the connection open but stops reading fills the socket buffers; the next
    send then waits. Past `write_timeout` seconds of one send making no progress the stream ends:
    the requests are aborted, and the connection is closed by the server (the response is left
    incomplete, so uvicorn drops it).
    """

    def __init__(self, stream: EventStream, write_timeout: float | None = None) -> None:
        super().__init__(
            stream.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.event_stream = stream
        self.write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.write_timeout
        loop = asyncio.get_running_loop()
        # One watchdog per stream instead of a timeout scope per send: a stream writes a chunk per
        # step, and arming a cancel scope for each cost more than the write (BENCHMARKS.md, issue 16).
        # A send that makes no progress for `timeout` s is caught within timeout * 1.25.
        send_started: float | None = None  # loop time the send in progress began

        async def timed_send(message: Message) -> None:
            nonlocal send_started
            send_started = loop.time()
            try:
                await send(message)
            finally:
                send_started = None

        try:
            async with anyio.create_task_group() as tg:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(timed_send if timeout is not None else send)
                    except OSError:
                        pass  # the client went away mid-write
                    tg.cancel_scope.cancel()

                async def watchdog(timeout: float) -> None:
                    while True:
                        await asyncio.sleep(timeout / 4)
                        if send_started is not None and loop.time() - send_started >= timeout:
                            logger.warning("a streaming client stopped reading for %s s; aborting its request", timeout)
                            scope.get(STALL_KEY, {})["stalled"] = True
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(stream_then_stop)
                if timeout is not None:
                    tg.start_soon(watchdog, timeout)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.event_stream.close()


class ResetStalledConnections:
    """The outermost ASGI wrapper (outside Starlette's own): when a stream ended because its client
    stopped reading, reset the TCP connection. A graceful close would wait, forever, to flush the
    megabytes the client never reads, keeping the socket and its buffers.

    It needs the server's transport, which uvicorn's `send` (a bound method of its request cycle)
    carries; with another server the connection is merely closed.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        flag: dict[str, bool] = {}
        scope[STALL_KEY] = flag
        try:
            await self.app(scope, receive, send)
        finally:
            if flag.get("stalled"):
                _reset(send)


def _reset(send: Send) -> None:
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:  # linger 0: close() sends RST and drops the unsent bytes
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
