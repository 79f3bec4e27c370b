"""Rendering a :class:`~tracer.compare.Comparison`: rich table, JSON, CSV or markdown.

One result object, one dispatch (:func:`render`). The table has one row per capture point in
execution order, a logits row with the argmax flips, and a one-line verdict.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .compare import Comparison
from .errors import TracerError

FORMATS = ("table", "json", "csv", "markdown")


def check_format(fmt: str) -> str:
    """Validate an output format name.

    Raises:
        TracerError: unknown format.
    """
    if fmt not in FORMATS:
        raise TracerError(f"unknown format '{fmt}'; use one of: {', '.join(FORMATS)}")
    return fmt


def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _frac(n: int, total: int) -> str:
    if total == 0:
        return "-"
    f = n / total
    if f == 0:
        return "0"
    return f"{100 * f:.3g}%"


def rows(c: Comparison) -> list[dict[str, Any]]:
    """The table's rows as plain dicts (shared by every format)."""
    out = []
    for p in c.points:
        d = p.diff
        out.append({
            "name": p.name, "kind": p.kind, "n_diff": d.n_diff, "n_total": d.n_total,
            "fraction": d.n_diff / d.n_total if d.n_total else 0.0,
            "max_abs_diff": d.max_abs_diff, "mean_abs_diff": d.mean_abs_diff,
            "max_ulp": d.max_ulp, "amplification": p.amplification, "argmax_flips": None,
        })
    if c.logits is not None:
        d = c.logits.tensor
        first_max = next((p.diff.max_abs_diff for p in c.points if p.diverged), None)
        out.append({
            "name": f"{c.logits_name} (logits)", "kind": "logits", "n_diff": d.n_diff,
            "n_total": d.n_total, "fraction": d.n_diff / d.n_total if d.n_total else 0.0,
            "max_abs_diff": d.max_abs_diff, "mean_abs_diff": d.mean_abs_diff, "max_ulp": d.max_ulp,
            "amplification": (d.max_abs_diff / first_max) if first_max else None,
            "argmax_flips": len(c.logits.argmax_flips),
        })
    return out


def _title(c: Comparison) -> str:
    f = c.facts
    bits = [f"{c.scenario}", f"model {c.model}"]
    if f.get("dtype"):
        bits.append(str(f["dtype"]))
    if f.get("device"):
        dev = str(f["device"])
        if f.get("device_name"):
            dev += f" ({f['device_name']})"
        bits.append(dev)
    bits.append(f"positions {c.positions[0]}..{c.positions[1] - 1} of {f.get('n_tokens', '?')}")
    return " · ".join(bits)


def _plans(c: Comparison) -> str:
    f = c.facts
    a = f"A: {f.get('plan_a', '')} (GEMM M {f.get('gemm_m_a')})"
    b = f"B: {f.get('plan_b', '')} (GEMM M {f.get('gemm_m_b')})"
    return f"{a}\n{b}"


def flips_lines(c: Comparison, limit: int = 10) -> list[str]:
    """One line per argmax flip: position, tokens in A and B, top-2 margins."""
    if c.logits is None:
        return []
    lines = []
    for f in c.logits.argmax_flips[:limit]:
        lines.append(
            f"position {c.positions[0] + f.position}: top-1 token {f.token_a} in A, {f.token_b} in B "
            f"(top-2 margin {_num(f.margin_a)} in A, {_num(f.margin_b)} in B)"
        )
    if len(c.logits.argmax_flips) > limit:
        lines.append(f"... {len(c.logits.argmax_flips) - limit} more")
    return lines


def table(c: Comparison) -> Table:
    """The amplification table as a rich Table."""
    t = Table(title=_title(c), caption=_plans(c), title_justify="left", caption_justify="left",
              header_style="bold")
    t.add_column("capture point", no_wrap=True)
    t.add_column("differing / total", justify="right", no_wrap=True)
    t.add_column("fraction", justify="right", no_wrap=True)
    t.add_column("max abs diff", justify="right", no_wrap=True)
    t.add_column("max ULP", justify="right", no_wrap=True)
    t.add_column("ampl.", justify="right", no_wrap=True)
    t.add_column("flips", justify="right", no_wrap=True)
    first = c.first_divergent
    for r in rows(c):
        style = None
        if r["n_diff"]:
            style = "bold red" if r["name"].split(" ")[0] == first else "red"
        t.add_row(
            Text(r["name"] + ("  ◀ first" if r["name"].split(" ")[0] == first else "")),
            f"{r['n_diff']:,} / {r['n_total']:,}", _frac(r["n_diff"], r["n_total"]),
            _num(r["max_abs_diff"]), str(r["max_ulp"]), _num(r["amplification"]) if r["amplification"] is not None else "-",
            "-" if r["argmax_flips"] is None else str(r["argmax_flips"]),
            style=style,
        )
    return t


def print_report(c: Comparison, console: Console | None = None) -> None:
    """Print the rich table, the argmax flips and the verdict to ``console`` (stdout by default).

    Styled in a terminal, plain text when piped (rich decides from the stream).
    """
    console = console or Console()
    console.print(table(c))
    for line in [*flips_lines(c), *c.facts.get("notes", [])]:
        console.print(f"  {line}", highlight=False)
    style = "bold green" if c.identical else "bold red"
    console.print(Text(f"verdict: {c.verdict()}", style=style))
    if c.trace:
        console.print(f"trace: {c.trace}", style="dim")


def to_csv(c: Comparison) -> str:
    buf = io.StringIO()
    fields = ["name", "kind", "n_diff", "n_total", "fraction", "max_abs_diff", "mean_abs_diff",
              "max_ulp", "amplification", "argmax_flips"]
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows(c):
        w.writerow({k: ("" if r[k] is None else r[k]) for k in fields})
    return buf.getvalue()


def to_markdown(c: Comparison) -> str:
    lines = [f"**{_title(c)}**", "", *(f"- {p}" for p in _plans(c).splitlines()), "",
             "| capture point | differing / total | fraction | max abs diff | max ULP | amplification | argmax flips |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows(c):
        lines.append(
            f"| {r['name']} | {r['n_diff']:,} / {r['n_total']:,} | {_frac(r['n_diff'], r['n_total'])} | "
            f"{_num(r['max_abs_diff'])} | {r['max_ulp']} | {_num(r['amplification'])} | "
            f"{'' if r['argmax_flips'] is None else r['argmax_flips']} |"
        )
    lines.append("")
    lines.extend(f"- {line}" for line in [*flips_lines(c), *c.facts.get("notes", [])])
    lines.append(f"\n**verdict:** {c.verdict()}")
    return "\n".join(lines) + "\n"


def _json_default(x: Any) -> Any:
    if isinstance(x, float):
        return None
    return str(x)


def _clean(x: Any) -> Any:
    """Replace non-finite floats by strings so the document is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def to_json(c: Comparison) -> str:
    return json.dumps(_clean(c.to_dict()), indent=2, default=_json_default)


def render(c: Comparison, fmt: str = "table", console: Console | None = None) -> str | None:
    """Render ``c`` in ``fmt``: ``table`` prints to ``console`` (returns None); the others return text."""
    match check_format(fmt):
        case "table":
            print_report(c, console)
            return None
        case "json":
            return to_json(c)
        case "csv":
            return to_csv(c)
        case "markdown":
            return to_markdown(c)
    raise AssertionError(fmt)
