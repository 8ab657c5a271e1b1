"""A worker process killed during generation (`pagedllm serve --tensor-parallel-size 2`): the
streaming request ends with an error, /health is 503, the server exits non-zero within 10 s, and
no process of its tree is left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil

from tests.entrypoints.conftest import make_tiny_model
from tests.entrypoints.openai.conftest import RemoteOpenAIServer
from tests.reliability.conftest import parse_sse


def _rank_processes(server_pid: int) -> list[psutil.Process]:
    procs = psutil.Process(server_pid).children(recursive=True)
    return [p for p in procs if "multiproc_worker" in " ".join(p.cmdline())]


def test_killed_worker_fails_the_engine_and_the_server_exits(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    server = RemoteOpenAIServer(["--model", str(model), "--served-model-name", "tiny", "--cpu-threads", "1",
                                 "--tensor-parallel-size", "2", "--max-model-len", "1024",
                                 "--num-gpu-blocks-override", "128", "--disable-uvicorn-access-log"])
    try:
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        ranks = _rank_processes(server.proc.pid)
        assert len(ranks) == 2, [p.cmdline() for p in tree]
        result: dict = {}

        def stream() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
                result["status"] = r.status_code
                result["events"], result["done"] = parse_sse(list(r.iter_lines()))

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.5)  # generating by now (1000 tokens take far longer)
        os.kill(ranks[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        t.join(30)
        assert result["status"] == 200 and result["done"], result
        error = result["events"][-1]["error"]
        assert "rank 1" in error["message"] and error["code"] == "engine_dead", error
        health = httpx.get(server.url("/health"), timeout=5) if server.proc.poll() is None else None
        assert health is None or health.status_code == 503
        code = server.proc.wait(10)
        assert code != 0 and time.monotonic() - killed_at < 10
        # The ranks are gone, and so is the rest of the tree (the engine process, multiprocessing's
        # fork server, which leaves once it sees the server's end of its pipe close).
        gone, alive = psutil.wait_procs(tree, timeout=5)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], [(p.pid, p.cmdline()) for p in alive]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def test_hung_rank_fails_the_engine_within_the_timeout(monkeypatch):
    """A rank that stops answering (SIGSTOP: alive, silent) fails the step after
    PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S instead of hanging; every rank is stopped."""
    import pytest

    from pagedllm import LLM, SamplingParams
    from pagedllm.executor.multiproc import WorkerDiedError
    from tests.utils import tiny_model

    monkeypatch.setenv("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S", "3")
    path, _ = tiny_model("llama3")
    llm = LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2, cpu_threads=1, num_gpu_blocks_override=32,
              max_model_len=128)
    ranks = llm.llm_engine.engine_core.model_executor.processes
    os.kill(ranks[1].pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="hung"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 15
    assert all(p.poll() is not None for p in ranks)


def test_failed_start_leaves_no_rank_process():
    """initialize() refuses a KV cache smaller than max_model_len: the ranks are gone at once."""
    import pytest

    from pagedllm import LLM
    from tests.distributed.test_parallel_equivalence import worker_processes
    from tests.utils import tiny_model

    path, _ = tiny_model("llama3")
    with pytest.raises(ValueError, match="larger than the 512 tokens"):
        LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2, cpu_threads=1, num_gpu_blocks_override=32,
            max_model_len=1024)
    assert worker_processes() == []
