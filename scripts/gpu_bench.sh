#!/usr/bin/env bash
# The GPU benchmark run recorded in BENCHMARKS.md, from the repo root on the GPU machine:
#   bash scripts/gpu_bench.sh OUT_DIR [SECTION ...]
# Sections, in this order (default: vllm-w1 ours, ~6.5 min of one 10-minute device call; run
# checks, and vllm-latency, in the next call while the machine is still warm):
#   vllm-w1       vLLM 0.21.0 on W1 for both shapes (when it is under /tmp/site: see
#                 ../shared/peers/README.md for carrying its payload), ~3.5 min
#   vllm-latency  vLLM's batch-1 and batch-32 decode step for both shapes, ~2.5 min
#   ours          pagedllm's W1 (twice per shape) and batch-1 latency, ~3 min
#   checks        fp32 correctness of the fast path, the kernel tests, and HF transformers'
#                 generate_batch as the second peer (60 s cap), ~3 min
# Every step has a time limit.
set -u
OUT=${1:-/tmp/bench}
shift || true
SECTIONS=${*:-vllm-w1 ours}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - t0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if want vllm-w1 && [ -d /tmp/site/vllm ]; then
  for m in qwen3-0.6b llama3-8b; do
    echo "=== vLLM W1 $m"
    PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 timeout 170 python3 scripts/peer_vllm.py pagedllm/model_configs/$m \
      > "$OUT/vllm_$m.log" 2>&1
    grep '"peer"' "$OUT/vllm_$m.log" || tail -4 "$OUT/vllm_$m.log"
    elapsed
  done
fi
if want vllm-latency && [ -d /tmp/site/vllm ]; then
  for m in qwen3-0.6b llama3-8b; do
    echo "=== vLLM decode step $m"
    PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 timeout 170 python3 scripts/peer_vllm_latency.py \
      pagedllm/model_configs/$m > "$OUT/vllm_latency_$m.log" 2>&1
    grep '"peer"' "$OUT/vllm_latency_$m.log" || tail -4 "$OUT/vllm_latency_$m.log"
    elapsed
  done
fi
export PYTHONPATH=/tmp/site:$PWD
B="python3 -m pagedllm bench"
want ours && for m in qwen3-0.6b llama3-8b; do
  for rep in 1 2; do
    echo "=== pagedllm W1 $m run $rep"
    timeout 90 $B throughput --model $m --load-format dummy --dataset w1 --max-model-len 4096 \
      --output-json "$OUT/w1_${m}_$rep.json" > "$OUT/w1_${m}_$rep.log" 2>&1
    grep -v "it/s" "$OUT/w1_${m}_$rep.log" | tail -4
    elapsed
  done
  echo "=== pagedllm latency $m batch 1"
  timeout 90 $B latency --model $m --load-format dummy --batch-size 1 --input-len 128 --output-len 257 \
    --max-model-len 4096 --num-iters 3 --output-json "$OUT/lat_$m.json" > "$OUT/lat_$m.log" 2>&1
  grep -v "it/s" "$OUT/lat_$m.log" | tail -5
  elapsed
done
want checks || exit 0
echo "=== fp32 greedy: fast path vs torch reference"
timeout 300 python3 scripts/gpu_check.py --only correctness correctness-batch capture-sizes > "$OUT/correctness.log" 2>&1
grep "^| " "$OUT/correctness.log" | tail -17
echo "=== kernel tests"
timeout 150 python3 -m pytest tests/kernels -q -p no:cacheprovider > "$OUT/kernel_tests.log" 2>&1
tail -2 "$OUT/kernel_tests.log"
echo "=== peer: transformers generate_batch, W1 qwen3-0.6b (60 s cap)"
timeout 130 python3 scripts/peer_hf_generate_batch.py qwen3-0.6b 256 --timeout 60 > "$OUT/hf.log" 2>&1
grep '"peer"' "$OUT/hf.log" || tail -5 "$OUT/hf.log"
elapsed
