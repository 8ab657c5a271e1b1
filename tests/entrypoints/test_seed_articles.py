"""The seed articles' code (tests/entrypoints/seeds/, copies of what our users read) runs with only
`vllm` -> `pagedllm`, the model, and `tensor_parallel_size` changed.

Each block is cut from the article by its line range (the first line is checked, so an edited
article fails loudly) and ported by `port()`, which makes exactly those substitutions: the model
names become one local checkpoint (a tiny random Llama with SmolLM2's tokenizer and chat template,
8192 positions, so the articles' max_model_len values hold), tensor_parallel_size becomes 1, and
in client code the server URL's port becomes the test server's. Everything else runs as written.

§4.1 / §4.2 run on AWQ / GPTQ checkpoints of the seed model (test_quantized_model_blocks). Not run here,
and why: §6.1 (a Qdrant server and two hub
models), §3.2's embeddings call (no embedding model: issue 21; it is run and must fail with an HTTP
error, not a crash). The GPU loop of §4.3 / §7.1 (`del llm; torch.cuda.empty_cache()` between
engines) runs on the H200 with scripts/gpu_seed_loop.py; here the same blocks run on the CPU.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

SEEDS = Path(__file__).parent / "seeds"
A = "000_66bd891f17908963.txt"
B = "001_4b0b89dd62a3dc60.txt"
MODEL_NAMES = (
    "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct",
    "meta-llama/Llama-2-13b-chat-hf", "qwen-72b",
)


def block(name: str, start: int, end: int, first_line: str) -> str:
    """Lines start..end (1-based, inclusive) of a seed article; the first must begin with first_line."""
    lines = (SEEDS / name).read_text(encoding="utf-8").splitlines()[start - 1 : end]
    assert lines[0].startswith(first_line), f"{name}:{start} now reads {lines[0]!r}: update the line range"
    return "\n".join(lines) + "\n"


def port(code: str, model: str, port_number: int | None = None) -> str:
    """The only edits: vllm -> pagedllm, model names -> `model`, tensor_parallel_size -> 1, the port."""
    code = code.replace("from vllm ", "from pagedllm ").replace("import vllm", "import pagedllm")
    code = code.replace("vllm.entrypoints", "pagedllm.entrypoints")
    for name in MODEL_NAMES:
        code = code.replace(f'"{name}"', repr(model)).replace(f" {name} ", f" {model} ")
    code = re.sub(r"tensor_parallel_size=\d+", "tensor_parallel_size=1", code)
    code = re.sub(r"--tensor-parallel-size \d+", "--tensor-parallel-size 1", code)
    if port_number is not None:
        code = code.replace("localhost:8000", f"127.0.0.1:{port_number}").replace("--port 8000", f"--port {port_number}")
    return code


_counter = itertools.count()


def run(code: str) -> dict:
    """Run a block as a module of its own (registered, so pydantic can resolve its classes)."""
    module = types.ModuleType(f"seed_block_{next(_counter)}")
    sys.modules[module.__name__] = module
    exec(compile(code, "<seed>", "exec"), module.__dict__)  # noqa: S102 - the article's code is what is tested
    return module.__dict__


@pytest.fixture(autouse=True)
def small_cpu_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU variable for the KV cache size: 4 GiB of cache per engine (the default) would be
    millions of blocks of this tiny model; users of vLLM's CPU backend set the same variable."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")
    monkeypatch.setenv("PAGEDLLM_DEBUG_BLOCKS", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama with SmolLM2's tokenizer whose answers end soon: its layers add nothing to the
    residual stream (o_proj / down_proj are zero), every embedding shares a direction u, and the
    lm_head row of EOS points along u, so at the articles' temperature 0.7 each step ends with EOS
    with probability ~0.2 (a few tokens per answer) instead of running every answer to max_tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.loader.source import resolve_model
    from pagedllm.loader.tokenizer import get_tokenizer

    path = tmp_path_factory.mktemp("seed-model")
    tok = get_tokenizer(resolve_model(None))
    torch.manual_seed(0)
    hidden = 32
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        u = torch.ones(hidden)
        model.model.embed_tokens.weight.normal_(0, 1).add_(2 * u)
        model.lm_head.weight.normal_(0, 0.3)
        model.lm_head.weight[tok.eos_token_id] = 1.7 * u / hidden**0.5
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_concept_blocks_run():
    run(block(A, 17, 113, "# PagedAttention概念演示"))
    ns = run(block(A, 120, 199, "# vLLM连续批处理概念演示"))
    assert len(ns["scheduler"].completed) == 6  # the article's 20 steps finish 6 of its 8 requests


def test_install_check():
    # §2.1: python -c "import vllm; print(vllm.__version__)"; help(LLM.__init__)
    import pagedllm
    from pagedllm import LLM

    assert re.fullmatch(r"\d+\.\d+\.\d+.*", pagedllm.__version__)
    assert LLM.__init__.__doc__ is None or isinstance(LLM.__init__.__doc__, str)


def test_offline_batch_and_chat_and_parallel_blocks(model_dir, capsys):
    ns = run(port(block(A, 218, 262, "from vllm import LLM, SamplingParams"), model_dir))  # §2.2
    assert len(ns["outputs"]) == 4 and all(o.outputs[0].token_ids for o in ns["outputs"])
    del ns
    ns = run(port(block(A, 268, 304, "from vllm import LLM, SamplingParams"), model_dir))  # §2.3
    assert len(ns["outputs"]) == 2
    del ns
    ns = run(port(block(A, 600, 613, "from vllm import LLM, SamplingParams"), model_dir))  # §5.1
    assert len(ns["outputs"][0].outputs[0].token_ids) <= 100
    del ns
    assert "Finish reason:" in capsys.readouterr().out


def test_optimisation_config_blocks_accepted_with_one_warning_each(model_dir, caplog):
    caplog.set_level("WARNING")
    ns = run("from pagedllm import LLM\n" + port(block(A, 634, 658, "llm = LLM("), model_dir))  # §5.3
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("use_v2_block_manager" in m for m in warned) == 1, warned
    assert sum("FLASHINFER" in m and "CPU_ATTN" in m for m in warned) == 1, warned
    assert ns["llm"].llm_engine.scheduler.max_num_seqs == 256
    del ns
    ns = run(port(block(B, 86, 95, "from vllm import LLM"), model_dir))  # 001: block_size / swap_space
    assert ns["llm"].llm_engine.cache_config.block_size == 16
    assert ns["llm"].llm_engine.cache_config.swap_space == 4


def test_custom_api_service_and_prometheus_blocks(model_dir):
    """§3.3's FastAPI service (V0-style engine introspection in /metrics) and §7.2's Prometheus
    handler, which extends the same app."""
    from fastapi.testclient import TestClient

    ns = run(port(block(A, 369, 477, "from fastapi import FastAPI"), model_dir))
    with TestClient(ns["app"]) as client:
        assert client.get("/health").json()["status"] == "healthy"
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        stats = client.get("/metrics").json()
        assert stats == {"num_running_requests": 0, "num_waiting_requests": 0, "max_num_seqs": 64,
                         "gpu_memory_utilization": 0.9}
        exec(compile(port(block(A, 819, 840, "from prometheus_client import"), model_dir), "<seed>", "exec"), ns)
        text = asyncio.run(ns["prometheus_metrics"]()).body.decode()
        assert "vllm_running_requests 0.0" in text and "vllm_waiting_requests 0.0" in text
    del ns


def test_benchmark_and_tuning_loops(model_dir, capsys):
    """§4.3's benchmark_model and §7.1's tune_performance: engine after engine in one process,
    each freed with `del llm; torch.cuda.empty_cache()` (on the CPU the latter does nothing)."""
    ns = run(port(block(A, 526, 592, "import time"), model_dir))
    result = ns["benchmark_model"](model_dir, tp_size=1)
    assert result["num_prompts"] == 50 and result["total_tokens"] > 0
    run(port(block(A, 753, 815, "# 性能调优基准测试脚本"), model_dir))
    out = capsys.readouterr().out
    for name in ("default", "high_batch", "chunked_prefill", "cuda_graph", "all_optimizations"):
        assert re.search(rf"{name}\s*:\s+[\d.]+ tokens/s", out), out[-2000:]


def _parse_launch(command: str) -> None:
    """Parse a `python -m pagedllm.entrypoints.openai.api_server ...` line as the server does and
    resolve its engine config (no model is loaded); ValueError when refused."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.api_server import parse_server_args

    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "pagedllm.entrypoints.openai.api_server"], argv
    args = parse_server_args(argv[3:])
    EngineArgs.from_cli_args(args).create_engine_config()


