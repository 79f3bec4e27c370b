#!/usr/bin/env bash
# On the H200: which kernel ran for each op in each run, and each run's distance from the
# exact answer. qwen3-0.6b-shape (Qwen3-0.6B's config, random init: the real GEMM shapes),
# prefix-cache at N=250 (P=240), sublayers, --kernels --op-replay; also N=4096 (P=4080, where the
# H200 probe saw the same GEMM kernel in both runs) and --mitigation aligned at N=250.
# A direct torch.profiler probe of down_proj's GEMM at M = 250, 240, 10, 4096, 4080 (outside tracer)
# cross-checks the attribution, and a CPU-overhead-style timing of --kernels on the GPU is included.
# Usage (repo root, on the GPU machine): OUT=/some/dir scripts/gpu-kernels.sh   (writes into $OUT)
set -uo pipefail
out=${OUT:?set OUT to the output folder}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t="python3 -m tracer"
log() { echo "== $(date +%T) $*" | tee -a "$out/log.txt"; }
{
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '| cuBLAS', torch.backends.cuda.preferred_blas_library() if hasattr(torch.backends.cuda, 'preferred_blas_library') else '?', '|', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
} > "$out/versions.txt"
common=(qwen3-0.6b-shape --device cuda --granularity sublayers --kernels --op-replay --no-store)
for n in 250 4096; do
  log "qwen3 N=$n"
  $t run "${common[@]}" --length "$n" --format markdown > "$out/qwen3-$n-kernels.md" 2>"$out/qwen3-$n.err"
  $t run "${common[@]}" --length "$n" --format json > "$out/qwen3-$n-kernels.json" 2>>"$out/qwen3-$n.err"
done
log "qwen3 N=250 aligned"
$t run "${common[@]}" --length 250 --mitigation aligned --format markdown > "$out/qwen3-250-aligned-kernels.md" 2>"$out/qwen3-250-aligned.err"
log "probe"
python3 - > "$out/probe-down_proj.txt" 2>&1 <<'PY'
# independent of tracer: the kernels cuBLAS(Lt) launches for down_proj's GEMM (K=3072, N=1024, bf16)
import torch
from torch.profiler import ProfilerActivity, profile
torch.manual_seed(0)
w = torch.randn(1024, 3072, dtype=torch.bfloat16, device="cuda") * 0.02
for m in (250, 240, 10, 4096, 4080):
    x = torch.randn(m, 3072, dtype=torch.bfloat16, device="cuda")
    torch.nn.functional.linear(x, w); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.linear(x, w); torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    print(m, names)
PY
log "kernels cost on the GPU (N=250, sublayers, 5 interleaved pairs)"
python3 - > "$out/kernels-cost-gpu.txt" 2>&1 <<'PY'
import statistics, time, torch
import tracer
from tracer.execute.points import discover_points
from tracer.engines.hf.run import execute
from tracer.plan.build import build
lm = tracer.load_model("qwen3-0.6b-shape", device="cuda")
ids = list(range(1000, 1250))
scen = build("prefix-cache", 250, block_size=16)
pts = discover_points(lm.model, "sublayers")
times = {False: [], True: []}
for rep in range(6):
    for k in (False, True):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        execute(lm.model, ids, scen.plan_b, pts, scen.window, kernels=k)
        torch.cuda.synchronize(); dt = time.perf_counter() - t0
        if rep:
            times[k].append(dt)
off, on = statistics.median(times[False]), statistics.median(times[True])
print(f"run B (cache hit, N=250, sublayers) median of 5: without {off:.4f} s, with --kernels {on:.4f} s, ratio {on / off:.2f}")
PY
log done
