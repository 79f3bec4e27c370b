"""``tracer show``: a trace's header (the numeric contract), its runs and its stored comparisons.

For people (``--format table``, the default) the header is a tree of ``key  value`` lines: a nested
object (the model, the numeric contract, the family descriptor, the scenario and its plans) becomes
an indented block with one field per line, a list of plain values stays one JSON line
(``["sse4_2", "avx", "avx2"]``), a list of objects one block per item. In a terminal each value is
fitted to the width (broken between words, continuations under the value; a hash, a path or the
platform string has no spaces, so it stays whole); piped, the same at `$COLUMNS` (else 80). The runs follow
as blocks (tokens, compared positions, the plan, GEMM M per step). ``--format json`` prints the header, runs and comparisons as stored.

Every string comes from the file: printed as data (control characters escaped), never as markup.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.text import Text

from tracer.report.console import fitted, print_fitted, stdout_console
from tracer.report.summary import gemm_text
from tracer.report.textsafe import printable

#: the formats ``tracer show`` prints
SHOW_FORMATS = ("table", "json")
#: values start this many cells after a block's indent (longer keys push their value further)
KEY_WIDTH = 22
#: each level of nesting indents by this
STEP = 2


def _scalar(v: Any) -> str:
    """A value on one line: a string as it is, anything else (numbers, null, lists) as compact JSON."""
    return printable(v if isinstance(v, str) else json.dumps(v, default=str))


def _is_block(v: Any) -> bool:
    """A value shown as an indented block: an object, or a list that holds an object."""
    return (isinstance(v, dict) and bool(v)) or (isinstance(v, list) and any(isinstance(x, dict) for x in v))


def tree_lines(value: dict[str, Any], indent: int = STEP) -> list[tuple[int, str, str | None]]:
    """The header as ``(indent, key, value)`` lines: a block's key has value None and its fields follow
    one level deeper; a list item of a block list is keyed ``- 1``, ``- 2``, ... (1-based)."""
    out: list[tuple[int, str, str | None]] = []
    for k, v in value.items():
        if isinstance(v, dict) and v:
            out.append((indent, str(k), None))
            out += tree_lines(v, indent + STEP)
        elif _is_block(v):
            out.append((indent, str(k), None))
            for i, item in enumerate(v, 1):
                if isinstance(item, dict) and item:
                    out.append((indent + STEP, f"- {i}", None))
                    out += tree_lines(item, indent + 2 * STEP)
                else:
                    out.append((indent + STEP, f"- {i}", _scalar(item)))
        else:
            out.append((indent, str(k), _scalar(v)))
    return out


def print_tree(value: dict[str, Any], console: Console, indent: int = STEP) -> None:
    """Print :func:`tree_lines` of ``value``: keys bold, each value at its block's value column
    (:data:`KEY_WIDTH` after the block's indent, or two cells after a longer key), fitted to the
    terminal (:func:`tracer.report.console.fit`: continuations under the value)."""
    for depth, key, val in tree_lines(value, indent):
        label = Text(" " * depth)
        label.append(printable(key), style="bold")
        if val is None:
            console.print(label, soft_wrap=True, highlight=False)
            continue
        column = depth + KEY_WIDTH
        if len(label.plain) + 2 > column:  # a long key: its value two cells after it, continuations further in
            label.append("  ")
            column = depth + 2 * STEP
        lead = max(column, len(label.plain))
        if fitted(console) and " " not in val and lead + len(val) > console.width >= depth + 2 * STEP + len(val):
            console.print(label, soft_wrap=True, highlight=False)  # one long word (a path, a hash): whole, below
            label, column = Text(" " * (depth + 2 * STEP)), depth + 2 * STEP
        print_fitted(console, val, column, label=label)


def print_trace_info(info: dict[str, Any], path: str, fmt: str | bool = "table", console: Console | None = None) -> None:
    """Print :func:`tracer.store.trace.describe`'s ``info`` of the trace at ``path``: for people
    (``fmt`` ``table``: the header as a tree, :func:`print_tree`; a block per run; the stored
    comparisons' verdicts) or as JSON (``fmt`` ``json``, or True: the ``--json`` switch; strict
    JSON: a non-finite number is written as the string ``"inf"``, ``"-inf"`` or ``"nan"``).

    Raises:
        TracerError: a stored comparison that is not a comparison document (checked as ``tracer
            report`` checks it, whether or not the trace carries checksums; one line).
    """
    from tracer.diff.stored import comparison_from_dict
    from tracer.store.trace import json_safe

    for doc in info["comparisons"].values():
        comparison_from_dict(doc)
    if fmt is True or fmt == "json":
        print(json.dumps(json_safe({k: info[k] for k in ("header", "runs", "comparisons")}), indent=2, default=str))
        return
    out = console or stdout_console()
    print_fitted(out, Text(f"trace {printable(path)}", style="bold"), STEP)
    print_tree(info["header"], out)
    if not info["checksummed"]:
        print_fitted(out, "  checksums: none: written before tracer stored checksums; integrity not verified", 4)
    out.print(Text("runs", style="bold"))
    for r in info["runs"]:  # a block per run: its name, then what it computed, fitted like the header
        name = Text("  ")
        name.append(printable(r["name"]), style="bold")
        column = max(len(name.plain) + 2, 2 + 2 * STEP)
        print_fitted(out, f"{r['n_tokens']} tokens · compared positions {r['window'][0]}..{r['window'][1] - 1} · "
                          f"{r['captures']} capture points", column, label=name)
        for line in (str(r["plan"].get("description", "")), f"GEMM M per step: {gemm_text(r['plan'].get('gemm_m'))}"):
            print_fitted(out, printable(line), column, label=Text(" " * column))
    for name, comp in info["comparisons"].items():
        print_fitted(out, printable(f"stored comparison {name}: {comp.get('verdict', '?')}"), 2)


def check_show_format(fmt: str, as_json: bool = False) -> str:
    """``--format`` of ``tracer show``, checked even with ``--json`` (its other spelling of ``--format
    json``, as ``tracer bench`` takes them: :func:`tracer.report.terminal.check_bench_format`).

    Raises:
        TracerError: a format other than :data:`SHOW_FORMATS`.
    """
    from tracer.errors import TracerError

    if fmt not in SHOW_FORMATS:
        raise TracerError(f"unknown format '{fmt}' for tracer show; use one of: {', '.join(SHOW_FORMATS)}")
    return "json" if as_json else fmt
