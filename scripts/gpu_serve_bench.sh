#!/usr/bin/env bash
# HTTP serving on the GPU machine, pagedllm's server beside vLLM's, both driven by the same
# `pagedllm bench serve` (issue 16's table). From the repo root:
#   bash scripts/gpu_serve_bench.sh OUT MODEL_DIR SERVER [SERVER ...]
# SERVER: vllm | ours | ours-thread / ours-mp (engine core in a thread of the server process / its own) | ours-null (no
# model: NullExecutor, the serving path's ceiling) | tree=PATH (ours from another checkout, for A/B)
# MODEL_DIR: a config.json + tokenizer folder (../shared/peers/README.md: the Qwen3-0.6B shape with
# the SmolLM2 tokenizer's 49,152-entry vocabulary); weights are dummy. Loads, in this order:
#   c256  W1 (256 requests, lengths in [100, 1024]) all at once, 256 concurrent
#   c64   512 W1-like requests, 64 concurrent
# Token-id prompts below 10,000, ignore_eos, temperature 0.6, streamed /v1/completions. ~1-2 min a server.
# Each load also prints the CPU seconds it cost the load generator, the server's frontend and its engine side
# (scripts/proc_cpu.py), in all and per 1k output tokens.
# PYSPY_S=N: py-spy samples every process of the server (frontend and engine) for the first N seconds
# of the first load, into OUT/pyspy_<server>.txt (raw collapsed stacks; scripts/pyspy_top.py reads them).
set -u
OUT=$1; MODEL=$2; shift 2
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
LOADS=${LOADS:-c256 c64}
PORT=8200
bench() {  # $1 label
  for load in $LOADS; do
    case $load in
      c256) a="--num-prompts 256 --max-concurrency 256" ;;
      c64) a="--num-prompts 512 --max-concurrency 64" ;;
      tiny) a="--num-prompts 32 --max-concurrency 16" ;;
    esac
    spid=$(pgrep -f -o "serve.*--port $PORT")
    s0=$(python3 scripts/proc_cpu.py "$spid"); children_cpu; c0=$cpu
    PYTHONPATH=$PWD timeout 200 python3 -m pagedllm bench serve --base-url http://127.0.0.1:$PORT --model m \
      --dataset-name w1 $a --temperature 0.6 --seed 0 --disable-tqdm --output-json "$OUT/$1_$load.json" \
      > "$OUT/$1_$load.log" 2>&1
    echo "$1 $load: $(grep -E 'Output token throughput|Median \(P50\) TTFT|Median \(P50\) TPOT|P99 TPOT' "$OUT/$1_$load.log" | awk '{print $NF}' | tr '\n' ' ')"
    # CPU seconds of this load: the load generator (one process), the server's frontend process, and
    # what runs below it (ours: fork server + engine; vLLM: its engine core), per 1k output tokens too.
    children_cpu; c1=$cpu; s1=$(python3 scripts/proc_cpu.py "$spid")
    python3 - "$OUT/$1_$load.json" $c0 $c1 $s0 $s1 <<'PY'
import json, sys
c0, c1, f0, e0, f1, e1 = map(float, sys.argv[2:])
try:
    n = json.load(open(sys.argv[1]))["total_output_tokens"] / 1000
except Exception:  # noqa: BLE001 - the load failed; its log says why
    n = float("nan")
print(f"  cpu s (per 1k output tokens): client {c1 - c0:.2f} ({(c1 - c0) / n:.4f}), frontend {f1 - f0:.2f} "
      f"({(f1 - f0) / n:.4f}), engine side {e1 - e0:.2f} ({(e1 - e0) / n:.4f})")
PY
  done
}
children_cpu() {  # user + system seconds of this shell's finished children (`times`' 2nd line) -> $cpu
  times > "$OUT/.times"  # not in $(...): a subshell has no children of its own
  cpu=$(tail -1 "$OUT/.times" | tr 'ms' '  ' | awk '{print $1 * 60 + $2 + $3 * 60 + $4}')
}
wait_ready() {  # $1 pid
  for _ in $(seq ${READY_WAIT_HALF_S:-400}); do
    curl -sf http://127.0.0.1:$PORT/v1/models > /dev/null && return 0
    kill -0 "$1" 2> /dev/null || return 1
    sleep 0.5
  done
  return 1
}
echo "label load: output_tok/s TTFT_p50_ms TPOT_p50_ms TPOT_p99_ms"
for server in "$@"; do
  t0=$(date +%s.%N)
  tree=$PWD
  env=()
  case $server in
    vllm)
      PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 setsid python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" \
        --load-format dummy --served-model-name m --port $PORT --max-model-len 4096 \
        > "$OUT/server_$server.log" 2>&1 &
      ;;
    ours|ours-thread|ours-mp|ours-null|tree=*)
      extra=()
      [ "$server" = ours-thread ] && env=(PAGEDLLM_ENABLE_MULTIPROCESSING=0)
      [ "$server" = ours-mp ] && env=(PAGEDLLM_ENABLE_MULTIPROCESSING=1)
      [ "$server" = ours-null ] && extra=(--distributed-executor-backend pagedllm.benchmarks.null_executor.NullExecutor)
      [[ $server == tree=* ]] && tree=${server#tree=}
      (cd "$tree" && exec env "${env[@]}" PYTHONPATH="$tree" setsid python3 -m pagedllm serve "$MODEL" --load-format dummy \
        --served-model-name m --port $PORT --max-model-len 4096 "${extra[@]}" > "$OUT/server_${server//[\/=]/_}.log" 2>&1) &
      ;;
  esac
  pid=$!
  if ! wait_ready $pid; then echo "$server did not start:"; tail -5 "$OUT"/server_*.log; kill $pid; continue; fi
  echo "$server ready in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
  if [ -n "${PYSPY_S:-}" ]; then
    spid=$(pgrep -f -o "serve.*--port $PORT")
    py-spy record --pid "$spid" --subprocesses --nonblocking -r 100 -d "$PYSPY_S" --format raw \
      -o "$OUT/pyspy_${server//[\/=]/_}.txt" > "$OUT/pyspy_${server//[\/=]/_}.log" 2>&1 &
  fi
  bench "${server//[\/=]/_}"
  # The server leads its own session (setsid): stop the whole group, engine processes included.
  pgid=$(ps -o pgid= -p $pid | tr -d ' ')
  [ -n "$pgid" ] && kill -TERM -- -"$pgid"; sleep 4; [ -n "$pgid" ] && kill -9 -- -"$pgid" 2> /dev/null; sleep 1
done
