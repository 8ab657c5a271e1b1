"""Connection limits (issue 18): an idle connection and a slowloris client are closed after
--timeout-request-read while others are served; an idle keep-alive connection closes after
--timeout-keep-alive; connections past --limit-concurrency get 503; a request framed by both
Content-Length and Transfer-Encoding is answered, then its connection closed (RFC 9112 section 6.1)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.reliability.conftest import HARDENED_LIMIT_CONNECTIONS as LIMIT_CONNECTIONS
from tests.reliability.conftest import HARDENED_READ_TIMEOUT_S as READ_TIMEOUT_S
from tests.reliability.conftest import MODEL


@pytest.fixture
def server(hardened_server):
    return hardened_server


def _open(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        return False, data
    except OSError:
        pass
    return True, data


def test_idle_and_slowloris_connections_are_closed_while_others_are_served(server):
    idle = [_open(server.port) for _ in range(5)]
    slow = [_open(server.port) for _ in range(5)]
    opened = time.monotonic()
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

    def trickle() -> None:  # one header byte every 0.2 s: never complete within the timeout
        for i in range(30):
            for s in slow:
                try:
                    s.sendall(b"X-Slow: %d\r\n" % i)
                except OSError:
                    pass
            time.sleep(0.2)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "served", "max_tokens": 2})
    assert r.status_code == 200, r.text
    for s in idle + slow:
        closed, data = _closed_within(s, READ_TIMEOUT_S + 10)
        assert closed, "a connection outlived --timeout-request-read"
        if data:
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
            assert b"--timeout-request-read" in data
        s.close()
    assert READ_TIMEOUT_S - 0.5 < time.monotonic() - opened < READ_TIMEOUT_S + 10
    t.join(10)
    # A keep-alive connection idle after its answer closes after --timeout-keep-alive (1 s).
    s = _open(server.port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    closed, data = _closed_within(s, 10)
    assert closed and data.startswith(b"HTTP/1.1 200"), data[:200]
    s.close()
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "still", "max_tokens": 2}).status_code == 200


def test_connections_past_the_cap_get_503(server):
    held = [_open(server.port) for _ in range(LIMIT_CONNECTIONS)]
    try:
        time.sleep(0.3)
        extra = _open(server.port)
        closed, data = _closed_within(extra, 5)
        extra.close()
        assert closed and data.startswith(b"HTTP/1.1 503"), data[:200]
        assert b"--limit-concurrency" in data
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "after", "max_tokens": 2}).status_code == 200


def test_content_length_with_transfer_encoding_closes_the_connection(server):
    """RFC 9112 section 6.1: answer such a request, then close; a request pipelined behind it is not
    served (it may be a smuggled one)."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    s = _open(server.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s%s" % (len(chunked), chunked, smuggled))
    closed, data = _closed_within(s, 20)
    s.close()
    assert closed, data[:300]
    assert data.startswith(b"HTTP/1.1 200") and b"connection: close" in data.lower()
    assert data.count(b"HTTP/1.1 ") == 1, data  # the pipelined request was not answered


def test_a_body_that_trickles_in_is_cut_at_the_read_timeout(server):
    s = _open(server.port)
    start = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
    closed, _ = _closed_within(s, READ_TIMEOUT_S + 10)
    s.close()
    assert closed and time.monotonic() - start < READ_TIMEOUT_S + 10
    time.sleep(0.2)
    assert "unhandled error" not in server.log()
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "next", "max_tokens": 2}).status_code == 200
