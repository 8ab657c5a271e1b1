#!/bin/bash
# Branch h41 (issue 24, DeepSeek-V2-Lite W1): GPU == reference for the fused MLA prep kernel and the shared
# experts in the fused MoE, the tiny fp32 DeepSeek-V2 greedy check, then W1 (128 requests) with the
# kernel-family profile printed last. <= ~120 s on one H200 (each part under its own timeout).
#   bash scripts/gpu_h41_check.sh      (from the worktree root; PYTHONPATH adds /tmp/site)
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s)
# 1. Kernel tests on the GPU (small tensors) beside the tiny-model check (small cache): in parallel.
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_prep.py tests/kernels/test_moe_router.py tests/kernels/test_fused_moe_kernel.py \
    tests/kernels/test_mla_attention.py > /tmp/h41_pytest.log 2>&1 &
PYTEST=$!
timeout 55 python3 - > /tmp/h41_models.log 2>&1 <<'PY'
import sys
sys.path.insert(0, "scripts")
import gpu_models_check as g
from _gpu_common import RESULTS
g.ARCHS = {k: v for k, v in g.ARCHS.items() if k == "deepseek_v2"}
g.correctness()
for k, v in RESULTS:
    print(f"MODELS | {k} | {v} |")
PY
wait $PYTEST
echo "== pytest (GPU) rc=$? ($(( $(date +%s) - T0 )) s)"; tail -5 /tmp/h41_pytest.log
echo "== tiny DeepSeek-V2 fp32 ($(( $(date +%s) - T0 )) s)"; grep -E "MODELS|Error|error" /tmp/h41_models.log | tail -8
# 2. W1, 128 requests: plain tok/s, then the profiled run's kernel families (one engine start).
LEFT=$(( 118 - ($(date +%s) - T0) ))
echo "== W1 profile, ${LEFT} s left"
timeout $LEFT python3 scripts/gpu_step_profile.py --model deepseek-v2-lite --load-format dummy --skip-tokenizer-init \
    --dataset w1 --max-model-len 4096 --num-prompts 128 --top 22 > /tmp/h41_prof.log 2>&1
echo "== profile rc=$? ($(( $(date +%s) - T0 )) s)"
grep -vE "^\s*$|it/s|Processed" /tmp/h41_prof.log | tail -45
