"""``tracer show``: a trace's header (the numeric contract), its runs and its stored comparisons.

The header is printed as ``key  value`` lines that are never cut or wrapped by tracer (a hash, a
GGUF path or the platform string can be copied whole from the terminal); the runs as a table.
Every string comes from the file: printed as data (control characters escaped), never as markup.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracer.report.textsafe import printable


def _value(v: Any) -> str:
    return printable(v if isinstance(v, str) else json.dumps(v, default=str))


def print_trace_info(info: dict[str, Any], path: str, as_json: bool = False, console: Console | None = None) -> None:
    """Print :func:`tracer.store.trace.describe`'s ``info`` of the trace at ``path`` (or it as JSON)."""
    if as_json:
        print(json.dumps({k: info[k] for k in ("header", "runs", "comparisons")}, indent=2, default=str))
        return
    out = console or Console()
    out.print(Text(f"trace {printable(path)}", style="bold"), soft_wrap=True)
    header = info["header"]
    width = max((len(k) for k in header), default=0)
    for k, v in header.items():
        line = Text(f"  {printable(k):<{width}}  ", style="bold")
        line.append(_value(v))
        out.print(line, soft_wrap=True)  # one line per key, whatever its length: nothing cut
    if not info["checksummed"]:
        out.print("  checksums: none: written before tracer stored checksums; integrity not verified", soft_wrap=True)
    rt = Table(title="runs", title_justify="left")
    for col in ("run", "tokens", "compared positions", "plan", "GEMM M", "capture points"):
        rt.add_column(col, overflow="fold")
    for r in info["runs"]:
        rt.add_row(Text(printable(r["name"])), str(r["n_tokens"]), f"{r['window'][0]}..{r['window'][1] - 1}",
                   Text(printable(str(r["plan"].get("description", "")))), Text(printable(str(r["plan"].get("gemm_m", "")))),
                   str(r["captures"]))
    out.print(rt)
    for name, comp in info["comparisons"].items():
        out.print(Text(printable(f"stored comparison {name}: {comp.get('verdict', '?')}")), soft_wrap=True)
