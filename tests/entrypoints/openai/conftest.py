"""A real server process on 127.0.0.1 (a free port), talked to with the `openai` client and httpx.

`tiny_server` serves a tiny random Llama (hidden 64, 2 layers) with SmolLM2's real tokenizer and
chat template, so concurrency tests are fast; it requires an API key on every /v1 call, so every
test also exercises auth. `smollm2_server` (test_openai_smollm2.py) serves the embedded model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

TINY_API_KEY = "sk-pagedllm-test"
TINY_NAMES = ("tiny", "tiny-alias")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    """`python -m pagedllm.entrypoints.openai.api_server ...` as a subprocess, ready when /health is 200."""

    def __init__(
        self, args: list[str], *, api_key: str | None = None, env: dict[str, str] | None = None, timeout: float = 240
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = Path(tempfile.mkstemp(prefix="pagedllm-server-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url("/health"), timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def base_url(self) -> str:
        return self.url("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "EMPTY", max_retries=0, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "EMPTY", max_retries=0, **kwargs)

    def post(self, path: str, json: Any = None, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url(path), json=json, headers=headers, timeout=60, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.get(self.url(path), headers=headers, timeout=60, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels without model_name): value} from GET /metrics (no key needed)."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Poll /metrics until 0 running, 0 waiting and a fully free KV pool; returns the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m[("pagedllm:num_requests_running", ())] == 0
                and m[("pagedllm:num_requests_waiting", ())] == 0
                and m[("pagedllm:kv_cache_usage_perc", ())] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def make_tiny_model(path: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (49152 tokens) and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.loader.source import resolve_model
    from pagedllm.loader.tokenizer import get_tokenizer

    tok = get_tokenizer(resolve_model(None))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        # 0.2 (not 0.02): varied text instead of one token repeated, so stop strings can be tested.
        initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="package")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="package")
def tiny_server(tiny_model_dir: Path):
    server = RemoteOpenAIServer(
        [
            "--model", str(tiny_model_dir), "--served-model-name", *TINY_NAMES, "--max-model-len", "1024",
            "--max-num-seqs", "64", "--num-gpu-blocks-override", "2048", "--cpu-threads", "1", "--seed", "0",
            "--disable-uvicorn-access-log",
        ],
        api_key=TINY_API_KEY,
    )
    yield server
    server.stop()


@pytest.fixture
def client(tiny_server: RemoteOpenAIServer) -> openai.OpenAI:
    return tiny_server.client()
