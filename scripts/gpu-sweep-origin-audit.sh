#!/usr/bin/env bash
# The README's H200 sweep, origin and audit results. Phase 1: the length sweep of smollm2-135m, the
# sublayer origin runs and the notebook's trace; phase 2: the hierarchy audits (the performance runs:
# scripts/bench-h200.py). Usage: scripts/gpu-sweep-origin-audit.sh 1|2 OUTDIR  (GGUF via $TRACER_SMOLLM2_GGUF)
set -uo pipefail
phase=${1:?phase 1 or 2}; out=${2:?OUTDIR}
mkdir -p "$out"
t="python3 -m tracer"
log() { echo "== $(date +%T) $*"; }
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())" > "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/versions.txt" 2>/dev/null
if [ "$phase" = 1 ]; then
  log sweep
  $t sweep smollm2-135m --lengths 17:512 --block-size 16 --device cuda -o "$out/sweep-h200.h5" > "$out/sweep.txt" 2>&1
  $t plot "$out/sweep-h200.h5" --kind sweep -o "$out/sweep-h200.png" >> "$out/sweep.txt" 2>&1
  python3 - "$out/sweep-h200.h5" > "$out/diverging.txt" <<'PY'
import sys
from tracer import read_sweep
r = read_sweep(sys.argv[1])
print(" ".join(map(str, r.diverging_lengths())))
PY
  n=$(awk '{print $1}' "$out/diverging.txt"); n=${n:-250}
  log "sublayers at N=$n"
  $t run smollm2-135m --device cuda --length "$n" --granularity sublayers --format markdown --no-store > "$out/origin-smollm2-$n.md" 2>&1
  $t run smollm2-135m --device cuda --length "$n" --granularity sublayers --decode 16 --verdict --format json --no-store > "$out/origin-smollm2-$n.json" 2>"$out/origin-verdict.err"
  $t run qwen3-0.6b-shape --device cuda --length 250 --granularity sublayers --format markdown --no-store > "$out/origin-qwen3-250.md" 2>&1
  log notebook trace
  $t run smollm2-135m --device cuda --length 100 -o "$out/h200-smollm2-prefix-cache.h5" --format json > /dev/null 2>&1
fi
if [ "$phase" = 2 ]; then
  log audit smollm2
  $t audit smollm2-135m --device cuda --format markdown --no-store > "$out/audit-smollm2-h200.md" 2>&1
  log audit qwen3
  $t audit qwen3-0.6b-shape --device cuda --format markdown --no-store > "$out/audit-qwen3-h200.md" 2>&1
fi
log done
