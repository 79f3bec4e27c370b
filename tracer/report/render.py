"""The one render door: every result type, in each format of :data:`~tracer.report.layout.FORMATS`.

A result is rendered by :func:`render`: a :class:`~tracer.run_result.RunResult` or its
:class:`~tracer.diff.result.Comparison`, an :class:`~tracer.loops.audit.Audit`, a
:class:`~tracer.store.sweepfile.SweepResult`, or a benchmark's result. ``table`` is printed for
people (rich, fitted to the console); ``json``, ``csv`` and ``markdown`` are returned as text.
:data:`WRITERS` holds one writer per result kind and format: a format added to
:data:`~tracer.report.layout.FORMATS` needs one writer for every kind (a test checks that none
is missing), and every command and :func:`tracer.api.render` take it from there.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from typing import Any, Callable

from rich.console import Console

from tracer.errors import TracerError
from tracer.report.bench import engine_table
from tracer.report.bench import table as bench_table
from tracer.report.console import print_fitted, stdout_console
from tracer.report.hierarchy import audit_csv, audit_json, audit_markdown, print_audit
from tracer.report.layout import DEFAULT_COLUMNS, FORMATS, check_format
from tracer.report.sweep_lines import sweep_summary_lines
from tracer.report.tables import print_report, to_csv, to_json, to_markdown
from tracer.report.textsafe import printable

#: a writer: ``(result, console, options) -> text`` (``table``: prints to the console, returns None)
Writer = Callable[[Any, Console, dict[str, Any]], "str | None"]


def kind_of(obj: Any) -> str:
    """Which result ``obj`` is: ``comparison`` (a Comparison, or a RunResult holding one),
    ``audit``, ``sweep`` or ``bench``.

    Raises:
        TracerError: none of them.
    """
    if hasattr(obj, "rows") and hasattr(obj, "counts"):
        return "audit"
    if hasattr(obj, "rows") and hasattr(obj, "params"):
        return "sweep"
    if hasattr(obj, "times") and hasattr(obj, "ratios"):
        return "bench"
    if hasattr(obj, "comparison") or hasattr(obj, "points"):
        return "comparison"
    raise TracerError(f"cannot render a {type(obj).__name__}; pass a RunResult, Comparison, Audit, SweepResult "
                      "or a benchmark's result")


def render(obj: Any, fmt: str = "table", console: Console | None = None, **options: Any) -> str | None:
    """Render a result in ``fmt`` (one of :data:`~tracer.report.layout.FORMATS`): ``table`` prints
    to ``console`` (default: stdout) and returns None; the others return the text.

    ``options`` of a comparison's table: ``columns`` (default
    :data:`~tracer.report.layout.DEFAULT_COLUMNS`), ``all_rows`` (every row, not only those that
    matter), ``command`` (the ``tracer`` command printing it: its "next:" suggestions name options
    it has).

    Raises:
        TracerError: unknown format, or not a result.
    """
    kind = kind_of(obj)
    if kind == "comparison":
        if "command" not in options and not hasattr(obj, "comparison"):
            options["written"] = False  # a bare Comparison (compare_trace, compare): its trace was only read
        obj = getattr(obj, "comparison", obj)
    return WRITERS[kind][check_format(fmt)](obj, console or stdout_console(), options)


# ---------------------------------------------------------------- comparison


def _comparison_table(c: Any, console: Console, options: dict[str, Any]) -> None:
    print_report(c, console, options.get("columns") or DEFAULT_COLUMNS, options.get("all_rows", False),
                 options.get("command", "run"), written=options.get("written"))


# ---------------------------------------------------------------- sweep


def _sweep_table(result: Any, console: Console, options: dict[str, Any]) -> None:
    lines = sweep_summary_lines(result) + ([f"sweep file: {result.path}"] if result.path else [])
    for line in lines:
        print_fitted(console, printable(line), 4 if line.startswith("  ") else 2)


def _sweep_csv(result: Any) -> str:
    buf = io.StringIO()
    rows = result.summary_rows()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["length"], lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _sweep_markdown(result: Any) -> str:
    rows = result.summary_rows()
    keys = list(rows[0]) if rows else ["length"]
    p = result.params
    lines = [f"**sweep · model {p.get('model')} · {p.get('scenario')} · {p.get('dtype')}**", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_md_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines + ["", *sweep_summary_lines(result)]) + "\n"


# ---------------------------------------------------------------- bench


def _bench_rich(result: Any) -> Any:
    """An engine's bench names its engine (:mod:`tracer.loops.bench_engine`); else the HF bench's table."""
    return engine_table(result) if result.config.get("engine") else bench_table(result)


def _bench_cells(result: Any) -> tuple[list[str], list[list[str]]]:
    """The benchmark table's headers and rows as text (its rich table's cells)."""
    t = _bench_rich(result)
    cols = [[str(x) for x in col.cells] for col in t.columns]
    return [str(col.header) for col in t.columns], [list(r) for r in zip(*cols)]


def _bench_csv(result: Any) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["mode", "median_s", "min_s", "max_s"])
    for m, v in result.times.items():
        if v:
            w.writerow([m, statistics.median(v), min(v), max(v)])
    for k, v in result.ratios().items():
        w.writerow([k, v, "", ""])
    return buf.getvalue()


def _bench_markdown(result: Any) -> str:
    headers, rows = _bench_cells(result)
    t = _bench_rich(result)
    lines = [f"**{t.title}**", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_md_cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines + (["", str(t.caption)] if t.caption else [])) + "\n"


def _md_cell(x: Any) -> str:
    return ("" if x is None else str(x)).replace("|", "\\|").replace("\n", " ")


#: result kind → format → writer; every kind has a writer for every format of FORMATS
WRITERS: dict[str, dict[str, Writer]] = {
    "comparison": {"table": _comparison_table, "json": lambda c, con, o: to_json(c),
                   "csv": lambda c, con, o: to_csv(c), "markdown": lambda c, con, o: to_markdown(c)},
    "audit": {"table": lambda a, con, o: print_audit(a, con), "json": lambda a, con, o: audit_json(a),
              "csv": lambda a, con, o: audit_csv(a), "markdown": lambda a, con, o: audit_markdown(a)},
    "sweep": {"table": _sweep_table, "json": lambda r, con, o: json.dumps(r.summary(), indent=1, default=str),
              "csv": lambda r, con, o: _sweep_csv(r), "markdown": lambda r, con, o: _sweep_markdown(r)},
    "bench": {"table": lambda r, con, o: con.print(_bench_rich(r)),
              "json": lambda r, con, o: json.dumps(r.to_dict(), indent=2, default=str),
              "csv": lambda r, con, o: _bench_csv(r), "markdown": lambda r, con, o: _bench_markdown(r)},
}


__all__ = ["FORMATS", "WRITERS", "kind_of", "render"]
