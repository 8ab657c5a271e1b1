"""`pagedllm generate` answers with the embedded SmolLM2."""

import subprocess
import sys


def test_generate_answers_paris():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", "generate", "--prompt", "What is the capital of France?",
         "--temperature", "0", "--max-tokens", "32", "--max-model-len", "1024"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_bad_flag_value_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm", "generate", "--prompt", "x", "--temperature", "5"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "temperature must be a number in [0, 2]" in proc.stderr
