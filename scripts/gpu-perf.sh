#!/usr/bin/env bash
# Issue 6 measurements on the H200 (qwen3-0.6b-shape: random init, real Qwen3-0.6B shapes).
# Usage: scripts/gpu-perf.sh OUTDIR [steps...]   steps: tests b4k b32k b32kkv sub32k rss dmap dprof prof  (default: tests b4k b32k sub32k rss dmap)
set -uo pipefail
out=${1:?OUTDIR}; shift
steps=${*:-tests b4k b32k sub32k rss dmap}
mkdir -p "$out"
t="python3 -m tracer"
log() { echo "== $(date +%T) $*" | tee -a "$out/log.txt"; }
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())" > "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/versions.txt" 2>/dev/null
for s in $steps; do case $s in
  tests) log "CUDA tests"
    python3 -m pytest -q -p no:cacheprovider tests/diff/test_metrics.py tests/store/test_trace.py tests/diff/test_compare.py tests/test_pipeline.py tests/load/test_devices.py > "$out/tests.txt" 2>&1 ;;
  b4k) for kv in --kv-cache --no-kv-cache; do log "bench 4096 $kv"
    timeout 240 $t bench qwen3-0.6b-shape --device cuda --length 4096 --reps 5 $kv --outdir /tmp/bench --json > "$out/bench-4096$kv.json" 2>"$out/bench-4096$kv.err"; done ;;
  b32kkv) log "bench 32768 --kv-cache"
    timeout 300 $t bench qwen3-0.6b-shape --device cuda --length 32768 --reps 3 --kv-cache --outdir /tmp/bench --json > "$out/bench-32768--kv-cache.json" 2>"$out/bench-32768--kv-cache.err" ;;
  prof) log "host profile of tracer.run"
    python3 scripts/gpu-hostcost.py qwen3-0.6b-shape 4096 > "$out/prof.txt" 2>&1 ;;
  b32k) for kv in --no-kv-cache --kv-cache; do log "bench 32768 $kv"
    timeout 300 $t bench qwen3-0.6b-shape --device cuda --length 32768 --reps 3 $kv --outdir /tmp/bench --json > "$out/bench-32768$kv.json" 2>"$out/bench-32768$kv.err"; done ;;
  sub32k) log "bench 32768 sublayers"
    timeout 300 $t bench qwen3-0.6b-shape --device cuda --length 32768 --granularity sublayers --reps 2 --outdir /tmp/bench --json > "$out/bench-32768-sublayers.json" 2>"$out/bench-sub.err" ;;
  rss) log "compare peak RSS on a >= 4 GB trace"
    $t run qwen3-0.6b-shape --device cuda --length 32768 -o /tmp/big.h5 --overwrite --format json > /dev/null 2>"$out/rss.err"
    ls -l /tmp/big.h5 >> "$out/rss.txt"
    for dev in cuda cpu; do
      timeout 200 python3 -c "
import json, resource, sys, time; from tracer.diff.core import compare_trace
t0 = time.perf_counter(); c = compare_trace('/tmp/big.h5', device='$dev'); dt = time.perf_counter() - t0
print(json.dumps({'device': '$dev', 'seconds': dt, 'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 'first_divergent': c.first_divergent}))" >> "$out/rss.txt" 2>&1
    done ;;
  dprof) log "profile of compare (d) on the GPU, N=4096 trace with KV cache"
    $t run qwen3-0.6b-shape --device cuda --length 4096 -o /tmp/d4k.h5 --overwrite --format json > /dev/null 2>"$out/dprof.err"
    python3 - > "$out/dprof.txt" 2>&1 <<'PY'
import cProfile, pstats, time, torch
from tracer.diff.core import compare_trace
compare_trace("/tmp/d4k.h5", device="cuda")
for dev in ("cuda", "cpu"):
    t0 = time.perf_counter(); compare_trace("/tmp/d4k.h5", device=dev); torch.cuda.synchronize(); print(dev, f"{time.perf_counter() - t0:.3f} s")
t0 = time.perf_counter(); open("/tmp/d4k.h5", "rb").read(); print(f"raw read {time.perf_counter() - t0:.3f} s")
pr = cProfile.Profile(); pr.enable(); compare_trace("/tmp/d4k.h5", device="cuda"); torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
PY
    ;;
  dmap) log "device_map: qwen3-0.6b-shape split GPU + CPU vs whole on the GPU"
    $t run qwen3-0.6b-shape --device cuda --length 1024 -o /tmp/one.h5 --overwrite --format json > "$out/dmap-one.json" 2>"$out/dmap.err"
    $t run qwen3-0.6b-shape --device-map auto --max-memory 0=600MiB,cpu=64GiB --length 1024 -o /tmp/split.h5 --overwrite --format json > "$out/dmap-split.json" 2>>"$out/dmap.err"
    python3 - >> "$out/dmap.txt" 2>&1 <<'PY'
import collections, json
from tracer.diff.core import compare_runs
from tracer.store.trace import TraceReader
with TraceReader("/tmp/split.h5") as r:
    dm = r.header["model"]["device_map"]
print("device_map:", dict(collections.Counter(dm.values())), "e.g.", {k: dm[k] for k in list(dm)[:3]}, "...", {k: dm[k] for k in list(dm)[-3:]})
for run in ("A", "B"):
    c = compare_runs(("/tmp/one.h5", run), ("/tmp/split.h5", run))
    print(f"run {run}: whole-GPU vs GPU+CPU split:", c.verdict())
for f in ("dmap-one", "dmap-split"):
    pass
PY
    ;;
esac; done
log done
