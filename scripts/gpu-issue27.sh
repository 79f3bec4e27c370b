#!/usr/bin/env bash
# Issue 27 on a CUDA GPU (measured on an H200): one call, from the repository root.
#   scripts/gpu-issue27.sh [all|tests|bench|graphs|store|hostcost|phases|again] OUTDIR
#   tests     the CUDA tests of the fast path, the metrics, the streamed compare and the store
#   bench     tracer bench qwen3-0.6b-shape with its peers (HF output_hidden_states, hooks + .cpu();
#             nnsight when installed) at N = 1024 and 4096, and N = 32768 without peers; --no-kv-cache
#   graphs    CUDA-graph replay with the capture recorded inside vs the bare replay (N = 1024, 4096)
#   store     compare from a >= 1 GB trace vs a raw read of it, metrics on the GPU and on the CPU
#   hostcost  where tracer's remaining host time goes at N = 1024 (cProfile, CUDA runtime calls)
#   phases    --store none split into hooks and comparison, beside the bare plans and HF's hidden states
#   again     the second call of the session: bench with the traces in /dev/shm (the VM's disk wrote
#             ~230 MB/s), N = 32768, phases, store (GPU) — after the fixes the first call prompted
# BENCH_DIR (default /tmp/i27/bench) is where the bench writes its traces.
# Everything printed goes to OUTDIR (JSON per bench, log.txt, tests.txt); the model is random-init
# (qwen3-0.6b-shape: Qwen3-0.6B's shapes), so nothing needs to be carried.
set -uo pipefail
what=${1:-all}; out=${2:?OUTDIR}
mkdir -p "$out" /tmp/i27
errs=$out  # stderr of each step; the second call keeps them off $OUT (8 files come back)
[ "$what" = again ] && errs=/tmp/i27
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*" | tee -a "$out/log.txt"; }
has() { [ "$what" = all ] || [ "$what" = "$1" ]; }
{ python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import os; print('cpus', os.cpu_count())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  python3 -c "import isal; print('isal', isal.__version__)" 2>&1 | tail -1; } > "$out/versions.txt" 2>&1
cat "$out/versions.txt"
if has tests; then
  log "CUDA tests"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/test_pipeline_fast_path.py > "$out/tests.txt" 2>&1
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/diff/test_metrics.py tests/diff/test_compare_stream.py tests/store/test_trace.py \
    -k "cuda" >> "$out/tests.txt" 2>&1
  grep -E "passed|failed|error" "$out/tests.txt" | tee -a "$out/log.txt"
fi
bench() {  # N reps extra...
  local n=$1 r=$2; shift 2
  log "bench qwen3-0.6b-shape N=$n $*"
  timeout 200 python3 -m tracer bench qwen3-0.6b-shape --device cuda --length "$n" --reps "$r" --no-kv-cache "$@" \
    --outdir "${BENCH_DIR:-/tmp/i27/bench}" --json > "$out/bench-$n$tag.json" 2>>"$errs/bench.err"
  python3 - "$out/bench-$n$tag.json" <<'EOF' | tee -a "$out/log.txt"
import json, sys
d = json.load(open(sys.argv[1])); r = d["ratios"]; m = d["median_s"]
print(f"  (a) {m['a']*1e3:.1f} ms | " + " | ".join(f"{k} {v:.3f}" for k, v in r.items()))
EOF
}
tag=""
if [ "$what" = again ]; then
  export BENCH_DIR=/dev/shm/i27; tag="-shm"
  bench 1024 9
  bench 4096 9
  bench 32768 3 --no-peers
  log "phases"
  timeout 120 python3 scripts/gpu-phases.py qwen3-0.6b-shape 1024 4096 > "$out/phases.jsonl" 2>>"$errs/phases.err"
  cat "$out/phases.jsonl" | tee -a "$out/log.txt"
  for run in cuda:0.5 cuda:1.0 cpu:1.0; do
    dev=${run%%:*}; div=${run##*:}
    log "compare from a 1.5 GB trace, metrics on $dev, diverge $div (run B read beside run A)"
    timeout 120 python3 scripts/store-speed.py --dir /tmp/i27/store --device "$dev" --skip-write --skip-v1-compare \
      --reps 3 --diverge "$div" --json "$errs/s-$dev-$div.json" > /dev/null 2>>"$errs/store.err"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('  trace', d['trace_bytes'], 'raw read', round(d['read_s']['raw_read'],3), 's, compare', round(d['read_s']['compare_v2'],3), 's, ratio', round(d['compare_v2_over_raw_read'],3), ', peak RSS', d['compare_peak_rss_MiB'], 'MiB')" "$errs/s-$dev-$div.json" | tee -a "$out/log.txt"
  done
  python3 -c "import json,glob; print(json.dumps({f: json.load(open(f)) for f in sorted(glob.glob('$errs/s-*.json'))}, indent=1))" > "$out/store.json"
fi
if has bench; then
  bench 1024 9
  bench 4096 9
  bench 32768 3 --no-peers
fi
if has graphs; then
  log "CUDA-graph replay with and without capture"
  timeout 150 python3 scripts/gpu-graph-replay.py qwen3-0.6b-shape 1024 4096 > "$out/graphs.jsonl" 2>>"$out/graphs.err"
  cat "$out/graphs.jsonl" | tee -a "$out/log.txt"
fi
if has store; then
  for dev in cuda cpu; do
    for div in 0.5 1.0; do
      log "compare from a 1.5 GB trace, metrics on $dev, diverge $div"
      timeout 150 python3 scripts/store-speed.py --dir /tmp/i27/store --device "$dev" --skip-write --skip-v1-compare \
        --reps 3 --diverge "$div" --json "$out/store-$dev-$div.json" > /dev/null 2>>"$out/store.err"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('  trace', d['trace_bytes'], 'raw read', round(d['read_s']['raw_read'],3), 's, compare', round(d['read_s']['compare_v2'],3), 's, ratio', round(d['compare_v2_over_raw_read'],3), ', peak RSS', d['compare_peak_rss_MiB'], 'MiB')" "$out/store-$dev-$div.json" | tee -a "$out/log.txt"
    done
  done
fi
if has hostcost; then
  log "host cost at N = 1024"
  timeout 150 python3 scripts/gpu-hostcost.py qwen3-0.6b-shape 1024 > "$out/hostcost.txt" 2>&1
  head -1 "$out/hostcost.txt" | tee -a "$out/log.txt"
fi
for f in "$errs"/*.err; do [ -s "$f" ] && [ "$errs" != "$out" ] && { echo "--- tail of $f"; tail -3 "$f"; } >> "$out/log.txt"; done
log done
