"""Tensor / pipeline parallel on GPUs (NCCL): greedy tokens of TP=2, PP=2 (and TP=2 x PP=2 on 4 GPUs)
against TP=1, on a random Llama in float32, each with CUDA graphs (every rank captures its own; a
PP stage's activations pass through static buffers) and eager (enforce_eager) beside it.

    PYTHONPATH=$PWD python scripts/gpu_parallel_check.py            # 2 GPUs: tp2, pp2; 4+: also tp2xpp2

TP / PP layouts need at least 2 GPUs: NCCL refuses two ranks on one device ("Duplicate GPU
detected"), so one GPU runs only the multiprocess executor's one-rank layouts against the in-process one. Needs msgspec and pyzmq (the mp executor's per-step messages)
besides torch and transformers. Prints one table row per layout: tokens equal to TP=1, engine start
seconds, decode tok/s (graphs against eager shows the captured graphs replaying on every rank).
"""

from __future__ import annotations

import gc
import tempfile
import time

import torch
import transformers

from pagedllm import LLM, SamplingParams


def tiny_llama(path: str) -> None:
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=2048, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(path)


def run(path: str, **parallel: int) -> tuple[list[list[int]], float, float]:
    t0 = time.monotonic()
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
              **parallel)
    start_s = time.monotonic() - t0
    prompts = [{"prompt_token_ids": [(13 * i + j) % 31000 + 1 for j in range(20 + 37 * i)]} for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    t1 = time.monotonic()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    tok_s = 8 * 64 / (time.monotonic() - t1)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return tokens, start_s, tok_s


def main() -> None:
    n = torch.cuda.device_count()
    path = tempfile.mkdtemp(prefix="pagedllm-gpu-tp-")
    tiny_llama(path)
    layouts = [dict(tensor_parallel_size=1)]
    # One GPU (the lent kind here): the multiprocess executor's one-rank run, its worker process
    # joining an NCCL world of one (init, broadcast of each step, output return), with graphs and eager.
    layouts += [dict(tensor_parallel_size=1, distributed_executor_backend="mp"),
                dict(tensor_parallel_size=1, distributed_executor_backend="mp", enforce_eager=True)]
    if n >= 2:
        layouts += [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enforce_eager=True),
                    dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, enforce_eager=True)]
    if n >= 4:
        layouts += [dict(tensor_parallel_size=2, pipeline_parallel_size=2),
                    dict(tensor_parallel_size=2, pipeline_parallel_size=2, enforce_eager=True)]
    rows = []
    ref = None
    for layout in layouts:
        tokens, start_s, tok_s = run(path, **layout)
        ref = ref if ref is not None else tokens
        rows.append((layout, tokens == ref, start_s, tok_s))
    print(f"{'layout':<70} {'== TP1':>7} {'start s':>8} {'tok/s':>8}")
    for layout, same, start_s, tok_s in rows:
        print(f"{str(layout):<70} {str(same):>7} {start_s:>8.1f} {tok_s:>8.0f}")


if __name__ == "__main__":
    main()
