"""The new model families on the GPU: correctness of the Triton paths with and without CUDA graphs,
the fused MoE kernel against its floor, and W1 throughput of two MoE shapes. Table printed last.

Usage, from the repo root on the GPU machine (~7 min in all; sections run in this order):
    python3 scripts/gpu_models_check.py [--only correctness moe-kernel w1]
Sections:
    correctness  tiny fp32 models of every new architecture (Mixtral, Qwen2-MoE, Qwen3-MoE, Gemma 2,
                 Gemma 3, Phi-3 LongRoPE, Mistral with a window shorter than the context, DeepSeek V2,
                 DeepSeek V3): greedy tokens on CUDA (graphs, then eager) == the CPU torch reference, ~3 min
                 (GPU_CHECK_MODES=graphs: graphs only; with max_num_batched_tokens 256 most steps mix
                 prefill chunks with decodes, so graphs cover mixed-step graphs too)
    moe-kernel   fused_experts per layer-step for the Qwen3-30B-A3B and DeepSeek-V2-Lite expert shapes
                 (bf16, CUDA-graph replay), against the floor: the experts hit, read once, at the copy
                 bandwidth measured here, ~20 s
    w1           `pagedllm bench throughput --dataset w1` on pagedllm/model_configs/qwen3-30b-a3b and
                 deepseek-v2-lite (dummy bf16 weights), ~3 min; vLLM's figure comes from
                 scripts/peer_vllm.py on the same config directories
"""

from __future__ import annotations

import functools
import gc
import os
import random
import tempfile
import traceback

import torch
from _gpu_common import (
    MOE_SHAPES,
    bench_w1,
    copy_bandwidth,
    graph_time_us,
    moe_expert_weights,
    moe_floor_us,
    record,
    run_sections,
)

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, max_position_embeddings=1024)
MLA = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=64,
           n_shared_experts=1, first_k_dense_replace=1, num_experts_per_tok=2, n_routed_experts=8, num_key_value_heads=4)
ARCHS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=96, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64)),
    "gemma2": ("Gemma2Config", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                                    attn_logit_softcapping=20.0, final_logit_softcapping=15.0)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                                        sliding_window_pattern=2)),
    "phi3": ("Phi3Config", dict(original_max_position_embeddings=512, pad_token_id=0,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "short_factor": [1.0 + i / 32 for i in range(16)],
                                                 "long_factor": [1.0 + i / 4 for i in range(16)]})),
    "mistral_window": ("MistralConfig", dict(sliding_window=24)),
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                             topk_group=2, rope_parameters={
                                                 "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "mscale": 0.707, "mscale_all_dim": 0.707,
                                                 "original_max_position_embeddings": 256})),
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, q_lora_rank=48, n_group=4, topk_group=2)),
}


# GPU_CHECK_MODES=graphs runs the CUDA graphs only (half the section's time); default both.
CUDA_MODES = tuple(os.environ.get("GPU_CHECK_MODES", "graphs,eager").split(","))
# GPU_CHECK_ARCHS=deepseek_v2,qwen3_moe checks only those architectures (ARCHS' keys); default all.
CHECK_ARCHS = tuple(a for a in os.environ.get("GPU_CHECK_ARCHS", "").split(",") if a)


def tiny_model_dir(cls: str, extra: dict) -> str:
    import transformers

    cfg = getattr(transformers, cls)(**dict(TINY, **extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)  # save_pretrained names its architecture
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    return path


def correctness() -> None:
    from pagedllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 200))] for _ in range(12)]
    prompts += [prompts[0][:3] + p for p in prompts[1:4]]  # shared prefixes
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    unknown = set(CHECK_ARCHS) - set(ARCHS)
    if unknown:
        raise ValueError(f"GPU_CHECK_ARCHS names unknown architectures {sorted(unknown)}; known: {sorted(ARCHS)}")
    for arch, (cls, extra) in ARCHS.items():
        if CHECK_ARCHS and arch not in CHECK_ARCHS:
            continue
        try:
            path = tiny_model_dir(cls, extra)
            runs = {}
            modes = {"ref-cpu": dict(device="cpu"), "graphs": dict(device="cuda"),
                     "eager": dict(device="cuda", enforce_eager=True)}
            for name, kw in {k: v for k, v in modes.items() if k == "ref-cpu" or k in CUDA_MODES}.items():
                llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, max_num_seqs=16,
                          max_num_batched_tokens=256, gpu_memory_utilization=0.3, num_gpu_blocks_override=512, **kw)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
                runs[name] = [o.outputs[0].token_ids for o in outs]
                del outs, llm
                gc.collect()
                torch.cuda.empty_cache()
            for name in CUDA_MODES:
                same = sum(a == b for a, b in zip(runs["ref-cpu"], runs[name]))
                record(f"{arch} fp32 {name} greedy == CPU torch ref (48 tok)", f"{same}/{len(prompts)}")
        except Exception:  # one architecture failing must not hide the others' rows
            traceback.print_exc()
            record(f"{arch} correctness", "ERROR (traceback above)")


def moe_kernel() -> None:
    from pagedllm.kernels.fused_moe import fused_experts
    from pagedllm.layers.fused_moe.router import select_experts

    bw = copy_bandwidth()
    record("device copy bandwidth", f"{bw / 1e12:.2f} TB/s")
    for shape, (e, top_k, hidden, inter) in MOE_SHAPES.items():
        w13, w2 = moe_expert_weights(e, hidden, inter)
        for tokens in (1, 16, 64, 256, 2048):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            weights, ids = select_experts(torch.randn(tokens, e, device="cuda"), top_k, True)
            us = graph_time_us(functools.partial(fused_experts, x, w13, w2, weights, ids))
            hit = int(torch.unique(ids).numel())
            floor_us = moe_floor_us(hit, hidden, inter, bw)
            record(f"fused MoE {shape} {tokens} tok ({hit}/{e} experts hit)",
                   f"{us:.1f} us, floor {floor_us:.1f} us, {floor_us / us * 100:.0f}% of floor speed")
        del w13, w2
        torch.cuda.empty_cache()


def w1() -> None:
    for model in ("qwen3-30b-a3b", "deepseek-v2-lite"):
        r, proc, seconds = bench_w1(model, timeout=150)
        if r is None:
            record(f"W1 {model}", f"FAILED rc={proc.returncode}")
            continue
        record(f"W1 {model} (dummy bf16)", f"{r['tokens_per_second']:.0f} tok/s total, "
               f"{r['output_tokens_per_second']:.0f} output tok/s ({seconds:.0f} s incl. start)")


def main() -> None:
    sections = {"correctness": correctness, "moe-kernel": moe_kernel, "w1": w1}
    run_sections(sections)


if __name__ == "__main__":
    main()
