"""Connection limits of the server: uvicorn's h11 protocol with a read timeout and a connection cap.

uvicorn closes a keep-alive connection idle between requests after `--timeout-keep-alive` seconds,
but waits forever for a connection's first request and for headers or a body that trickle in
(slowloris). This protocol adds:

- `--timeout-request-read`: a request's headers and body must arrive within this many seconds of its
  first byte (of the connection's opening, for its first request). Past it: 408 and close when the
  headers are still incomplete; the connection closed when the body is (the handler sees a
  disconnect; nothing was admitted yet).
- `--limit-concurrency`: at most this many open connections; one more gets a 503 in OpenAI's shape
  and is closed at once, so idle sockets cannot crowd out the clients being served.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("pagedllm.entrypoints.openai")


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                   "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


def make_protocol_class(timeout_request_read: float | None, limit_concurrency: int | None) -> type[H11Protocol]:
    """An H11Protocol subclass with these limits (uvicorn takes a class as `http=`)."""

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._read_timer: asyncio.TimerHandle | None = None
            self._refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if limit_concurrency is not None and len(self.connections) > limit_concurrency:
                self._refused = True
                logger.warning("refusing a connection: %d open, the limit is %d (--limit-concurrency)",
                               len(self.connections) - 1, limit_concurrency)
                transport.write(_raw_response(
                    503, "Service Unavailable",
                    f"The server has {limit_concurrency} open connections, its limit (--limit-concurrency). "
                    "Retry later.", "server_overloaded",
                ))
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            # A new request starts reading when no request is being read (the previous one's body is
            # complete) and its first bytes come in.
            if self._read_timer is None and (self.cycle is None or not self.cycle.more_body):
                self._arm()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.more_body:
                self._disarm()  # this request is read; the next one arms the timer again

        def _arm(self) -> None:
            if timeout_request_read is not None and self._read_timer is None:
                self._read_timer = self.loop.call_later(timeout_request_read, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete:
                return  # a pipelined request waits for the answer being sent; that is not slow reading
            if self.cycle is None or self.cycle.response_complete:
                # Headers incomplete (or none at all): no handler runs, answer 408 ourselves.
                self.transport.write(_raw_response(
                    408, "Request Timeout",
                    f"The request was not received within {timeout_request_read:g} s (--timeout-request-read).",
                    "request_timeout",
                ))
            logger.info("closing a connection whose request did not arrive within %g s (--timeout-request-read)",
                        timeout_request_read)
            self._unset_keepalive_if_required()
            self.transport.close()

    return LimitedH11Protocol
