"""`pagedllm bench throughput | latency | prefix` end to end on a tiny random model (CPU, a few requests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from tests.utils import tiny_model

# Given, so the tests need not measure the CPU (measure_device has its own test).
DEVICE = ["--hbm-bandwidth", "1e10", "--peak-flops", "1e11"]


@pytest.fixture(autouse=True)
def small_cpu_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU variable for the KV cache size, as its CPU users set it: the default 4 GiB is 262,144
    blocks of this tiny model, and the suite's per-step block-pool check (PAGEDLLM_DEBUG_BLOCKS) over
    them made a decode step ~450 ms instead of ~1 ms. 0.01 GiB: 655 blocks, still sized by the same rule."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_model("qwen3")[0]


def test_bench_throughput(model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", model_dir, "--dataset", "random", "--num-prompts", "6",
               "--random-input-len-range", "8", "40", "--output-len", "5", "--random-token-max", "500",
               "--max-num-batched-tokens", "64", "--output-json", str(out), *DEVICE])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Throughput:" in text and "requests/s" in text and "total tokens/s" in text and "output tokens/s" in text
    assert "Elapsed:" in text and "Speed-of-light floor:" in text and "reached" in text
    r = json.loads(out.read_text())
    assert r["num_requests"] == 6 and r["total_output_tokens"] == r["expected_output_tokens"] == 30
    assert r["output_tokens_per_second"] == pytest.approx(30 / r["elapsed_time"])
    assert 0 < r["fraction_of_floor"] == pytest.approx(r["output_tokens_per_second"] / r["floor_output_tokens_per_second"])
    assert r["device"] == "cpu" and r["device_spec"].endswith("(given)") and r["temperature"] == 1.0


def test_bench_throughput_rejects_ids_beyond_the_vocabulary(model_dir: str, capsys) -> None:
    rc = main(["bench", "throughput", "--model", model_dir, "--num-prompts", "2", "--input-len", "4",
               "--output-len", "2", *DEVICE])  # default --random-token-max 10000 > vocab 512
    assert rc == 2 and "lower --random-token-max" in capsys.readouterr().err


def test_bench_latency(model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", model_dir, "--batch-size", "2", "--input-len", "12",
               "--output-len", "6", "--num-iters-warmup", "1", "--num-iters", "3", "--random-token-max", "500",
               "--output-json", str(out), *DEVICE])
    assert rc == 0
    text = capsys.readouterr().out
    for field in ("Avg latency:", "50% percentile latency:", "99% percentile latency:", "Decode step (batch 2): mean",
                  "Speed-of-light floor per decode step:"):
        assert field in text
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 3 and r["num_decode_steps"] == 5  # the prefill step yields the first token
    assert r["avg_latency"] > 5 * r["decode_step_time"] > 0
    assert r["fraction_of_floor"] == pytest.approx(r["floor_decode_step_time"] / r["decode_step_time"])


def test_bench_prefix(model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    # prefix 64 tokens = 4 blocks of 16; prompts of 72 tokens; 4 requests a wave.
    rc = main(["bench", "prefix", "--model", model_dir, "--prefix-len", "64", "--question-len", "8",
               "--num-prompts", "4", "--output-len", "3", "--random-token-max", "500", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "prefix caching on  wave 2" in text and "prefix caching off wave 2" in text and "fewer prompt tokens" in text
    waves = {(w["prefix_caching"], w["wave"]): w for w in json.loads(out.read_text())["waves"]}
    assert len(waves) == 4
    for w in waves.values():
        assert w["prompt_tokens"] == 4 * 72 and w["median_ttft"] > 0 and w["output_tokens_per_second"] > 0
    # Without caching every prompt token is computed; with it, wave 2 computes the questions only.
    assert waves[(False, 1)]["computed_prompt_tokens"] == waves[(False, 2)]["computed_prompt_tokens"] == 288
    assert waves[(True, 2)]["computed_prompt_tokens"] == 4 * 8
    assert waves[(True, 2)]["cache_hit_tokens"] == waves[(True, 2)]["num_cached_tokens"] == 4 * 64
