#!/usr/bin/env bash
# Quantized checkpoints on the GPU (issue 19), from the repo root on the GPU machine:
#   bash scripts/gpu_quant_bench.sh OUT_DIR SECTION [SECTION ...]
# Sections (each fits one 10-minute device call with room to spare; run them in separate calls):
#   check       every quantized GEMM kernel vs its torch reference at Llama-3.1-8B sizes, with
#               times beside bf16 cuBLAS, and the quant / fp8-KV kernel tests on the GPU, ~3 min
#   fp8         pagedllm W1 Llama-3.1-8B shape: quantization=fp8 (online), and + kv_cache_dtype=fp8
#               when it is built; then vLLM 0.21 the same (when under /tmp/site), ~6 min
#   fp8block    block-wise FP8 (128 x 128 weight blocks, dynamic 1 x 128 activation groups: Qwen3-FP8's format),
#               pagedllm W1 on the Triton GEMM (PAGEDLLM_FP8_BLOCK_CUBLAS=0) and on cuBLASLt's (the sm_90
#               default), then vLLM, ~4 min
#   int8        W8A8-INT8 (compressed-tensors config), pagedllm then vLLM, ~4 min
#   awq, gptq   int4 g128 (one section each): W1 and the batch-1 decode step, pagedllm then vLLM, ~4.5 min
#   72b         Qwen2.5-72B-shaped AWQ (dummy int4 weights) on one H200, max_model_len 4096, W1
#               (pagedllm, then vLLM), ~7 min; 72b-ours / 72b-vllm: one side each (two calls)
# T_OURS / T_VLLM: seconds each W1 run may take (default 170 / 200; the 72B's need more)
#   w1          the issue's targets in one call, ~6 min: pagedllm W1 bf16, fp8, fp8 + fp8 KV, int8, awq
#               (+ its batch-1 step), then vLLM fp8 and awq (Marlin)
#   short       pagedllm W1 fp8 and awq, awq's batch-1 step, then vLLM fp8 W1 (~3 min)
#   lean        pagedllm only: W1 bf16, fp8, int8 and awq's batch-1 step (~2.5 min; INT8 >= bf16 in one call)
# All runs use dummy weights in each method's quantized layout (--load-format dummy) and configs
# written to OUT_DIR/cfg here (a bundled config + its quantization_config), the same for vLLM.
# Prints a table last ("| run | tok/s | ...").
set -u
OUT=${1:-/tmp/qbench}
shift || true
SECTIONS=${*:-check}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
mkdir -p "$OUT/cfg"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - t0 )) s]"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD
# Config folders: the bundled Llama-3.1-8B config with a quantization_config, and a Qwen2.5-72B shape.
python3 - "$OUT/cfg" <<'EOF'
import json, os, sys
root = sys.argv[1]
base = json.load(open("pagedllm/model_configs/llama3-8b/config.json"))
quant = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "fp8block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "w8a8": {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": {"targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                 "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}}}},
}
for name, qc in quant.items():
    os.makedirs(f"{root}/llama3-8b-{name}", exist_ok=True)
    json.dump({**base, "quantization_config": qc}, open(f"{root}/llama3-8b-{name}/config.json", "w"), indent=1)
qwen72 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
          "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
          "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 151643,
          "eos_token_id": 151645, "use_sliding_window": False, "quantization_config": quant["awq"]}
