#!/usr/bin/env bash
# Issue 10's GPU check: the same `tracer audit` before the one-pipeline change (e231c05, carried as
# .device/old-e231c05.tar from `git archive e231c05 tracer models hooks pyproject.toml`) and after it,
# interleaved twice, wall time of the whole command. Usage: scripts/gpu-audit-timing.sh OUTDIR [N]
set -uo pipefail
out=${1:?OUTDIR}; n=${2:-1024}
mkdir -p "$out" /tmp/old && tar -xf .device/old-e231c05.tar -C /tmp/old
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())" > "$out/versions.txt"
args="audit qwen3-0.6b-shape --device cuda --length $n --levels 0,1,2,3,4,5 --no-store --format json"
new=$PWD
for rep in 1 2; do
  for v in old new; do
    dir=/tmp/old; [ $v = new ] && dir=$new
    s=$(date +%s.%N)
    (cd "$dir" && PYTHONPATH="$dir" python3 -m tracer $args > "$out/audit-$v-$rep.json" 2> "$out/audit-$v-$rep.err")
    e=$(date +%s.%N)
    echo "$v rep $rep: $(python3 -c "print(round($e - $s, 2))") s" | tee -a "$out/timing.txt"
  done
done
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
a = json.loads((out / "audit-old-1.json").read_text()); b = json.loads((out / "audit-new-1.json").read_text())
ra = {r["key"]: (r["status"], r["last_layer_differing"], r["first_divergent"]) for r in a["rows"]}
rb = {r["key"]: (r["status"], r["last_layer_differing"], r["first_divergent"]) for r in b["rows"]}
print("rows identical before/after:", ra == rb)
for k in ra:
    if ra[k] != rb.get(k):
        print("differs:", k, ra[k], rb.get(k))
PY
