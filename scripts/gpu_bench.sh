#!/usr/bin/env bash
# The GPU benchmark run recorded in BENCHMARKS.md: kernel tests, W1 and batch-1 latency for both
# shapes, and HF transformers' generate_batch as the side-by-side peer. Run from the repo root on
# the GPU machine: bash scripts/gpu_bench.sh OUT_DIR
set -u
OUT=${1:-/tmp/bench}
mkdir -p "$OUT"
B="python3 -m pagedllm bench"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tail -2
for m in qwen3-0.6b llama3-8b; do
  echo "=== $m W1"
  $B throughput --model $m --load-format dummy --dataset w1 --max-model-len 4096 --output-json "$OUT/w1_$m.json" 2>&1 | grep -v "it/s" | tail -14
  echo "=== $m latency, batch 1"
  $B latency --model $m --load-format dummy --batch-size 1 --input-len 128 --output-len 257 --max-model-len 4096 \
    --num-iters 3 --output-json "$OUT/lat_$m.json" 2>&1 | grep -v "it/s" | tail -12
done
echo "=== peer: transformers generate_batch, W1 qwen3-0.6b (40 s cap)"
timeout 100 python3 scripts/peer_hf_generate_batch.py qwen3-0.6b 256 --timeout 40 2>&1 | grep -v "it/s" | tail -3
