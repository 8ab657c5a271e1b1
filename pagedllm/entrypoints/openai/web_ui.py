"""The web console: a chat playground and a live view of the engine, on the API server itself.

    GET /                    -> redirect to /ui
    GET /ui                  the page (one self-contained HTML file: no CDN, the server may have no internet)
    GET /v1/engine/events    text/event-stream, one JSON snapshot (metrics/console_feed.py) per tick

On by default when the server binds a loopback address (127.0.0.0/8, ::1, localhost), off otherwise;
`--enable-web-ui` / `--no-enable-web-ui` decide explicitly. With `--api-key` the page and the event
stream need the key like the API: a browser that opens /ui without it gets a small form (401) that
keeps the key in the tab's sessionStorage and sends it as `Authorization: Bearer` on every call.

Cost and back-pressure: the engine core adds a KV block map to its stats at most every
`KV_SNAPSHOT_INTERVAL_S` (only when the console is on); the feed is updated on the event loop by the
stats the server already gathers. Each event stream sends the full snapshot once, then at most one
delta per `EVENT_INTERVAL_S` and only when something moved (metrics/console_feed.py), built when it
is sent: nothing is queued for a stream, so a slow browser blocks only its own send (cut after the
stream write timeout) and gets fewer, larger deltas; at most `--web-ui-max-streams` streams run at
once. An idle stream sends an SSE comment every `HEARTBEAT_S`, so a vanished browser is noticed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.http_io import SSEResponse
from pagedllm.entrypoints.openai.serving_engine import EventStream
from pagedllm.metrics.console_feed import ConsoleFeed, StreamCursor

UI_PATH = "/ui"
EVENTS_PATH = "/v1/engine/events"
# How often the engine core maps its KV pool, and how often each event stream sends a snapshot.
KV_SNAPSHOT_INTERVAL_S = 1.0
EVENT_INTERVAL_S = 1.0
HEARTBEAT_S = 15.0

LOGIN_PAGE = b"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>pagedllm console</title>
<style>body{font:14px system-ui,sans-serif;background:#0f1115;color:#e6e8ee;display:grid;place-items:center;height:90vh}
input,button{font:inherit;padding:6px 10px;border-radius:4px;border:1px solid #333}button{background:#2d6cdf;color:#fff;border:0}
#err{color:#e5534b}</style></head><body><form id="f"><p>This server needs its API key.</p>
<input id="key" type="password" placeholder="API key" autofocus data-testid="api-key"> <button>Open the console</button>
<p id="err"></p></form><script>
async function open_(key) {
  const r = await fetch("/ui", {headers: {"Authorization": "Bearer " + key}});
  if (!r.ok) { document.getElementById("err").textContent = "That key was refused."; return; }
  sessionStorage.setItem("pagedllm_api_key", key);
  const html = await r.text(); document.open(); document.write(html); document.close();
}
document.getElementById("f").onsubmit = (e) => { e.preventDefault(); open_(document.getElementById("key").value); };
const saved = sessionStorage.getItem("pagedllm_api_key"); if (saved) open_(saved);
</script></body></html>"""


def page_html() -> bytes:
    return resources.files("pagedllm.entrypoints.openai").joinpath("web_ui.html").read_bytes()


def install_web_ui(app: FastAPI, feed: ConsoleFeed, max_streams: int, write_timeout: float | None) -> None:
    """Add the console's routes to `app`; the feed must already be one of the engine's stat loggers."""
    if max_streams < 1:
        raise ValueError(f"--web-ui-max-streams must be >= 1, got {max_streams}.")
    page = page_html()
    open_streams = 0

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse(UI_PATH)

    @app.get(UI_PATH, include_in_schema=False)
    async def ui() -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get(EVENTS_PATH)
    async def engine_events() -> Response:
        nonlocal open_streams
        if open_streams >= max_streams:
            raise APIError(
                f"{open_streams} console event streams are open; the limit is {max_streams} (--web-ui-max-streams).",
                HTTPStatus.TOO_MANY_REQUESTS,
            )
        open_streams += 1

        def release() -> None:
            nonlocal open_streams
            open_streams -= 1

        async def events() -> AsyncIterator[str]:
            cursor = StreamCursor()
            quiet = 0.0
            while True:
                event = feed.next_event(cursor)
                if event is not None:
                    quiet = 0.0
                    yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
                elif (quiet := quiet + EVENT_INTERVAL_S) >= HEARTBEAT_S:
                    quiet = 0.0
                    yield ": idle\n\n"
                await asyncio.sleep(EVENT_INTERVAL_S)

        return SSEResponse(EventStream(events(), [], on_close=[release]), write_timeout)

