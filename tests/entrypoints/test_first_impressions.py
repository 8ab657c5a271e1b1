"""First impressions: the package imports and runs on a CPU machine without Triton (only the
declared dependencies), `pagedllm --version`, a taken port refused before the model loads, Ctrl-C
in `pagedllm chat` stops the answer (no traceback) and the prompt says /exit exists."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_path_never_imports_triton(tmp_path):
    script = tmp_path / "no_triton.py"
    script.write_text(textwrap.dedent('''
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is not installed here")
        sys.meta_path.insert(0, Block())
        import pagedllm
        from pagedllm import LLM, SamplingParams
        import pagedllm.entrypoints.openai.api_server, pagedllm.entrypoints.cli
        from tests.utils import tiny_model
        path, _ = tiny_model("llama3")
        llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=32, max_model_len=64)
        out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        print("CPU-OK")
    '''))
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "CPU-OK" in r.stdout, r.stderr[-3000:]


def test_version_flag(capsys):
    import pagedllm
    from pagedllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == pagedllm.__version__


def test_taken_port_is_refused_before_the_model_loads(monkeypatch, capsys):
    from pagedllm.entrypoints.openai import api_server

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(api_server, "AsyncLLM", no_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = api_server.parse_server_args(["--host", "127.0.0.1", "--port", str(port), "--model", "qwen3-0.6b",
                                             "--load-format", "dummy"])
        with pytest.raises(SystemExit) as e:
            api_server.run_server(args)
    assert e.value.code == 2 and f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_ctrl_c_in_chat_stops_the_answer(tiny_model_dir, monkeypatch, capsys):
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.cli import main

    lines = iter(["Hello", "Again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    real_step, calls = LLMEngine.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    rc = main(["chat", "--model", str(tiny_model_dir), "--max-model-len", "256", "--num-gpu-blocks-override", "64",
               "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0 and "/exit" in out and out.count("[stopped]") == 1
