"""What the default ``tracer audit`` costs: wall and CPU seconds per check, against its planned cost, and disk.

    python benchmarks/audit_cost.py [MODEL] [--out DIR] [--levels 0,1,...] [-- AUDIT OPTIONS]

Runs ``tracer.audit(MODEL, output=DIR/audit.h5)`` in this process with the plan printed, and prints per
check: wall seconds, CPU seconds (this process and its children: the TP ranks, inductor's compiler),
the check's planned cost in forward-pass units (:meth:`tracer.plan.cost.Cost.units`, with the
mitigation re-runs it made) and CPU seconds per unit, so the fixed costs of
:data:`tracer.plan.cost.EXTRA_UNITS` can be checked; then the whole audit's wall and CPU time, the
machine's load average before and after (a shared machine: say how loaded it was) and the trace's
size on disk. torch.compile's kernel cache is a fresh folder (``TORCHINDUCTOR_CACHE_DIR``) unless
``--warm`` is given: a first audit compiles cold.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="folder for audit.h5 (default: a fresh temporary folder)")
    ap.add_argument("--levels", default=None)
    ap.add_argument("--warm", action="store_true", help="keep torch.compile's usual kernel cache")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    out = Path(args.out or tempfile.mkdtemp(prefix="tracer-audit-cost-")) / "audit.h5"
    if not args.warm:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    import tracer
    from tracer.loops import audit as A
    from tracer.plan.cost import scenario_cost

    load0 = os.getloadavg()
    t0, c0 = time.monotonic(), cpu_seconds()
    lm = tracer.load_model(args.model, device="cpu")
    print(f"load: {time.monotonic() - t0:.1f} s wall, {cpu_seconds() - c0:.1f} s CPU", flush=True)
    marks: list[tuple[float, float]] = [(time.monotonic(), cpu_seconds())]
    rows = []

    def on_row(row):
        marks.append((time.monotonic(), cpu_seconds()))
        rows.append(row)

    n = A.DEFAULT_LENGTH
    result = tracer.audit(lm, output=str(out), levels=args.levels, on_row=on_row, progress="lines")
    t1, c1 = time.monotonic(), cpu_seconds()
    print(f"\n{'check':<22} {'status':<8} {'wall s':>7} {'CPU s':>7} {'units':>6} {'CPU s/unit':>10}")
    import json

    from tracer.plan.build import build

    for (ta, ca), (tb, cb), row in zip(marks, marks[1:], rows):
        units = None
        if row.status != "skipped":
            scen = build(row.check.scenario, n, **row.check.options)
            units = scenario_cost(scen).units(n) * (1 + sum(isinstance(v, bool) for v in row.mitigations.values()))
        per = f"{(cb - ca) / units:10.2f}" if units else f"{'-':>10}"
        print(f"{row.check.key:<22} {row.status:<8} {tb - ta:7.1f} {cb - ca:7.1f} {units or 0:6.1f} {per}")
    size = out.stat().st_size if out.exists() else 0
    print(f"\naudit: {t1 - marks[0][0]:.0f} s wall, {c1 - marks[0][1]:.0f} s CPU (with the load: {t1 - t0:.0f} s wall, "
          f"{c1 - c0:.0f} s CPU); {size / 1e6:.1f} MB on disk ({out})")
    print(f"load average before {load0[0]:.1f}, after {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(json.dumps(result.counts()))


if __name__ == "__main__":
    main()
