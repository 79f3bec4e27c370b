#!/usr/bin/env bash
# Produce the README's GPU tables of cache hit vs miss: smollm2-135m (real weights) and qwen3-0.6b-shape
# (random init, real shapes) at N = 31, 100, 250, 1000, prefix-cache scenario, bf16.
# Usage: scripts/gpu-readme-tables.sh OUTDIR [GGUF]
set -uo pipefail
out=${1:?usage: $0 OUTDIR [GGUF]}
gguf=${2:-}
mkdir -p "$out"
g=()
[ -n "$gguf" ] && g=(--gguf "$gguf")
{
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
} > "$out/versions.txt"
for n in 31 100 250 1000; do
  python3 -m tracer run smollm2-135m "${g[@]}" --length "$n" --format markdown --no-store > "$out/smollm2-$n.md" 2>"$out/smollm2-$n.err"
done
python3 -m tracer run smollm2-135m "${g[@]}" --length 250 --mitigation aligned --format markdown --no-store > "$out/smollm2-250-aligned.md" 2>&1
for n in 31 100 250 1000; do
  python3 -m tracer run qwen3-0.6b-shape --length "$n" --format markdown --no-store > "$out/qwen3-$n.md" 2>"$out/qwen3-$n.err"
done
python3 -m tracer run qwen3-0.6b-shape --length 250 --mitigation aligned --format markdown --no-store > "$out/qwen3-250-aligned.md" 2>&1
cat "$out"/*.md > "$out/all.md"
