"""Measure what each rank sends per step on the CPU (gloo over loopback) and set it beside the formula.

    PYTHONPATH=$PWD python scripts/measure_comm.py [--tp 2 --pp 1] [--hidden 512 ...]

A random (load_format dummy) Llama of the given shape runs under the mp executor. The measurement is
the kernel's count of bytes each rank process wrote (`wchar` in /proc/<pid>/io: socket writes
included, so gloo's own headers count too) over one prefill step and D decode steps, minus an idle
baseline; the formula (docs/DISTRIBUTED.md) counts only tensor payload. Prints one table row per
rank: measured, formula, ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def formula_bytes(rank: int, tp: int, pp: int, hidden: int, layers: int, vocab_padded: int, elem: int,
                  tokens: int, sample_rows: int) -> int:
    """Tensor payload rank `rank` sends for `tokens` scheduled tokens and `sample_rows` sampling rows."""
    tp_rank, stage = rank % tp, rank // tp
    stage_layers = layers // pp + (1 if stage < layers % pp else 0)
    total = 0
    if tp > 1:
        ring = 2 * (tp - 1) / tp  # a ring all-reduce sends 2 (n-1)/n of the tensor per rank
        total += 2 * stage_layers * ring * tokens * hidden * elem  # after o_proj and down_proj
        if stage == 0:
            total += ring * tokens * hidden * elem  # the vocab-parallel embedding
        if stage == pp - 1:
            total += (tp - 1) * sample_rows * (vocab_padded // tp) * elem  # logits all-gather
    if pp > 1 and stage < pp - 1:
        total += 2 * tokens * hidden * elem  # hidden states + residual to the next stage
    # Nothing travels back between stages: the sampled ids reach every stage in the next step's
    # SchedulerOutput (CachedRequestData.new_token_ids), from the driver.
    del tp_rank
    return int(total)


def wchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no wchar for pid {pid}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args()

    import logging

    from pagedllm import LLM, SamplingParams

    logging.disable(logging.INFO)  # rank logs are writes too
    d = Path(tempfile.mkdtemp(prefix="pagedllm-comm-"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 8,
        "num_key_value_heads": 4, "vocab_size": args.vocab, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "float32",
    }))
    llm = LLM(str(d), load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=args.tp,
              pipeline_parallel_size=args.pp, distributed_executor_backend="mp", max_num_seqs=args.batch,
              max_num_batched_tokens=args.batch * args.prompt_len, num_gpu_blocks_override=256, cpu_threads=1)
    executor = llm.llm_engine.engine_core.model_executor
    pids = [p.pid for p in executor.processes]
    prompts = [{"prompt_token_ids": [(7 * b + i) % args.vocab + 1 for i in range(args.prompt_len)]}
               for b in range(args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.decode + 1, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up (and the idle cost of one run's messages)
    llm.reset_prefix_cache()
    before = [wchar(p) for p in pids]
    steps0 = llm.llm_engine.engine_core.step_count
    llm.generate(prompts, sp, use_tqdm=False)
    measured = [wchar(p) - b for p, b in zip(pids, before)]
    # 1 + decode with one batch at a time; with PP the batch queue splits the requests over P batches.
    steps = llm.llm_engine.engine_core.step_count - steps0
    tokens = args.batch * args.prompt_len + args.batch * args.decode
    rows = args.batch * (1 + args.decode)  # every request samples once per token it produces
    vocab_padded = -(-args.vocab // (64 * args.tp)) * 64 * args.tp
    print(f"tp={args.tp} pp={args.pp} hidden={args.hidden} layers={args.layers} vocab={args.vocab} fp32; "
          f"{steps} steps, {tokens} tokens, {rows} sampled rows")
    print(f"{'rank':>4} {'measured B/step':>16} {'formula B/step':>15} {'ratio':>6}")
    for rank, m in enumerate(measured):
        f = formula_bytes(rank, args.tp, args.pp, args.hidden, args.layers, vocab_padded, 4, tokens, rows)
        print(f"{rank:>4} {m / steps:>16.0f} {f / steps:>15.0f} {m / max(f, 1):>6.2f}")


if __name__ == "__main__":
    main()