os.makedirs(f"{root}/qwen2.5-72b-awq", exist_ok=True)
json.dump(qwen72, open(f"{root}/qwen2.5-72b-awq/config.json", "w"), indent=1)
EOF
TABLE="$OUT/table.md"
: > "$TABLE"
B="python3 -m pagedllm bench"
ours_w1() {  # tag model extra-args...
  local tag=$1 model=$2; shift 2
  echo "=== pagedllm W1 $tag"
  timeout "${T_OURS:-170}" $B throughput --model "$model" --load-format dummy --skip-tokenizer-init --dataset w1 \
    --max-model-len 4096 --output-json "$OUT/w1_$tag.json" "$@" > "$OUT/w1_$tag.log" 2>&1
  grep -v "it/s" "$OUT/w1_$tag.log" | tail -3
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('| pagedllm', sys.argv[2], '|', round(d['output_tokens_per_second'], 1), '|')" \
    "$OUT/w1_$tag.json" "$tag" >> "$TABLE" 2>/dev/null || echo "| pagedllm $tag | failed (see w1_$tag.log) |" >> "$TABLE"
  elapsed
}
ours_lat() {  # tag model extra-args...
  local tag=$1 model=$2; shift 2
  echo "=== pagedllm batch-1 decode step $tag"
  timeout 120 $B latency --model "$model" --load-format dummy --skip-tokenizer-init --batch-size 1 --input-len 128 \
    --output-len 257 --max-model-len 4096 --num-iters 3 --output-json "$OUT/lat_$tag.json" "$@" > "$OUT/lat_$tag.log" 2>&1
  grep -v "it/s" "$OUT/lat_$tag.log" | tail -4
  echo "| pagedllm batch-1 $tag | $(grep 'Decode step' "$OUT/lat_$tag.log" | tail -1) |" >> "$TABLE"
  elapsed
}
vllm_w1() {  # tag model extra-args...
  [ -d /tmp/site/vllm ] || { echo "(vLLM not under /tmp/site: peer skipped)"; return; }
  local tag=$1 model=$2; shift 2
  echo "=== vLLM W1 $tag"
  PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 timeout "${T_VLLM:-200}" python3 scripts/peer_vllm_quant.py "$model" "$@" \
    > "$OUT/vllm_$tag.log" 2>&1
  grep '"peer"' "$OUT/vllm_$tag.log" || tail -4 "$OUT/vllm_$tag.log"
  python3 -c "import json,sys; d=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{\"peer')][-1]; print('| vLLM', sys.argv[2], '|', d['output_tok_per_s'], '|')" \
    "$OUT/vllm_$tag.log" "$tag" >> "$TABLE" 2>/dev/null || echo "| vLLM $tag | failed (see vllm_$tag.log) |" >> "$TABLE"
  elapsed
}
if want check; then
  echo "=== kernels vs references, Llama-3.1-8B sizes"
  timeout 240 python3 scripts/gpu_quant_check.py > "$OUT/check.log" 2>&1
  grep "^| \|within" "$OUT/check.log" | tail -80
  echo "=== quant kernel tests on the GPU (fp8 KV cache: bit-exact against torch there)"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_wna16_gemm.py tests/kernels/test_scaled_mm.py \
    tests/kernels/test_kv_cache_fp8_kernels.py > "$OUT/tests.log" 2>&1
  tail -2 "$OUT/tests.log"
  elapsed
fi
L8=pagedllm/model_configs/llama3-8b
if want fp8; then
  ours_w1 fp8 $L8 --quantization fp8
  if python3 -c "from pagedllm.config import KV_CACHE_DTYPES as d; assert 'fp8' in d" 2>/dev/null; then
    ours_w1 fp8-kvfp8 $L8 --quantization fp8 --kv-cache-dtype fp8
  else
    echo "| pagedllm fp8 + fp8 KV | not built in this commit |" >> "$TABLE"
  fi
  vllm_w1 fp8 $L8 --quantization fp8
  vllm_w1 fp8-kvfp8 $L8 --quantization fp8 --kv-cache-dtype fp8
fi
if want fp8block; then
  PAGEDLLM_FP8_BLOCK_CUBLAS=0 ours_w1 fp8block-triton "$OUT/cfg/llama3-8b-fp8block"
  ours_w1 fp8block "$OUT/cfg/llama3-8b-fp8block"
  vllm_w1 fp8block "$OUT/cfg/llama3-8b-fp8block"
fi
if want int8; then
  ours_w1 int8 "$OUT/cfg/llama3-8b-w8a8"
  vllm_w1 int8 "$OUT/cfg/llama3-8b-w8a8"
fi
for q in awq gptq; do
  want $q || continue
  ours_w1 $q "$OUT/cfg/llama3-8b-$q"
  ours_lat $q "$OUT/cfg/llama3-8b-$q"
  vllm_w1 $q "$OUT/cfg/llama3-8b-$q"
done
if want w1; then
  ours_w1 bf16 $L8
  ours_w1 fp8 $L8 --quantization fp8
  ours_w1 fp8-kvfp8 $L8 --quantization fp8 --kv-cache-dtype fp8
  ours_w1 int8 "$OUT/cfg/llama3-8b-w8a8"
  ours_w1 awq "$OUT/cfg/llama3-8b-awq"
  ours_lat awq "$OUT/cfg/llama3-8b-awq"
  vllm_w1 fp8 $L8 --quantization fp8
  vllm_w1 awq "$OUT/cfg/llama3-8b-awq"
fi
if want lean; then
  ours_w1 bf16 $L8
  ours_w1 fp8 $L8 --quantization fp8
  ours_w1 int8 "$OUT/cfg/llama3-8b-w8a8"
  ours_lat awq "$OUT/cfg/llama3-8b-awq"
fi
if want short; then
  ours_w1 fp8 $L8 --quantization fp8
  ours_w1 awq "$OUT/cfg/llama3-8b-awq"
  ours_lat awq "$OUT/cfg/llama3-8b-awq"
  vllm_w1 fp8 $L8 --quantization fp8
fi
if want 72b || want 72b-ours; then
  ours_w1 qwen72b-awq "$OUT/cfg/qwen2.5-72b-awq" --gpu-memory-utilization 0.92
fi
if want 72b || want 72b-vllm; then
  vllm_w1 qwen72b-awq "$OUT/cfg/qwen2.5-72b-awq" --gpu-memory-utilization 0.92
fi
echo "=== table"
echo "| run | output tok/s |"
echo "|---|---|"
cat "$TABLE"
