"""Graceful shutdown: SIGTERM (or Ctrl-C) drains the server instead of dropping requests.

    SIGTERM -> new requests get 503 (probes too: /health says shutting down)
            -> requests in flight run to their end, for up to --shutdown-timeout seconds
            -> what is left ends with a 503 error (an error event then [DONE] when streaming)
            -> uvicorn closes the connections, the process exits 0
    SIGHUP, or a second SIGTERM / SIGINT, stops now: every request in flight ends at once with that
    503 error (an error event then [DONE] when streaming), given FLUSH_S to reach its client; the log
    says how many were ended and how many could not be told. A third signal exits without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Generator
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

    def __init__(
        self,
        config: uvicorn.Config,
        on_drain: Callable[[], Awaitable[None]],
        on_stop: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.on_stop = on_stop
        self.drain_started = False
        self.stop_started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's SIGINT / SIGTERM handlers, plus SIGHUP (whose default would kill the process
        with every stream cut mid-answer)."""
        with super().capture_signals():
            hup = getattr(signal, "SIGHUP", None)
            if hup is None or threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(hup, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(hup, previous)

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        name = signal.Signals(sig).name
        if loop is None or self.stop_started or (self.on_stop is None and self.drain_started):
            logger.warning("received %s again: exiting without waiting for requests", name)
            self.should_exit = True
            self.force_exit = True
            return
        if self.drain_started or sig == getattr(signal, "SIGHUP", None):
            self.stop_started = True
            logger.info("received %s: stopping now", name)
            loop.call_soon_threadsafe(self._start_stop, name)
            return
        self.drain_started = True
        logger.info("received %s: draining", name)
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.on_drain())

    def _start_stop(self, signal_name: str) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()  # its "every request finished" would no longer be true
        assert self.on_stop is not None
        self._stop_task = asyncio.ensure_future(self.on_stop(signal_name))


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


async def stop_now(
    server: uvicorn.Server, engine: AsyncLLM, admission: AdmissionController, signal_name: str
) -> None:
    """End every request in flight with a 503 error now, give the errors FLUSH_S to reach their
    clients, then tell uvicorn to exit."""
    loop = asyncio.get_running_loop()
    admission.draining = True
    err = shutting_down_error(f"The server was stopped ({signal_name}) before this request finished.")
    engine.refuse_new_requests(err)
    in_flight = admission.num_requests
    failed = engine.fail_all_requests(err)
    logger.warning(
        "%s: ending %d requests in flight (%d engine requests; a request not yet in the engine is refused "
        "there) with an error",
        signal_name, in_flight, failed,
    )
    grace = loop.time() + FLUSH_S
    while admission.num_requests and loop.time() < grace:
        await asyncio.sleep(POLL_S)
    if admission.num_requests:
        logger.warning(
            "%s: %d of them had not sent their error after %g s; their connections are closed without it",
            signal_name, admission.num_requests, FLUSH_S,
        )
    else:
        logger.info("%s: every request in flight was sent its error", signal_name)
    server.should_exit = True
