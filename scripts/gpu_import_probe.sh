#!/usr/bin/env bash
# Where `import torch` / `import transformers` spend a start on this host: byte code present or not.
set -u
O=${1:-/tmp/probe}; mkdir -p "$O"
env | grep -i '^PYTHON' ; python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode, sys.version)"
SP=$(python3 -c "import importlib.util,os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec('torch').origin)))")
echo "site: $SP"; ls -ld "$SP"; touch "$SP/.w" 2>/dev/null && echo writable && rm -f "$SP/.w" || echo not-writable
for p in torch transformers triton tokenizers; do
  echo "$p: py $(find $SP/$p -name '*.py' | wc -l) pyc $(find $SP/$p -name '*.pyc' | wc -l)"
done
nproc; cat /proc/cpuinfo | grep 'model name' | head -1
t() { local s=$EPOCHREALTIME; "$@" >/dev/null 2>&1; awk -v a=$s -v b=$EPOCHREALTIME -v c="${*: -1}" 'BEGIN{printf "%.2f s: %s\n", b-a, c}'; }
for i in 1 2; do t python3 -c "import torch"; done
t python3 -c "import torch, transformers; from transformers import LlamaConfig; LlamaConfig()"
python3 -X importtime -c "import torch" 2> "$O/it_torch.txt"; awk -F'|' '{s+=$2} END {print "importtime torch self us", s, NR}' "$O/it_torch.txt"
export PYTHONPYCACHEPREFIX=/tmp/pp
t python3 -m compileall -q -j 16 "$SP/torch" "$SP/transformers" "$SP/triton"; echo "pyc in prefix: $(find /tmp/pp -name '*.pyc' | wc -l)"
for i in 1 2; do t python3 -c "import torch"; done
t python3 -c "import torch, transformers; from transformers import LlamaConfig; LlamaConfig()"
python3 -X importtime -c "import torch" 2> "$O/it_torch_pyc.txt"; awk -F'|' '{s+=$2} END {print "importtime torch self us (prefix)", s, NR}' "$O/it_torch_pyc.txt"
