"""Every limit is a flag: lowered on one server, each refusal names the flag to change; a bad flag value
is refused by the check that runs before the model loads (run_server then exits 2); admission counts exactly."""

from __future__ import annotations

import argparse
import socket
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.admission import AdmissionController
from pagedllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from pagedllm.entrypoints.openai.errors import APIError
from tests.entrypoints.openai.conftest import RemoteOpenAIServer
from tests.reliability.conftest import MODEL, assert_idle, assert_openai_error

CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def server(low_limits_server: RemoteOpenAIServer) -> RemoteOpenAIServer:
    return low_limits_server


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/v1/completions", {**CMPL, "n": 4}, ["[1, 3]", "--max-n"]),
        ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c"]}, ["2", "--max-stop-strings"]),
        ("/v1/chat/completions", {**CHAT, "stop": ["ninechars"]}, ["8", "--max-stop-string-len"]),
        ("/v1/completions", {**CMPL, "logit_bias": {"1": 1, "2": 1, "3": 1}}, ["2", "--max-logit-bias-entries"]),
        ("/v1/completions", {**CMPL, "prompt": "x" * 1001}, ["1001", "1000", "--max-prompt-bytes"]),
        ("/v1/completions", {**CMPL, "prompt": ["x" * 600, "y" * 600]}, ["1200", "--max-prompt-bytes"]),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "é" * 501}]},
         ["1002", "--max-prompt-bytes"]),
        ("/tokenize", {"prompt": "x" * 1001}, ["1001", "--max-prompt-bytes"]),
        ("/tokenize", {"messages": [{"role": "user", "content": "x" * 1001}]}, ["1001", "--max-prompt-bytes"]),
        ("/v1/completions", {**CMPL, "logprobs": 4}, ["max_logprobs", "3", "--max-logprobs"]),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4}, ["top_logprobs", "--max-logprobs"]),
        # 3 prompts x n=2 = 6 sequences can never fit 2 running + 2 queued
        ("/v1/completions", {**CMPL, "prompt": ["a", "b", "c"], "n": 2}, ["6 sequences", "--max-num-queued-reqs"]),
    ],
)
def test_lowered_limits_name_their_flag(server, path, body, words):
    assert_openai_error(server.post(path, body), 400, *words)
    assert_idle(server)


def test_limits_at_the_boundary_pass(server):
    ok = [
        ("/v1/completions", {**CMPL, "n": 3, "seed": 1}),
        ("/v1/chat/completions", {**CHAT, "stop": ["abcdefgh", "b"]}),
        ("/v1/completions", {**CMPL, "prompt": "x" * 1000, "logprobs": 3}),
        ("/v1/completions", {**CMPL, "prompt": ["a", "b"], "n": 2}),  # 4 sequences: 2 running + 2 queued
    ]
    for path, body in ok:
        r = server.post(path, body)
        assert r.status_code == 200, r.text
    assert_idle(server)


def test_header_limits(server):
    many = {f"x-h{i}": "1" for i in range(25)}
    err = assert_openai_error(httpx.post(server.url("/v1/completions"), json=CMPL, headers=many), 431,
                              "the limit is 20", "--h11-max-header-count")
    assert err["type"] == "invalid_request_error"
    # A header block over --h11-max-incomplete-event-size (4096): arriving whole, the middleware
    # refuses it with OpenAI's body; arriving in pieces, h11 refuses it as it grows (uvicorn's 400).
    big = {"X-Big": "a" * 5000}
    assert_openai_error(httpx.post(server.url("/v1/completions"), json=CMPL, headers=big), 431,
                        "bytes of headers", "4096", "--h11-max-incomplete-event-size")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000)
        time.sleep(0.3)
        try:
            s.sendall(b"\r\n\r\n")
        except OSError:
            pass  # already refused and closed
        assert s.recv(1024).startswith(b"HTTP/1.1 400")
    assert httpx.get(server.url("/health")).status_code == 200


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--max-n", "500"], ["--max-n", "128"]),
        (["--max-stop-strings", "65"], ["--max-stop-strings"]),
        (["--max-logit-bias-entries", "5000"], ["--max-logit-bias-entries"]),
        (["--max-num-queued-reqs", "-1"], ["--max-num-queued-reqs"]),
        (["--shutdown-timeout", "-1"], ["--shutdown-timeout"]),
        (["--stream-write-timeout", "-1"], ["--stream-write-timeout"]),
        (["--max-prompt-bytes", "0"], ["--max-prompt-bytes"]),
        (["--h11-max-header-count", "0"], ["--h11-max-header-count"]),
        (["--h11-max-incomplete-event-size", "10"], ["--h11-max-incomplete-event-size"]),
        (["--max-json-values", "0"], ["--max-json-values"]),
        (["--max-messages", "0"], ["--max-messages"]),
        (["--max-content-parts", "0"], ["--max-content-parts"]),
        (["--max-stop-token-ids", "-1"], ["--max-stop-token-ids"]),
        (["--max-tools", "-1"], ["--max-tools"]),
        (["--max-prompt-cpu-seconds", "0"], ["--max-prompt-cpu-seconds"]),
        (["--max-log-len", "-1"], ["--max-log-len"]),
        (["--timeout-keep-alive", "0"], ["--timeout-keep-alive"]),
        (["--timeout-request-read", "-1"], ["--timeout-request-read"]),
        (["--limit-concurrency", "0"], ["--limit-concurrency"]),
    ],
)
def test_bad_limit_flags_are_refused(flags, words):
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(flags)
    with pytest.raises(ValueError) as e:
        validate_parsed_serve_args(args)
    for w in words:
        assert w in str(e.value)


def test_admission_counts_sequences_and_releases_once():
    a = AdmissionController(max_num_seqs=2, max_num_queued_reqs=3)
    t1 = a.admit(4)  # 4 of 5
    with pytest.raises(APIError) as e:
        a.admit(2)
    assert e.value.status_code == 503 and e.value.headers == {"Retry-After": "1"}
    t2 = a.admit(1)
    assert a.in_flight == 5 and a.num_requests == 2 and a.num_rejected == 1
    t1.release()
    t1.release()  # idempotent
    assert a.in_flight == 1 and a.num_requests == 1
    with pytest.raises(APIError) as e:
        a.admit(6)
    assert e.value.status_code == 400 and "6 sequences" in e.value.message
    a.draining = True
    with pytest.raises(APIError) as e:
        a.admit(1)
    assert e.value.status_code == 503 and e.value.code == "server_shutting_down"
    t2.release()
    assert a.in_flight == 0 and a.num_requests == 0