def test_quantized_model_blocks(model_dir, capsys):
    """§4.1 / §4.2 as written (only the model name points at a local checkpoint): LLM(...,
    quantization="awq" | "gptq") on AWQ / GPTQ checkpoints of the seed model, packed as AutoAWQ /
    AutoGPTQ pack them (tests/quantization/quant_ckpt.py), with the seed model's tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from tests.quantization.quant_ckpt import awq_checkpoint, gptq_checkpoint

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    blocks = ((awq_checkpoint, 495, 508, "from vllm import LLM", "TheBloke/Qwen2.5-72B-Instruct-AWQ"),
              (gptq_checkpoint, 512, 520, "# GPTQ", "TheBloke/Qwen2.5-72B-Instruct-GPTQ"))
    for make, start, end, first, name in blocks:
        path, _ = make(model)
        for f in Path(model_dir).iterdir():
            if "token" in f.name or f.name.endswith(".jinja"):
                shutil.copy(f, path / f.name)
        code = port(block(A, start, end, first), model_dir).replace(f'"{name}"', repr(str(path)))
        if start == 512:  # §4.2 builds the engine only; generate once with it, as §4.1 does
            code = "from vllm import LLM\n".replace("vllm", "pagedllm") + code
        ns = run(code)
        assert ns["llm"].llm_engine.model_config.quantization == name.rsplit("-", 1)[1].lower()
        out = ns["llm"].generate(["解释什么是PagedAttention。"], use_tqdm=False)[0].outputs[0]
        assert out.finish_reason in ("stop", "length")
        del ns
    assert capsys.readouterr().out.strip()  # §4.1 printed its answer


def test_launch_commands(model_dir, tmp_path):
    # §3.1 (its chat template path is a placeholder: point it at a real template file).
    template = tmp_path / "chat_template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    _parse_launch(port(block(A, 313, 321, "python -m vllm"), model_dir).replace("/path/to/chat_template.jinja", str(template)))
    _parse_launch(port(block(B, 30, 30, "python -m vllm"), model_dir))  # 001's first launch line
    _parse_launch(port(block(B, 104, 112, "python -m vllm"), model_dir))  # --num-scheduler-steps 1
    with pytest.raises(ValueError, match="awq"):  # §4.1: AWQ names the method (issue 19 builds it)
        _parse_launch(port(block(A, 486, 492, "python -m vllm"), model_dir).replace(
            "TheBloke/Qwen2.5-72B-Instruct-AWQ", model_dir))
    with pytest.raises(ValueError, match="pipeline_parallel_size|distributed-executor-backend|ray"):  # §5.2
        _parse_launch(port(block(A, 620, 626, "python -m vllm"), model_dir).replace("--tensor-parallel-size 4", "--tensor-parallel-size 1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_article_clients(model_dir):
    """001's launch command (with --num-scheduler-steps 1) serves 001's aiohttp benchmark (100
    concurrent chats) and §3.2's openai client code."""
    p = _free_port()
    command = port(block(B, 104, 112, "python -m vllm"), model_dir, p).replace("\\\n", " ")
    argv = [sys.executable, *shlex.split(command)[1:]]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "0.01", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{p}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        ns = run(port(block(B, 120, 148, "import asyncio"), model_dir, p))
        assert "benchmark" in ns
        client_code = port(block(A, 327, 356, "from openai import OpenAI"), model_dir, p)
        run(client_code.replace("http://localhost:8000/v1", f"http://127.0.0.1:{p}/v1"))
        import openai

        with pytest.raises(openai.APIStatusError):  # §3.2's embeddings: no embedding model (issue 21)
            run(port(block(A, 327, 333, "from openai import OpenAI"), model_dir, p).replace(
                "http://localhost:8000/v1", f"http://127.0.0.1:{p}/v1") + port(block(A, 359, 363, "embed_response"), model_dir))
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "--num-scheduler-steps has no effect" in out
