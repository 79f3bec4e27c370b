"""Copy a trace without its kv_cache capture points, gzip-compressed (bits unchanged), e.g. to commit
a small GPU trace: python scripts/subset-trace.py IN.h5 OUT.h5"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tracer.store.trace import TraceReader, TraceWriter  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
with TraceReader(src) as r:
    header = dict(r.header, subset="kv_cache capture points dropped (scripts/subset-trace.py)")
    runs = []
    for name in r.runs:
        rec = r.run(name)
        rec.captures = {k: v for k, v in rec.captures.items() if v.kind != "kv_cache"}
        runs.append(rec)
with TraceWriter(dst, header=header, overwrite=True, compression="gzip") as w:
    for rec in runs:
        w.add_run(rec)
