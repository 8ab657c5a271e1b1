"""Seeded requests on the surfaces fuzz_surfaces.py covers, against two real servers: a tiny random
Llama (SmolLM2's tokenizer with <think>/</think>, test_tool_calling.py's template) with auto tool
choice, a --tool-call-parser and a --reasoning-parser; and all-MiniLM-L6-v2 on the pooling runner.
Every answer passes fuzz_surfaces.check_surface; after each batch the server is idle (every KV block
back in the pool) and healthy; unknown fields were counted, not dropped unseen.

CI runs seed 0 with the hermes and qwen3 parsers. Longer runs, another parser pair:

    FUZZ_SURFACE_CASES=2000 FUZZ_SEED=3 FUZZ_TOOL_PARSER=pythonic FUZZ_REASONING_PARSER=deepseek_r1 \\
        pytest tests/reliability/test_fuzz_surfaces.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import RemoteOpenAIServer, start_servers
from tests.entrypoints.openai.test_tool_calling import write_think_model
from tests.reliability.conftest import assert_idle
from tests.reliability.fuzz_requests import REJECT
from tests.reliability.fuzz_surfaces import SurfaceFuzzer, run_surface_cases

CASES = int(os.environ.get("FUZZ_SURFACE_CASES", "120"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))
TOOL_PARSER = os.environ.get("FUZZ_TOOL_PARSER", "hermes")
REASONING_PARSER = os.environ.get("FUZZ_REASONING_PARSER", "qwen3")
MAX_MODEL_LEN = 512
BATCH = 60


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> tuple[Path, int]:
    """The tiny random Llama with <think> / </think> added (as Qwen3's), and its vocabulary size."""
    path = tmp_path_factory.mktemp("tiny-think")
    return path, write_think_model(path)


@pytest.fixture(scope="module")
def servers(think_model) -> dict[str, RemoteOpenAIServer]:
    path, _ = think_model
    common = ["--served-model-name", "tiny", "--cpu-threads", "1", "--disable-uvicorn-access-log",
              "--disable-log-requests", "--max-num-seqs", "8"]
    chat = ["--model", str(path), *common, "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "256",
            "--chat-template", str(path / "template.jinja"), "--enable-auto-tool-choice",
            "--tool-call-parser", TOOL_PARSER, "--reasoning-parser", REASONING_PARSER, "--seed", "0"]
    pooling = ["--model", "sentence-transformers/all-MiniLM-L6-v2", *common]
    started = dict(zip(("chat", "pooling"), start_servers([chat, pooling]), strict=True))
    yield started
    for server in started.values():
        server.stop()


def _report(failures: list) -> str:
    lines = [f"{len(failures)} cases had problems (FUZZ_SEED={SEED}); the first 10:"]
    for case, problems in failures[:10]:
        lines += [f"  {case}", f"      {problems[:3]}"]
    return "\n".join(lines)


def _run(server: RemoteOpenAIServer, fuzz: SurfaceFuzzer) -> dict:
    cases = list(fuzz.cases(CASES))
    failures, statuses = [], {}
    for start in range(0, len(cases), BATCH):
        more, counts = run_surface_cases(server.url(""), cases[start:start + BATCH])
        failures += more
        for k, v in counts.items():
            statuses[k] = statuses.get(k, 0) + v
        assert server.get("/health").status_code == 200, _report(failures)
        assert_idle(server)
    assert not failures, _report(failures)
    return statuses


@pytest.mark.parametrize("kind", ["tools", "sampling"])
def test_chat_surfaces_fuzz(servers, think_model, kind):
    server = servers["chat"]
    unknown_before = server.metric("pagedllm:request_unknown_fields_total")
    fuzz = SurfaceFuzzer(SEED, kind, model="tiny", vocab_size=think_model[1], max_model_len=MAX_MODEL_LEN,
                         tool_parser=TOOL_PARSER, reasoning_parser=REASONING_PARSER)
    statuses = _run(server, fuzz)
    assert statuses.get(200, 0) > CASES // 4, statuses  # the cases reach the engine, not only validation
    if kind == "sampling":
        assert server.metric("pagedllm:request_unknown_fields_total") > unknown_before


def test_pooling_surfaces_fuzz(servers):
    fuzz = SurfaceFuzzer(SEED, "pooling", model="tiny", vocab_size=30522, max_model_len=512)
    statuses = _run(servers["pooling"], fuzz)
    assert statuses.get(200, 0) > CASES // 5 and statuses.get(400, 0) > CASES // 10, statuses


def test_forced_answers_stream_as_they_answer_whole(servers, think_model):
    """The tools cases whose answer is forced (guided_choice) and has room (max_tokens), sent whole
    and streamed: the same thinking, content and tool calls (serving_chat's two paths, one parser)."""
    import httpx

    from tests.reliability.fuzz_surfaces import stream_whole_problems

    server = servers["chat"]
    fuzz = SurfaceFuzzer(SEED + 1, "tools", model="tiny", vocab_size=think_model[1], max_model_len=MAX_MODEL_LEN,
                         tool_parser=TOOL_PARSER, reasoning_parser=REASONING_PARSER)
    failures, sent = [], 0
    with httpx.Client() as client:
        for case in fuzz.cases(CASES):
            body = json.loads(case.body)
            forced = body.get("guided_choice")
            if not forced or body.get("n") or body["max_tokens"] < len(forced[0]) or case.expect == REJECT:
                continue
            sent += 1
            if sent > CASES // 8:  # two requests a case: a few suffice in CI (FUZZ_SURFACE_CASES for more)
                break
            problems = stream_whole_problems(client, server.url(""), case)
            if problems:
                failures.append((case, problems))
    assert sent > CASES // 8, sent  # the cap was reached
    assert not failures, _report(failures)
    assert_idle(server)
