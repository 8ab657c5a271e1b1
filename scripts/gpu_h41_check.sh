#!/bin/bash
# Branch h41 (issue 24, DeepSeek-V2-Lite W1): GPU == reference for the fused MLA prep kernel, the shared
# experts in the fused MoE and the SiLU in its first GEMM (kernel tests), the tiny fp32 DeepSeek-V2 greedy
# check (CUDA graphs == CPU reference), the kernels' A/B (scripts/gpu_h41_bench.py), then W1 with 64
# requests under scripts/gpu_step_profile.py: plain tok/s and the kernel families, printed last. <= ~120 s on one H200 (each part under its own timeout).
#   bash scripts/gpu_h41_check.sh      (from the worktree root)
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s)
# 1. Kernel tests (small tensors) beside the tiny-model check (a 512-block cache): in parallel.
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_prep.py tests/kernels/test_moe_router.py \
    tests/kernels/test_fused_moe_kernel.py tests/kernels/test_mla_attention.py > /tmp/h41_pytest.log 2>&1 &
PYTEST=$!
timeout 45 python3 - > /tmp/h41_models.log 2>&1 <<'PY'
import gc, random, sys
import torch
sys.path.insert(0, "scripts")
import gpu_models_check as g
from pagedllm import LLM, SamplingParams
rng = random.Random(0)
prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 200))] for _ in range(12)]
prompts += [prompts[0][:3] + p for p in prompts[1:4]]  # shared prefixes
greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
# V2 with V2-Lite's plain softmax routing (the fused router with the shared experts appended); V3's grouped
# torch routing and q_lora run the same code as the CPU tests (tests/models/test_deepseek.py), cut for time.
greedy_v2 = dict(g.ARCHS["deepseek_v2"][1], topk_method="greedy", n_group=1, topk_group=1)
for arch, (cls, extra) in (("deepseek_v2 greedy", ("DeepseekV2Config", greedy_v2)),):
    path = g.tiny_model_dir(cls, extra)
    runs = {}
    for name, kw in (("cpu", dict(device="cpu")), ("graphs", dict(device="cuda"))):
        llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, max_num_seqs=16,
                  max_num_batched_tokens=256, gpu_memory_utilization=0.3, num_gpu_blocks_override=512, **kw)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                    greedy, use_tqdm=False)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(runs["cpu"], runs["graphs"]))
    print(f"MODELS | {arch} fp32 CUDA graphs greedy == CPU torch ref (48 tok) | {same}/{len(prompts)} |", flush=True)
PY
MRC=$?
wait $PYTEST
PRC=$?
echo "== pytest on the GPU: rc=$PRC ($(( $(date +%s) - T0 )) s)"; tail -4 /tmp/h41_pytest.log
echo "== tiny DeepSeek fp32: rc=$MRC ($(( $(date +%s) - T0 )) s)"; grep -E "MODELS|Error" /tmp/h41_models.log | tail -6
# 2. The kernels' A/B at DeepSeek-V2-Lite's shapes (alone on the GPU: timings).
timeout 20 python3 scripts/gpu_h41_bench.py > /tmp/h41_bench.log 2>&1
echo "== kernel A/B: rc=$? ($(( $(date +%s) - T0 )) s)"
# 3. W1, 64 requests: plain tok/s, then the profiled run's kernel families (one engine start).
LEFT=$(( 117 - ($(date +%s) - T0) ))
echo "== W1 (64 requests) profile, ${LEFT} s left"
timeout $LEFT python3 scripts/gpu_step_profile.py --model deepseek-v2-lite --load-format dummy --skip-tokenizer-init \
    --dataset w1 --max-model-len 4096 --num-prompts 64 --top 24 > /tmp/h41_prof.log 2>&1
echo "== profile rc=$? ($(( $(date +%s) - T0 )) s)"
grep -iE "error|Traceback" /tmp/h41_prof.log | tail -3
grep -E "^copy|^\|" /tmp/h41_bench.log; grep -iE "error|Traceback" /tmp/h41_bench.log | tail -3
grep -E "^plain|^profiled|^\|" /tmp/h41_prof.log | tail -40
