"""Pipeline parallel on the CPU: throughput with the engine core's batch queue vs one batch at a time.

    PYTHONPATH=$PWD python scripts/pp_overlap.py [--device-ms-per-token 5 --hidden 256 --layers 2 --batch 8 ...]

One engine (mp executor, pipeline_parallel_size P, one torch thread per rank) serves the same
greedy batch in turns, two ways:

    queue   the default: up to P batches in flight, each with ~1/P of the requests (the stages overlap)
    serial  the batch queue cut to one batch and every request in that batch (what the engine did
            before the queue: the stages run one after another within each step)

A dummy-weight Llama runs it. `--device-ms-per-token X` makes every stage artificially heavy the
way a GPU is: each rank sleeps X ms per scheduled token once its inputs are there, before its layers
(device time that costs no CPU; the ranks pick the patch up from a sitecustomize.py this script
puts on their PYTHONPATH; nothing in pagedllm changes). With 0 the stages' own CPU compute is the
work, which overlaps only where the machine has a free core per rank. The turns alternate (queue, serial, queue, ...) so a machine that is busy with something else slows both
alike; the table gives the median tokens/s (prompt + output) of each, their ratio, the tokens (the two must
be equal), and how often stage 0 started step i+1 before the last stage finished step i.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

# Run by every rank process at start (Python's site hook): once a stage has its inputs (the previous
# stage's activations received), its layers first "compute" on a device for `s` seconds per
# scheduled token (a sleep: the CPU stays free, as with a GPU), then run.
SITECUSTOMIZE = """
import time
import pagedllm.distributed.pipeline as _pipeline

_forward_stage = _pipeline.forward_stage


class _Heavy:
    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, *args):
        time.sleep({s} * input_ids.shape[0])
        return self._model(input_ids, *args)


def _heavy_forward_stage(model, input_ids, positions, md, pp=None):
    return _forward_stage(_Heavy(model), input_ids, positions, md, pp)


_pipeline.forward_stage = _heavy_forward_stage
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device-ms-per-token", type=float, default=5.0)
    args = ap.parse_args()

    import logging

    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.batch_queue import BatchQueue

    logging.disable(logging.INFO)
    if args.device_ms_per_token > 0:
        site = Path(tempfile.mkdtemp(prefix="pagedllm-pp-site-"))
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(s=args.device_ms_per_token / 1000))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    d = Path(tempfile.mkdtemp(prefix="pagedllm-pp-"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "float32",
    }))
    llm = LLM(str(d), load_format="dummy", skip_tokenizer_init=True, pipeline_parallel_size=args.pp,
              distributed_executor_backend="mp", max_num_seqs=args.batch, cpu_threads=1,
              max_num_batched_tokens=args.batch * args.prompt_len, num_gpu_blocks_override=256)
    core = llm.llm_engine.engine_core
    executor = core.model_executor
    prompts = [{"prompt_token_ids": [(7 * b + i) % 4000 + 1 for i in range(args.prompt_len)]}
               for b in range(args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.decode, ignore_eos=True)

    def run(mode: str) -> tuple[float, list[list[int]], int, int]:
        """(prompt + output tokens/s, tokens, steps, steps where stage 0 ran ahead of the last stage)."""
        queue = BatchQueue(args.pp if mode == "queue" else 1)
        core.batch_queue = queue
        core.scheduler.pp_size = args.pp if mode == "queue" else 1  # serial: one batch of every request
        llm.reset_prefix_cache()
        steps0 = core.step_count
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = core.step_count - steps0
        times = executor.collective_rpc("step_times")
        first, last = times[0][-steps:], times[-1][-steps:]
        ahead = sum(first[i + 1][0] < last[i][1] for i in range(steps - 1))
        return args.batch * (args.prompt_len + args.decode) / wall, [list(o.outputs[0].token_ids) for o in outs], steps, ahead

    run("queue")  # warm-up
    results: dict[str, list[tuple[float, list[list[int]], int, int]]] = {"queue": [], "serial": []}
    for _ in range(args.rounds):
        for mode in ("queue", "serial"):
            results[mode].append(run(mode))

    q = statistics.median(r[0] for r in results["queue"])
    s = statistics.median(r[0] for r in results["serial"])
    same = all(r[1] == results["queue"][0][1] for rs in results.values() for r in rs)
    print(f"pp={args.pp} hidden={args.hidden} layers={args.layers} batch={args.batch} prompt={args.prompt_len} "
          f"decode={args.decode} fp32, 1 thread per rank, {args.rounds} rounds, "
          f"device time {args.device_ms_per_token} ms/token/stage")
    print(f"{'mode':>7} {'tok/s (median)':>15} {'each round':>24} {'steps':>6} {'stage 0 ahead':>14}")
    for mode, rs in results.items():
        each = " ".join(f"{r[0]:.1f}" for r in rs)
        print(f"{mode:>7} {statistics.median(r[0] for r in rs):>15.1f} {each:>24} {rs[0][2]:>6} {rs[0][3]:>14}")
    print(f"queue / serial = {q / s:.2f}; tokens identical: {same}")


if __name__ == "__main__":
    main()
