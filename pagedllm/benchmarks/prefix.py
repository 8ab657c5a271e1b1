"""`pagedllm bench prefix`: a shared system prompt, two waves, with and without prefix caching.

    pagedllm bench prefix --model qwen3-0.6b --load-format dummy --num-prompts 64

Every request is the same `--prefix-len` (1,000) token system prompt followed by its own
`--question-len` (50) token question. Wave 1 runs to the end, then wave 2 (new questions, same
system prompt) is sent. Per wave it prints the prompt tokens computed (the wave's prompt tokens
less the prefix-cache hits counted by the scheduler), the median time to first token (from each
RequestOutput's metrics: first_token_time - arrival_time) and the throughput. It runs once with
prefix caching and once without (two engines, one after the other) unless
`--enable-prefix-caching` / `--no-enable-prefix-caching` picks one.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm.benchmarks.throughput import make_llm, warmup
from pagedllm.engine.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--prefix-len", type=int, default=1000, help="tokens of the shared system prompt")
    parser.add_argument("--question-len", type=int, default=50, help="tokens of each request's own question")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per wave")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--random-token-max", type=int, default=10000, help="token ids in [0, MAX)")
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


def shared_prefix_waves(
    num_prompts: int, prefix_len: int, question_len: int, token_max: int, seed: int = 0
) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of `num_prompts` prompts: one shared prefix, then 2 * num_prompts distinct questions."""
    if min(num_prompts, prefix_len, question_len, token_max) < 1:
        raise ValueError("num_prompts, prefix_len, question_len and random_token_max must all be >= 1.")
    rng = random.Random(seed)
    prefix = [rng.randrange(token_max) for _ in range(prefix_len)]
    prompts = [
        prefix + [rng.randrange(token_max) for _ in range(question_len)] for _ in range(2 * num_prompts)
    ]
    return prompts[:num_prompts], prompts[num_prompts:]


@dataclass
class WaveResult:
    prefix_caching: bool
    wave: int
    num_requests: int
    prompt_tokens: int
    computed_prompt_tokens: int  # prompt_tokens - prefix-cache hits
    cache_hit_tokens: int
    num_cached_tokens: int  # sum of RequestOutput.num_cached_tokens (the same hits, seen per request)
    median_ttft: float  # seconds
    elapsed: float
    output_tokens_per_second: float
    total_tokens_per_second: float


def run_wave(llm, prompts: list[list[int]], output_len: int, temperature: float, wave: int) -> WaveResult:
    from pagedllm.sampling_params import SamplingParams

    core = llm.llm_engine.engine_core
    enabled = llm.llm_engine.config.cache_config.enable_prefix_caching
    before = core.make_stats()
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = core.make_stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return WaveResult(
        enabled,
        wave,
        len(prompts),
        prompt_tokens,
        prompt_tokens - hits,
        hits,
        sum(o.num_cached_tokens for o in outs),
        statistics.median(ttfts),
        elapsed,
        output_tokens / elapsed,
        (prompt_tokens + output_tokens) / elapsed,
    )


def run_mode(
    args: argparse.Namespace, enable_prefix_caching: bool, waves: tuple[list[list[int]], list[list[int]]]
) -> list[WaveResult]:
    """One engine, both waves; the engine is gone when this returns (so two never share the device)."""
    llm = make_llm(args, enable_prefix_caching=enable_prefix_caching)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    if args.random_token_max > vocab:
        raise ValueError(f"--random-token-max {args.random_token_max} is above the vocabulary ({vocab}).")
    warmup(llm, args.num_warmup)
    results = []
    for i, prompts in enumerate(waves, start=1):
        results.append(run_wave(llm, prompts, args.output_len, args.temperature, i))
        print_wave(results[-1])
    return results


def print_wave(r: WaveResult) -> None:
    print(
        f"prefix caching {'on ' if r.prefix_caching else 'off'} wave {r.wave}: {r.num_requests} requests, "
        f"prompt tokens {r.prompt_tokens}, computed {r.computed_prompt_tokens} "
        f"({100 * (1 - r.computed_prompt_tokens / r.prompt_tokens):.1f}% from the cache), "
        f"median TTFT {r.median_ttft * 1e3:.1f} ms, {r.elapsed:.2f} s, "
        f"{r.output_tokens_per_second:.1f} output tok/s, {r.total_tokens_per_second:.1f} total tok/s"
    )


def main(args: argparse.Namespace) -> int:
    waves = shared_prefix_waves(
        args.num_prompts, args.prefix_len, args.question_len, args.random_token_max, args.seed or 0
    )
    modes = [True, False] if args.enable_prefix_caching is None else [args.enable_prefix_caching]
    results: list[WaveResult] = []
    for mode in modes:
        results += run_mode(args, mode, waves)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    on = {r.wave: r for r in results if r.prefix_caching}
    off = {r.wave: r for r in results if not r.prefix_caching}
    if 2 in on:
        w = on[2]
        print(
            "wave 2 with prefix caching computed "
            f"{100 * (1 - w.computed_prompt_tokens / w.prompt_tokens):.1f}% "
            "fewer prompt tokens than without"
        )
        if 2 in off:
            print(
                f"wave 2 median TTFT: {w.median_ttft * 1e3:.1f} ms with prefix caching, "
                f"{off[2].median_ttft * 1e3:.1f} ms without "
                f"({100 * (1 - w.median_ttft / off[2].median_ttft):.1f}% "
                "lower)"
            )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "prefix_len": args.prefix_len,
                    "question_len": args.question_len,
                    "waves": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return 0
