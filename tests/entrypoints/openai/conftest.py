"""A real server process on 127.0.0.1 (a free port), talked to with the `openai` client and httpx.

`tiny_server` serves a tiny random Llama (hidden 64, 2 layers) with SmolLM2's real tokenizer and
chat template, so concurrency tests are fast; it requires an API key on every /v1 call, so every
test also exercises auth. `smollm2_server` serves the embedded model.
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
TINY_MAX_BODY = 1_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    """`python -m pagedllm.entrypoints.openai.api_server ...` as a subprocess, ready when /health is 200."""

    def __init__(
        self, args: list[str], *, api_key: str | None = None, env: dict[str, str] | None = None, timeout: float = 240,
        wait: bool = True,
    ) -> None:
        """wait=False returns once the process is started; `wait_ready()` then waits for /health
        (`start_servers` starts several so that their start-ups overlap)."""
        self.port = free_port()
        self.api_key = api_key
        self.log_path = Path(tempfile.mkstemp(prefix="pagedllm-server-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._timeout = timeout
        if wait:
            self._wait_ready(timeout)

    def wait_ready(self) -> None:
        self._wait_ready(self._timeout)

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
                m[("vllm:num_requests_running", ())] == 0
                and m[("vllm:num_requests_waiting", ())] == 0
                and m[("vllm:kv_cache_usage_perc", ())] == 0
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


def start_servers(arg_lists: list[list[str]], **kwargs: Any) -> list[RemoteOpenAIServer]:
    """Start one server per argument list, as many at once as there are cores: a start-up is mostly
    one process importing on one core, so on CI's 2 cores two starts take about the time of one.
    Every server started is stopped if any fails to become healthy."""
    started: list[RemoteOpenAIServer] = []
    batch = max(1, os.cpu_count() or 1)
    try:
        for i in range(0, len(arg_lists), batch):
            group = [RemoteOpenAIServer(args, wait=False, **kwargs) for args in arg_lists[i:i + batch]]
            started += group
            for server in group:
                server.wait_ready()
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started


# In a module's SERVERS args: the tiny model's directory (tests/entrypoints/conftest.py), filled in by the pool.
MODEL_DIR = "{tiny_model_dir}"
Spec = tuple[list[str], dict[str, Any]]  # RemoteOpenAIServer's args and keyword arguments


class ServerPool:
    """The servers of one package's collected tests, each started together with the next ones not yet
    started (as many at once as there are cores, as start_servers), in the order the tests first need
    them: a start-up is mostly one process importing on one core, so on CI's 2 cores the next
    server comes up beside this one instead of during a later test's wait. E.g. (tiny, embed),
    (engine fault, smollm2), (capped, public): 3 waits for 6 servers.

    Specs: the package's own (a package fixture's server, e.g. "tiny") and a test module's
    `SERVERS = {name: (args, kwargs)}`, taken as `pool.take(name, module)` and stopped when the
    module ends (`stop_module`). A server whose start failed raises its error when taken."""

    live: list[ServerPool] = []  # the pools of the packages running now (stop_module's callers)

    def __init__(self, specs: dict[str, Spec], order: list[str]) -> None:
        self._specs = specs
        self._order = [n for n in order if n in specs]
        self._servers: dict[str, RemoteOpenAIServer] = {}
        self._errors: dict[str, BaseException] = {}

    @staticmethod
    def collect(session: pytest.Session, package: Path, fixtures: dict[str, str],
                model_dir: Path) -> tuple[dict[str, Spec], list[str]]:
        """The SERVERS of the collected modules under `package` (MODEL_DIR filled in), and every spec's
        name in the order the collected tests first need it (`fixtures`: fixture name -> spec name)."""
        specs: dict[str, Spec] = {}
        order: list[str] = []
        for item in session.items:
            module = getattr(item, "module", None)
            if module is None or not Path(item.path).is_relative_to(package):
                continue
            names = [spec for fixture, spec in fixtures.items() if fixture in item.fixturenames]
            for name, (args, kwargs) in getattr(module, "SERVERS", {}).items():
                key = f"{module.__name__}::{name}"
                specs[key] = ([str(model_dir) if a == MODEL_DIR else a for a in args], kwargs)
                names.append(key)
            order += [n for n in names if n not in order]
        return specs, order

    def take(self, name: str, module: str | None = None) -> RemoteOpenAIServer:
        key = f"{module}::{name}" if module else name
        if key not in self._servers and key not in self._errors:
            self._start(key)
        if key in self._errors:
            raise self._errors[key]
        return self._servers[key]

    def _start(self, key: str) -> None:
        later = self._order[self._order.index(key) + 1:] if key in self._order else []
        batch = max(1, os.cpu_count() or 1)
        group = [key, *[n for n in later if n not in self._servers and n not in self._errors][:batch - 1]]
        for n in group:
            args, kwargs = self._specs[n]
            self._servers[n] = RemoteOpenAIServer(args, wait=False, **kwargs)
        for n in group:
            try:
                self._servers[n].wait_ready()
            except Exception as e:  # noqa: PERF203 - each server's own error, raised when it is taken
                self._errors[n] = e
                self._servers.pop(n).stop()

    def stop_module(self, module: str) -> None:
        for key in [k for k in self._servers if k.startswith(f"{module}::")]:
            self._servers.pop(key).stop()

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="package")
def tiny_chat_template(tiny_tokenizer: Any) -> str:
    """The server's --chat-template: the model's own with a marker line first, so tests can tell
    which template rendered a prompt."""
    return "{{ 'CUSTOM TEMPLATE\\n' }}" + tiny_tokenizer.chat_template


@pytest.fixture(scope="package")
def server_pool(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_chat_template: str,
                tmp_path_factory: pytest.TempPathFactory):
    """This package's servers (ServerPool): tiny_server's, smollm2_server's and the modules' SERVERS."""
    template_file = tmp_path_factory.mktemp("template") / "chat_template.jinja"
    template_file.write_text(tiny_chat_template)
    specs, order = ServerPool.collect(request.session, Path(__file__).parent,
                                      {"tiny_server": "tiny", "smollm2_server": "smollm2"}, tiny_model_dir)
    specs["tiny"] = ([
        "--model", str(tiny_model_dir), "--served-model-name", *TINY_NAMES, "--max-model-len", "1024",
        "--max-num-seqs", "64", "--num-gpu-blocks-override", "2048", "--cpu-threads", "1", "--seed", "0",
        "--chat-template", str(template_file), "--max-request-body-bytes", str(TINY_MAX_BODY),
        "--disable-uvicorn-access-log",
    ], {"api_key": TINY_API_KEY})
    # The embedded SmolLM2-135M-Instruct GGUF, no --model: what `make serve` starts.
    specs["smollm2"] = (["--max-model-len", "2048", "--max-num-seqs", "16", "--disable-uvicorn-access-log"], {})
    pool = ServerPool(specs, order)
    ServerPool.live.append(pool)
    yield pool
    pool.stop_all()
    ServerPool.live.remove(pool)


@pytest.fixture(scope="module", autouse=True)
def _module_servers_stopped(request: pytest.FixtureRequest):
    """A module's SERVERS stop when it ends (the pool's package servers live on)."""
    yield
    for pool in ServerPool.live:
        pool.stop_module(request.module.__name__)


@pytest.fixture(scope="package")
def tiny_server(server_pool: ServerPool) -> RemoteOpenAIServer:
    return server_pool.take("tiny")


@pytest.fixture
def client(tiny_server: RemoteOpenAIServer) -> openai.OpenAI:
    return tiny_server.client()


@pytest.fixture(scope="package")
def smollm2_server(server_pool: ServerPool) -> RemoteOpenAIServer:
    """The embedded SmolLM2-135M-Instruct GGUF, no --model: what `make serve` starts. One for the
    package (test_openai_smollm2, the TP=1 reference of test_serve_tensor_parallel, test_web_ui):
    it is the slowest server to start."""
    return server_pool.take("smollm2")
