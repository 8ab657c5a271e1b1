"""What the server process sets up around serving: the open-file limit, a free port checked before
the model loads, and the event loop it serves on."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")


def raise_open_file_limit(target: int = 65536) -> None:
    """Raise the soft limit on open files toward the hard one (as vLLM does): each connection is a
    file, and a soft limit of 1024 would refuse connections far below --limit-concurrency."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            logger.warning("could not raise the open-file limit from %d to %d", soft, want)


def check_port_free(host: str | None, port: int) -> None:
    """Refuse a port that is taken before the model loads (as vLLM does), not minutes later."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if host and ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is fine
        try:
            s.bind((host if host is not None else "0.0.0.0", port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host or '0.0.0.0'}:{port}: {e.strerror or e}; "
                             "is another server running there? Pick another --port.") from None


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (vLLM serves on it too): its socket writes and callbacks
    cost a fraction of asyncio's selector loop's, and a streaming server does one of each per chunk."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
