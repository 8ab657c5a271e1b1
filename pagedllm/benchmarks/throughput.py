"""`pagedllm bench throughput`: offline throughput, every request handed to `LLM.generate` at once.

    pagedllm bench throughput --model qwen3-0.6b --load-format dummy --dataset w1

prints vLLM's line (requests/s, total tokens/s, output tokens/s), the elapsed time, and the
speed-of-light floor of the same schedule (see roofline.py) with the fraction of it reached.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagedllm.benchmarks import roofline
from pagedllm.benchmarks.datasets import SampleRequest, add_dataset_args, check_fits, requests_from_args
from pagedllm.engine.arg_utils import EngineArgs

# Sampling as the benchmarks we compare with: vLLM's `bench throughput` samples at temperature 1.0;
# the W1 peers (nano-vllm's bench, peer_vllm.py) at 0.6. EOS is ignored either way.
VLLM_BENCH_TEMPERATURE = 1.0
W1_TEMPERATURE = 0.6


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    add_dataset_args(parser)
    add_roofline_args(parser)
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"default {W1_TEMPERATURE} for w1 (as the peers), {VLLM_BENCH_TEMPERATURE} otherwise",
    )
    parser.add_argument(
        "--num-warmup",
        type=int,
        default=1,
        help="short requests run (untimed) before the measurement, e.g. to compile kernels",
    )
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")
    parser.add_argument(
        "--kv-snapshot-interval-s",
        type=float,
        default=0.0,
        help="map the KV block pool this often, as the server does while its web console is on "
             "(web_ui.KV_SNAPSHOT_INTERVAL_S), to measure what that costs; 0: never (default)",
    )
    parser.set_defaults(func=main)


def add_roofline_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speed-of-light floor")
    g.add_argument(
        "--hbm-bandwidth",
        type=float,
        default=None,
        help="device memory bandwidth, bytes/s (e.g. 4.3e12); default: measured at start",
    )
    g.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="matmul FLOP/s in the run's dtype (e.g. 790e12); default: measured at start",
    )


def measured_device(args: argparse.Namespace) -> roofline.DeviceSpec:
    """Measured before the engine starts, so its scratch memory is free again when the KV cache is sized."""
    return roofline.device_spec(
        EngineArgs.from_cli_args(args).resolve_device(), args.hbm_bandwidth, args.peak_flops
    )


def make_llm(args: argparse.Namespace, **overrides: Any):
    from pagedllm.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    kwargs.update(overrides)
    return LLM(engine_args.model, **kwargs)


def warmup(llm, num: int) -> None:
    """A few short requests so that kernel compilation and allocator growth stay out of the timing."""
    from pagedllm.sampling_params import SamplingParams

    if num > 0:
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": [1, 2, 3 + i]} for i in range(num)], params, use_tqdm=False)


@dataclass
class ThroughputResult:
    elapsed_time: float
    num_requests: int
    total_num_tokens: int
    total_prompt_tokens: int
    total_output_tokens: int
    expected_output_tokens: int
    requests_per_second: float
    tokens_per_second: float
    output_tokens_per_second: float
    startup_seconds: float
    floor_seconds: float
    floor_output_tokens_per_second: float
    fraction_of_floor: float
    device: str
    device_spec: str
    dtype: str


def engine_floor(llm, requests: list[SampleRequest], dev: roofline.DeviceSpec) -> roofline.Floor:
    config = llm.llm_engine.config
    mc, sc = config.model_config, config.scheduler_config
    db, lb, kv = roofline.engine_bytes(mc, config.cache_config)
    return roofline.throughput_floor(
        roofline.ModelShape.from_hf_config(mc.hf_config),
        [r.prompt_len for r in requests],
        [r.expected_output_len for r in requests],
        dev,
        db,
        sc.max_num_batched_tokens,
        sc.max_num_seqs,
        linear_bytes=lb,
        kv_dtype_bytes=kv,
    )


def run_throughput(
    llm,
    requests: list[SampleRequest],
    temperature: float,
    dev: roofline.DeviceSpec,
    startup_seconds: float = 0.0,
) -> ThroughputResult:
    from pagedllm.sampling_params import SamplingParams

    mc = llm.llm_engine.config.model_config
    check_fits(requests, mc.hf_config.vocab_size, mc.max_model_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=r.expected_output_len,
            detokenize=False,
        )
        for r in requests
    ]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    floor = engine_floor(llm, requests, dev)
    out_tps = output_tokens / elapsed
    return ThroughputResult(
        elapsed_time=elapsed,
        num_requests=len(requests),
        total_num_tokens=prompt_tokens + output_tokens,
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        expected_output_tokens=sum(r.expected_output_len for r in requests),
        requests_per_second=len(requests) / elapsed,
        tokens_per_second=(prompt_tokens + output_tokens) / elapsed,
        output_tokens_per_second=out_tps,
        startup_seconds=startup_seconds,
        floor_seconds=floor.seconds,
        floor_output_tokens_per_second=floor.output_tok_per_s,
        fraction_of_floor=out_tps / floor.output_tok_per_s,
        device=llm.llm_engine.config.device_config.device,
        device_spec=dev.describe(),
        dtype=str(mc.dtype).removeprefix("torch."),
    )


def print_result(r: ThroughputResult) -> None:
    print(
        f"Throughput: {r.requests_per_second:.2f} requests/s, {r.tokens_per_second:.2f} total tokens/s, "
        f"{r.output_tokens_per_second:.2f} output tokens/s"
    )
    print(
        f"Elapsed: {r.elapsed_time:.2f} s for {r.num_requests} requests, "
        f"{r.total_prompt_tokens} prompt tokens, "
        f"{r.total_output_tokens} output tokens (expected {r.expected_output_tokens}); "
        f"engine ready in {r.startup_seconds:.1f} s"
    )
    print(
        f"Speed-of-light floor: {r.floor_seconds:.4g} s -> "
        f"at most {r.floor_output_tokens_per_second:.0f} output "
        f"tokens/s on {r.device} {r.dtype} at {r.device_spec}; reached {100 * r.fraction_of_floor:.1f}% of it"
    )


def main(args: argparse.Namespace) -> int:
    requests = requests_from_args(args)
    temperature = args.temperature
    if temperature is None:
        temperature = W1_TEMPERATURE if args.dataset_name == "w1" else VLLM_BENCH_TEMPERATURE
    dev = measured_device(args)
    t0 = time.perf_counter()
    llm = make_llm(args)
    startup = time.perf_counter() - t0
    warmup(llm, args.num_warmup)
    result = run_throughput(llm, requests, temperature, dev, startup)
    print_result(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    **asdict(result),
                    "model": args.model,
                    "dataset": args.dataset_name,
                    "temperature": temperature,
                },
                f,
                indent=2,
            )
    return 0
