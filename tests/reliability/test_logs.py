"""Logs (issue 18): client text is escaped and cut at --max-log-len, so a request_id cannot forge a
log line; unknown field names are never logged verbatim, their warnings are rate-limited and counted
in `pagedllm:request_unknown_fields_total`; --disable-log-requests silences them (still counted)."""

from __future__ import annotations

import time

import pytest

from pagedllm.entrypoints.openai.request_log import UNKNOWN_FIELDS_BURST, UnknownFieldReporter, for_log
from tests.reliability.conftest import HARDENED_MAX_LOG_LEN, MODEL

CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
UNKNOWN = "pagedllm:request_unknown_fields_total"


def wait_for_log(server, text: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in (log := server.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return log


def test_a_request_id_cannot_forge_a_log_line(hardened_server):
    s = hardened_server
    forged = "innocent\nINFO 2026-01-01 pagedllm: FORGED" + "z" * 100
    r = s.post("/v1/completions", {**CMPL, "request_id": forged})
    assert r.status_code == 200, r.text
    log = wait_for_log(s, "cmpl-innocent\\nINFO")
    assert "cmpl-innocent\\nINFO" in log
    assert not any(line.startswith("INFO 2026-01-01") for line in log.splitlines())
    line = next(x for x in log.splitlines() if "cmpl-innocent" in x)
    assert "z" * HARDENED_MAX_LOG_LEN not in line and "...(+" in line  # cut at --max-log-len


def test_unknown_fields_are_counted_and_logged_briefly(hardened_server):
    s = hardened_server
    before_count, before_log = s.metric(UNKNOWN), len(s.log())
    # 2,000 unknown names of 1 KB each (2 MB of names; logged verbatim before the fix)
    body = {**CMPL, **{f"field{i}\n" + "n" * 1000: 1 for i in range(2000)}}
    r = s.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    for i in range(3 * UNKNOWN_FIELDS_BURST):  # a burst, then rate-limited
        assert s.post("/v1/completions", {**CMPL, f"burst{i}": 1}).status_code == 200
    assert s.metric(UNKNOWN) - before_count == 1 + 3 * UNKNOWN_FIELDS_BURST
    grown = s.log()[before_log:]
    warnings = [x for x in grown.splitlines() if "ignoring unknown" in x]
    assert len(warnings) <= UNKNOWN_FIELDS_BURST + 1, warnings
    assert len(grown) < 20_000, len(grown)
    assert "and 1995 more" in warnings[0] and "\\n" in warnings[0]
    assert all(len(x) < 400 for x in warnings)


def test_disable_log_requests_silences_unknown_field_warnings(low_limits_server):
    s = low_limits_server  # started with --disable-log-requests
    before = s.metric(UNKNOWN)
    assert s.post("/v1/completions", {**CMPL, "prompt": "x", "quietly_unknown": 1}).status_code == 200
    assert s.metric(UNKNOWN) == before + 1
    assert "quietly_unknown" not in s.log()


def test_for_log_escapes_and_cuts():
    assert for_log("a\nb\r\x1b[31m\u2028", 100) == "a\\nb\\r\\x1b[31m\\u2028"
    assert for_log("x" * 10, 4) == "xxxx...(+6)"
    assert for_log("\ud800", 10) == "\\ud800"  # a lone surrogate is escaped, never written raw


@pytest.mark.parametrize("log_enabled", [True, False])
def test_reporter_rate_limit(log_enabled, caplog):
    now = [0.0]
    counted = []
    rep = UnknownFieldReporter(log_enabled=log_enabled, on_count=lambda: counted.append(1), interval_s=10,
                               clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="pagedllm.entrypoints.openai"):
        for _ in range(UNKNOWN_FIELDS_BURST + 3):
            rep.report("r", ["a"])
        now[0] += 10  # one more line may be logged, telling of the 3 suppressed requests
        rep.report("r", ["a"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(counted) == UNKNOWN_FIELDS_BURST + 4
    if log_enabled:
        assert len(lines) == UNKNOWN_FIELDS_BURST + 1
        assert "3 more requests with unknown fields not logged" in lines[-1]
    else:
        assert lines == []
