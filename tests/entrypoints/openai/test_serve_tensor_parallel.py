"""The embedded SmolLM2 GGUF served with tensor parallelism answers the official openai client as
TP=1 does (greedy). SmolLM2-135M has 9 attention heads: `--tensor-parallel-size 2` cannot split
them (vLLM refuses it too) and is refused with that reason; 3 ranks split them, each computing on
its rows / columns of the GGUF blocks."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from tests.entrypoints.openai.conftest import RemoteOpenAIServer

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 16


def test_tp2_is_refused_naming_the_heads():
    with pytest.raises(ValueError, match="9 attention heads are not divisible by tensor_parallel_size 2"):
        EngineArgs(tensor_parallel_size=2).create_engine_config()


class _Serve(RemoteOpenAIServer):
    """`python -m pagedllm serve ...`, the CLI the seeds use (RemoteOpenAIServer runs the module)."""

    def __init__(self, args: list[str]) -> None:
        import os
        import tempfile
        from pathlib import Path

        from tests.entrypoints.openai.conftest import free_port

        self.port = free_port()
        self.api_key = None
        self.log_path = Path(tempfile.mkstemp(prefix="pagedllm-serve-tp-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pagedllm", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        self._wait_ready(300)


def _greedy_texts(client: openai.OpenAI) -> list[str]:
    """Both prompts in one request (one batch, as LLM.generate runs them), greedy."""
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_smollm2_gguf_tp3_answers_like_tp1(smollm2_server):
    # TP=1: the package's SmolLM2 server (the same GGUF, no --tensor-parallel-size).
    expected = _greedy_texts(smollm2_server.client())
    assert all(expected), expected
    server = _Serve(["--tensor-parallel-size", "3", "--max-model-len", "512"])
    try:
        got = _greedy_texts(openai.OpenAI(base_url=server.base_url, api_key="none"))
        assert got == expected
    finally:
        server.stop()
