#!/usr/bin/env bash
# After merging work from several branches: the CUDA paths of the merged tree on one GPU, in one call.
#   scripts/gpu-verify.sh OUTDIR
# 1. the CUDA tests (fast path, metrics, streamed compare, store, capture, CUDA graphs) and the pure tests
#    that import most of tracer (architecture, schema, plan) on this image's torch/transformers;
# 2. tracer run on qwen3-0.6b-shape (random init, real Qwen3-0.6B shapes): prefix-cache with and without
#    --cuda-graphs, and the cuda-graph scenario (eager vs replay), N = 1024;
# 3. tracer bench at N = 1024 and 4096 (--no-kv-cache, 5 reps, peers) as a quick check of its ratios
#    (the full fair bench: scripts/bench-h200.py);
# 4. scripts/gpu-tp.sh QUICK=1 (it stays runnable: on one GPU only its TP-1 rows run).
set -uo pipefail
out=${1:?OUTDIR}; mkdir -p "$out" /tmp/gv
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log() { echo "== $(date +%T) $*" | tee -a "$out/log.txt"; }
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())" | tee -a "$out/log.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$out/log.txt"
log "tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_architecture.py tests/test_schema.py tests/plan \
  > "$out/tests.txt" 2>&1; tail -3 "$out/tests.txt" | tee -a "$out/log.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_pipeline_fast_path.py tests/diff/test_metrics.py \
  tests/diff/test_compare_stream.py tests/store/test_trace.py tests/execute/test_capture.py tests/diff/test_compare.py \
  -k "cuda or graph" >> "$out/tests.txt" 2>&1; tail -3 "$out/tests.txt" | tee -a "$out/log.txt"
for args in "" "--cuda-graphs" "--scenario cuda-graph"; do
  log "tracer run qwen3-0.6b-shape --device cuda --length 1024 --no-store $args"
  timeout 120 python3 -m tracer run qwen3-0.6b-shape --device cuda --length 1024 --no-store $args --format json \
    > /tmp/gv/run.json 2>> "$out/run.err"; echo "exit $?" | tee -a "$out/log.txt"
  python3 -c "import json,sys; d=json.load(open('/tmp/gv/run.json')); print('  ', d.get('verdict'))" 2>&1 | tee -a "$out/log.txt"
done
for n in 1024 4096; do
  log "bench N=$n"
  timeout 90 python3 -m tracer bench qwen3-0.6b-shape --device cuda --length $n --reps 5 --no-kv-cache \
    --outdir /dev/shm/gv --json > "$out/bench-$n.json" 2>> "$out/bench.err"
  python3 - "$out/bench-$n.json" <<'PY' | tee -a "$out/log.txt"
import json, sys
d = json.load(open(sys.argv[1])); r = d["ratios"]; m = d["median_s"]
print(f"  (a) {m['a']*1e3:.1f} ms | " + " | ".join(f"{k} {v:.3f}" for k, v in r.items()))
PY
done
log "gpu-tp.sh QUICK=1"
QUICK=1 timeout 60 scripts/gpu-tp.sh /tmp/gv/tp > /dev/null 2>&1; cat /tmp/gv/tp/status.txt | tee -a "$out/log.txt"
cp /tmp/gv/tp/summary.md "$out/tp-summary.md" 2>/dev/null || true
log "done"
