"""`pagedllm bench latency`: the time of one batch, end to end, and of each of its decode steps.

    pagedllm bench latency --model qwen3-0.6b --load-format dummy --batch-size 1 \\
        --input-len 128 --output-len 257

Each iteration adds `--batch-size` requests to the engine and drives `LLMEngine.step()` itself, timing
every step. The steps until every request has its first token are the prefill; the rest are decode
steps, whose mean is the per-step time (vLLM's peer_vllm_latency.py gets the same figure as
(time(output N) - time(output 1)) / (N - 1)). The floor of a decode step (roofline.py) is printed beside it.

Each iteration draws fresh prompts (seed + iteration), so the prefix cache never shortens a prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from pagedllm.benchmarks import roofline
from pagedllm.benchmarks.datasets import check_fits, random_requests
from pagedllm.benchmarks.throughput import add_roofline_args, make_llm, measured_device
from pagedllm.engine.arg_utils import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    add_roofline_args(parser)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=1.0, help="vLLM's bench latency samples at 1.0")
    parser.add_argument("--random-token-max", type=int, default=10000, help="prompt token ids in [0, MAX)")
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


@dataclass
class BatchTiming:
    latency: float  # seconds, first add_request to the last token
    prefill_steps: list[float]
    decode_steps: list[float]


def time_batch(llm, prompts: list[list[int]], output_len: int, temperature: float, tag: str) -> BatchTiming:
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(
        temperature=temperature,
        max_tokens=output_len,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    waiting_first = set(ids)
    prefill: list[float] = []
    decode: list[float] = []
    t_start = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        is_decode = not waiting_first  # every request had its first token before this step
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        (decode if is_decode else prefill).append(dt)
        for o in outs:
            if o.outputs and o.outputs[0].token_ids:
                waiting_first.discard(o.request_id)
    return BatchTiming(time.perf_counter() - t_start, prefill, decode)


@dataclass
class LatencyResult:
    avg_latency: float
    latencies: list[float]
    percentiles: dict[str, float]
    avg_prefill_time: float  # seconds, the steps until every request has its first token
    decode_step_time: float  # seconds, mean over every decode step of every iteration
    decode_step_time_p50: float
    num_decode_steps: int  # per iteration
    floor_decode_step_time: float
    fraction_of_floor: float
    device: str
    device_spec: str
    dtype: str


def run_latency(
    llm,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters_warmup: int,
    num_iters: int,
    temperature: float,
    dev: roofline.DeviceSpec,
    seed: int = 0,
    token_max: int = 10000,
) -> LatencyResult:
    if min(batch_size, input_len, num_iters) < 1 or output_len < 2:
        raise ValueError("need batch_size, input_len, num_iters >= 1 and output_len >= 2 (one decode step).")
    mc = llm.llm_engine.config.model_config

    def batch(i: int) -> list[list[int]]:
        reqs = random_requests(
            batch_size, (input_len, input_len), (output_len, output_len), token_max, seed + i
        )
        check_fits(reqs, mc.hf_config.vocab_size, mc.max_model_len)
        return [r.prompt_token_ids for r in reqs]

    for i in range(num_iters_warmup):
        time_batch(llm, batch(i), output_len, temperature, f"warmup{i}")
    timings = [
        time_batch(llm, batch(num_iters_warmup + i), output_len, temperature, f"iter{i}")
        for i in range(num_iters)
    ]
    latencies = [t.latency for t in timings]
    steps = [s for t in timings for s in t.decode_steps]
    if not steps:
        raise ValueError("no decode step was timed (the batch finished in its prefill steps).")
    n_decode = len(timings[0].decode_steps)
    floor = roofline.mean_decode_step_floor(
        roofline.ModelShape.from_hf_config(mc.hf_config),
        batch_size,
        input_len,
        n_decode,
        dev,
        *roofline.engine_bytes(mc, llm.llm_engine.config.cache_config),
    )
    step = statistics.fmean(steps)
    return LatencyResult(
        avg_latency=statistics.fmean(latencies),
        latencies=latencies,
        percentiles={str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
        avg_prefill_time=statistics.fmean(sum(t.prefill_steps) for t in timings),
        decode_step_time=step,
        decode_step_time_p50=statistics.median(steps),
        num_decode_steps=n_decode,
        floor_decode_step_time=floor,
        fraction_of_floor=floor / step,
        device=llm.llm_engine.config.device_config.device,
        device_spec=dev.describe(),
        dtype=str(mc.dtype).removeprefix("torch."),
    )


def print_result(r: LatencyResult, batch_size: int) -> None:
    print(f"Avg latency: {r.avg_latency:.4f} seconds")
    for p, v in r.percentiles.items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    print(f"Prefill (until every request has its first token): {r.avg_prefill_time * 1e3:.2f} ms")
    print(
        f"Decode step (batch {batch_size}): mean {r.decode_step_time * 1e3:.3f} ms, "
        f"p50 {r.decode_step_time_p50 * 1e3:.3f} ms over {r.num_decode_steps} steps per iteration"
    )
    print(
        f"Speed-of-light floor per decode step: {r.floor_decode_step_time * 1e3:.3f} ms "
        f"on {r.device} {r.dtype} "
        f"at {r.device_spec}; reached {100 * r.fraction_of_floor:.1f}% of it"
    )


def main(args: argparse.Namespace) -> int:
    dev = measured_device(args)
    llm = make_llm(args)
    result = run_latency(
        llm,
        args.batch_size,
        args.input_len,
        args.output_len,
        args.num_iters_warmup,
        args.num_iters,
        args.temperature,
        dev,
        args.seed or 0,
        args.random_token_max,
    )
    print_result(result, args.batch_size)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    **asdict(result),
                    "model": args.model,
                    "batch_size": args.batch_size,
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                },
                f,
                indent=2,
            )
    return 0
