"""tracer's performance benchmark (issue 6); the same as ``tracer bench``.

    python benchmarks/bench.py [MODEL] --length 1024 --device cpu --reps 5 [--json OUT.json]

See tracer/bench.py for what each mode measures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402

from tracer.bench import bench, table, to_json  # noqa: E402
from tracer.errors import TracerError  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--granularity", default="layers")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--outdir", default=None, help="folder for the trace and raw I/O files (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the result as JSON to this file")
    a = ap.parse_args()
    err = Console(stderr=True)
    try:
        with err.status("benchmarking") as st:
            r = bench(a.model, length=a.length, dtype=a.dtype, device=a.device, granularity=a.granularity,
                      reps=a.reps, warmup=a.warmup, outdir=a.outdir, progress=lambda m: st.update(m))
    except TracerError as e:
        err.print(f"error: {e}")
        return 2
    Console().print(table(r))
    if a.json:
        Path(a.json).write_text(to_json(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
