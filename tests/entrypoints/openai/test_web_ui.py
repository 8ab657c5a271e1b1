"""The web console (GET /ui) in a real headless Chromium, against real servers.

The embedded SmolLM2 server: a chat message typed into the page streams an answer into it, and the
block map shows blocks in use while requests run and none once they are done; a screenshot is saved
under test-artifacts/. The tiny server (it has an API key): the page asks for the key, and the
event stream refuses a request without it.

Chromium comes from Debian's `chromium` package (the Makefile installs it where it can); without
it these browser tests skip locally, and fail on CI, which must have it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL_DIR

ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The flags the machine's probe uses: no background connections (the network is closed).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have Debian's chromium for the web console tests (make test installs it)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def used_blocks(page) -> int:
    v = page.get_attribute("[data-testid=blockmap]", "data-used-blocks")
    return -1 if v is None else int(v)


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def test_console_chat_and_block_map(smollm2_server, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(smollm2_server.url("/"))  # redirects to /ui
    assert page.url.endswith("/ui")
    page.wait_for_selector("[data-testid=conn]:text('live')", timeout=20_000)
    assert page.text_content("[data-testid=model]") == "SmolLM2-135M-Instruct"
    wait_for(lambda: used_blocks(page) == 0, 10, "an idle block map")

    # Requests from outside the page: the map shows their blocks while they run.
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time " * 30, "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}
    peak = 0
    with httpx.Client(timeout=300) as c, ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(c.post, smollm2_server.url("/v1/completions"), json=body) for _ in range(4)]
        while not all(f.done() for f in futures):
            peak = max(peak, used_blocks(page))
            time.sleep(0.1)
        assert all(f.result().status_code == 200 for f in futures)
    # 4 requests of ~150 prompt tokens + 48 new ones in 16-token blocks: dozens of blocks at the peak.
    assert peak >= 8, peak
    wait_for(lambda: used_blocks(page) == 0, 15, "every block back in the pool")
    assert page.text_content("[data-testid=running]") == "0"

    # A chat message typed into the page streams its answer into the page.
    page.fill("[data-testid=prompt]", "What is the capital of France?")
    page.click("[data-testid=send]")
    page.wait_for_selector(".msg.assistant[data-done=true]", timeout=60_000)
    answer = page.text_content(".msg.assistant")
    assert answer and answer.strip(), "no streamed answer in the page"
    assert "tokens/s" in page.text_content("[data-testid=chat-speed]")
    # The same question through the API, greedy as the page's default: the same text.
    ref = smollm2_server.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=128,
    ).choices[0].message.content
    assert answer == ref
    rows = page.text_content("[data-testid=requests]")
    assert "stop" in rows or "length" in rows  # finished requests are listed with their reason
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_ui.png"), full_page=True)
    page.close()
    smollm2_server.wait_idle()


def test_console_needs_the_api_key(tiny_server, browser):
    # Without the key the event stream is refused like the API, and /ui answers a login form.
    r = httpx.get(tiny_server.url("/v1/engine/events"), timeout=10)
    assert r.status_code == 401
    r = httpx.get(tiny_server.url("/ui"), timeout=10)
    assert r.status_code == 401 and "API key" in r.text
    page = browser.new_page()
    page.goto(tiny_server.url("/ui"))
    page.fill("[data-testid=api-key]", "wrong")
    page.press("[data-testid=api-key]", "Enter")
    page.wait_for_selector("text=That key was refused", timeout=10_000)
    page.fill("[data-testid=api-key]", tiny_server.api_key)
    page.press("[data-testid=api-key]", "Enter")
    page.wait_for_selector("[data-testid=conn]:text('live')", timeout=20_000)
    assert page.text_content("[data-testid=model]") == "tiny"
    page.close()


def test_event_stream_snapshot(tiny_server):
    """One snapshot from the event stream, read as a client would: the fields the page draws."""
    with httpx.stream("GET", tiny_server.url("/v1/engine/events"), headers=tiny_server.headers, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        line = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    snap = json.loads(line[6:])
    assert snap["model"] == "tiny" and snap["num_blocks"] > 0 and snap["block_size"] == 16
    assert len(snap["series"]) == 300 and snap["running"] == 0
    kv = snap["kv_map"]
    assert kv["num_blocks"] == snap["num_blocks"] and kv["blocks_per_cell"] >= 1
    cells = base64.b64decode(kv["cells"])
    assert len(cells) == 4 * -(-kv["num_blocks"] // kv["blocks_per_cell"])
    assert not any(cells[0::4]), "an idle server shows blocks in use"


def stream_status(url: str) -> int:
    with httpx.stream("GET", url, timeout=10) as r:
        return r.status_code


# Started together by the package's server pool (conftest.ServerPool). 256 KV blocks: the default
# 4 GiB is 524,288 blocks of the tiny model, each a Python object built at start and walked by the
# suite's block-pool check and the console's block map.
SMALL_POOL = ["--max-model-len", "512", "--num-gpu-blocks-override", "256"]
SERVERS = {
    "capped": (["--model", MODEL_DIR, "--web-ui-max-streams", "1", *SMALL_POOL], {}),
    # --host 0.0.0.0 (after the pool's 127.0.0.1, so it wins): not loopback, so no console.
    "public": (["--model", MODEL_DIR, "--host", "0.0.0.0", *SMALL_POOL], {}),
}


def test_event_streams_are_capped(server_pool):
    server = server_pool.take("capped", __name__)
    events = server.url("/v1/engine/events")
    with httpx.stream("GET", events, timeout=10) as first:
        assert first.status_code == 200
        second = httpx.get(events, timeout=10)
        assert second.status_code == 429 and "--web-ui-max-streams" in second.json()["error"]["message"]
    # Closing the first frees its place once the server sees the disconnect.
    wait_for(lambda: stream_status(events) == 200, 10, "the freed event-stream place")


def test_console_off_by_default_on_a_public_bind(server_pool):
    server = server_pool.take("public", __name__)
    assert httpx.get(server.url("/ui"), timeout=10).status_code == 404
    assert httpx.get(server.url("/v1/engine/events"), timeout=10).status_code == 404
