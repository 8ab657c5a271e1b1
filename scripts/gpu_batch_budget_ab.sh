#!/usr/bin/env bash
# max_num_batched_tokens 8192 (our default) against 16384 (vLLM's default for the offline LLM class on GPUs of
# >= 70 GiB) on one H200: W1 fp8 / bf16 Llama-3.1-8B shape, the long-context workload (64 x 3000 in, 1000 out),
# W1 Qwen3-0.6B. One `pagedllm bench throughput` process a run; prints | run | tok/s | s | ready s | floor | fraction |.
#   PYTHONPATH=$PWD bash scripts/gpu_batch_budget_ab.sh
run() { tag=$1; shift; timeout 120 python3 -m pagedllm bench throughput --load-format dummy --skip-tokenizer-init --max-model-len 4096 --output-json /tmp/$tag.json "$@" > /tmp/$tag.log 2>&1; python3 -c "import json;d=json.load(open('/tmp/$tag.json'));print('| $tag |', round(d['output_tokens_per_second']), '|', round(d['elapsed_time'],2), '|', round(d['startup_seconds'],1), '|', round(d['floor_output_tokens_per_second']), '|', round(d['fraction_of_floor'],3), '|', flush=True)" || tail -5 /tmp/$tag.log; }
F8="--model llama3-8b --dataset w1 --quantization fp8"
B8="--model llama3-8b --dataset w1"
LC="--model llama3-8b --dataset random --num-prompts 64 --input-len 3000 --output-len 1000"
Q6="--model qwen3-0.6b --dataset w1"
K="--max-num-batched-tokens 16384"
run fp8-8k $F8; run fp8-16k $F8 $K; run fp8-16k-b $F8 $K; run fp8-8k-b $F8
run bf16-8k $B8; run bf16-16k $B8 $K
run long-8k $LC; run long-16k $LC $K
run q06-8k $Q6; run q06-16k $Q6 $K
run fp8kv-16k $F8 $K --kv-cache-dtype fp8
