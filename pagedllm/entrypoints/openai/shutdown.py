"""Graceful shutdown: SIGTERM (or Ctrl-C) drains the server instead of dropping requests.

    SIGTERM -> new requests get 503 (probes too: /health says shutting down)
            -> requests in flight run to their end, for up to --shutdown-timeout seconds
            -> what is left ends with a 503 error (an error event then [DONE] when streaming)
            -> uvicorn closes the connections, the process exits 0
    a second SIGTERM / SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.admission import AdmissionController, shutting_down_error

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

# After the timeout, how long the handlers get to write the error to their clients.
FLUSH_S = 2.0
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM / SIGINT starts `on_drain` (which sets should_exit when
    done) instead of stopping at once. The signal is not re-raised after serving, so a drained
    server exits with its own status (0), not as killed by SIGTERM."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.drain_started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if self.drain_started or loop is None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self.drain_started = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.on_drain())


async def drain(server: uvicorn.Server, engine: AsyncLLM, admission: AdmissionController, timeout: float) -> None:
    """Refuse new work, let admitted requests finish for up to `timeout` seconds, fail the rest,
    then tell uvicorn to exit."""
    loop = asyncio.get_running_loop()
    admission.draining = True
    logger.info(
        "draining: %d requests in flight, waiting up to %s s for them (--shutdown-timeout)",
        admission.num_requests, timeout,
    )
    deadline = loop.time() + timeout
    while admission.num_requests and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    if admission.num_requests:
        err = shutting_down_error(
            f"The server shut down before this request finished (--shutdown-timeout {timeout:g} s)."
        )
        engine.refuse_new_requests(err)
        failed = engine.fail_all_requests(err)
        logger.warning(
            "shutdown timeout: ending %d requests (%d engine requests) with an error",
            admission.num_requests, failed,
        )
        grace = loop.time() + FLUSH_S
        while admission.num_requests and loop.time() < grace:
            await asyncio.sleep(POLL_S)
    else:
        logger.info("drained: every request finished")
    server.should_exit = True
