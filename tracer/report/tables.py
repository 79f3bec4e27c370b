"""Rendering a :class:`~tracer.diff.result.Comparison`: rich table, JSON, CSV or markdown.

One result object, one dispatch (:func:`render`). The terminal report starts with the headline
block of :mod:`tracer.report.summary`, then the table of the rows that matter (one row per capture point
in execution order with ``all_rows``), a logits row with the argmax flips, and a one-line verdict.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracer.diff.metrics import ULP_BINS, TensorDiff
from tracer.diff.provenance import classify, merged_kernels
from tracer.diff.result import Comparison
from tracer.execute.kernels import summarize
from tracer.report import rl as rl_report
from tracer.report.console import print_fitted, print_whole, stdout_console
from tracer.report.layout import (COLUMN_HEADERS, DEFAULT_COLUMNS, FORMATS, NAME_MAX, NAME_MIN,  # noqa: F401
                                  SPARE, WIDE_COLUMNS, check_columns, check_format, fit_columns, name_cell,
                                  readable_width, table_width)
from tracer.report.origins import origin_lines, origin_record
from tracer.report.rl import markdown_lines, print_rl
from tracer.report.rl import csv_meta as rl_meta
from tracer.report.summary import (flip_tie, flip_tokens, flips_text, headline, nonfinite_text, plan_line,
                                   rows_that_matter,
                                   positions_text, unverified_text, verdict_line)
from tracer.report.textsafe import printable
from tracer.store.budget import format_size
from tracer.store.trace import json_safe


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


def _row(name: str, kind: str, d: TensorDiff, **extra: Any) -> dict[str, Any]:
    """One row: ``name``, ``kind``, ``n_diff``, ``n_total``, ``fraction``, then every other field of ``d``
    in declaration order (a field added to :class:`~tracer.diff.metrics.TensorDiff` lands in CSV and
    DataFrames with no edit here; ``ulp_hist`` spread over ``ulp_0 .. ulp_gt16``), then the point's own keys."""
    r: dict[str, Any] = {"name": name, "kind": kind, "n_diff": d.n_diff, "n_total": d.n_total,
                         "fraction": d.n_diff / d.n_total if d.n_total else 0.0}
    for f in dataclasses.fields(d):
        if f.name in r:
            continue
        value = getattr(d, f.name)
        if f.name == "ulp_hist":
            r.update({f"ulp_{b}": n for b, n in zip(ULP_KEYS, value)})
            continue
        r[f.name] = value
    r.update(amplification=None, growth=None, n_outside_tol=None, argmax_flips=None, origin=False, kernels=None)
    r["class"] = None
    r["cross_dtype"] = None
    r.update(extra)
    return r


#: ``ulp_hist`` bins as CSV/JSON row keys (``ulp_0``, ``ulp_1``, ``ulp_2``, ``ulp_3_4``, ...)
ULP_KEYS = ("0", "1", "2", "3_4", "5_8", "9_16", "gt16")


def rows(c: Comparison) -> list[dict[str, Any]]:
    """The table's rows as plain dicts (shared by every format), logits last.

    Keys: ``name, kind``, every :class:`~tracer.diff.metrics.TensorDiff` field (``n_diff, n_total,
    fraction, max_abs_diff, mean_abs_diff, max_ulp`` (integer-line ULP distance), ``ulp_0 .. ulp_gt16``
    (histogram counts), ``rel_error, cosine, sqnr_db, frac_rel_lt_1e3, frac_rel_lt_5e3, n_nan_a,
    n_nan_b, n_inf_a, n_inf_b, max_ulp_mag`` (ULPs of the larger magnitude), ``n_nan_payload``), then
    ``amplification`` (vs the first divergent point), ``growth`` (vs the same point one layer
    earlier), ``n_outside_tol, argmax_flips, origin, kernels, class``.
    """
    cross = {n: x.text(c.run_a, c.run_b) for n, x in c.cross_dtypes.items()}
    out = [_row(p.name, p.kind, p.diff, origin=p.origin, amplification=p.amplification, growth=p.growth,
                cross_dtype=cross.get(p.name),
                n_outside_tol=p.n_outside_tol, kernels=_kernels_cell(p.calls_a, p.calls_b, c.positions),
                **{"class": (classify(p, c.positions) or {}).get("class")}) for p in c.points]
    if c.logits is not None:
        out.append(_row(f"{c.logits_name} (logits)", "logits", c.logits.tensor, origin=c.logits_origin,
                        amplification=c.logits_amplification, cross_dtype=cross.get(c.logits_name),
                        n_outside_tol=c.logits_n_outside_tol, argmax_flips=len(c.logits.argmax_flips),
                        kernels=_kernels_cell(c.logits_calls[0], c.logits_calls[1], c.positions)))
    return out


def _kernels_cell(calls_a: list, calls_b: list, positions: tuple[int, int]) -> str | None:
    """``A vs B`` kernel summaries of one point (one text when equal); None when not recorded."""
    ka, kb = merged_kernels(calls_a, positions), merged_kernels(calls_b, positions)
    if ka is None and kb is None:
        return None
    sa, sb = summarize(ka), summarize(kb)
    return sa if sa == sb else f"{sa} vs {sb}"


def _hist(r: dict[str, Any]) -> str:
    """Compact ULP histogram of the differing elements: ``1:12 2:3 >16:1``."""
    parts = [f"{label}:{r[f'ulp_{key}']}" for label, key in zip(ULP_BINS[1:], ULP_KEYS[1:]) if r[f"ulp_{key}"]]
    return " ".join(parts) or "-"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.4g}%"


#: table columns: key → (header, formatter of a row); the headers, the defaults and the check of
#: ``--columns`` are :mod:`tracer.report.layout`'s (read without loading a comparison)
COLUMNS: dict[str, tuple[str, Any]] = {k: (COLUMN_HEADERS[k], fn) for k, fn in {
    "point": None,
    "diff": lambda r: f"{r['n_diff']:,} / {r['n_total']:,}",
    "fraction": lambda r: _frac(r["n_diff"], r["n_total"]),
    "max_abs": lambda r: _num(r["max_abs_diff"]),
    "mean_abs": lambda r: _num(r["mean_abs_diff"]),
    "ulp": lambda r: _num(r["max_ulp_mag"]),
    "ulp_line": lambda r: str(r["max_ulp"]),
    "hist": _hist,
    "rel": lambda r: _num(r["rel_error"]),
    "cos": lambda r: "1" if r["cosine"] == 1.0 else f"{r['cosine']:.9f}",
    "sqnr": lambda r: _num(r["sqnr_db"]),
    "rel1": lambda r: _pct(r["frac_rel_lt_1e3"]),
    "rel5": lambda r: _pct(r["frac_rel_lt_5e3"]),
    "growth": lambda r: _num(r["growth"]),
    "ampl": lambda r: _num(r["amplification"]),
    "nan_inf": lambda r: f"{r['n_nan_a']}/{r['n_inf_a']} | {r['n_nan_b']}/{r['n_inf_b']}",
    "tol": lambda r: "-" if r["n_outside_tol"] is None else f"{r['n_outside_tol']:,}",
    "flips": lambda r: "-" if r["argmax_flips"] is None else str(r["argmax_flips"]),
    "kernels": lambda r: r["kernels"] or "-",
}.items()}


def _title(c: Comparison) -> str:
    f = c.facts
    bits = [f"{c.scenario}", f"model {c.model}"]
    if f.get("dtype"):
        bits.append(str(f["dtype"]))
    if f.get("device"):
        dev = str(f["device"])
        named = ", ".join(str(x) for x in (f.get("device_name"), f.get("isa")) if x)
        if named:
            dev += f" ({named})"
        bits.append(dev)
    bits.append(positions_text(c.positions, f.get("n_tokens")))
    return " · ".join(bits)


def _plans(c: Comparison) -> str:
    f = c.facts
    a, b = (f"{run}: {plan_line(c, k)}" for run, k in (("A", "a"), ("B", "b")))
    return f"{a}\n{b}" + (f"\n{_sliding_note(c)}" if f.get("sliding_layers") else "")


def sliding_mark(c: Comparison, name: str) -> str:
    """``" (sliding)"`` for a decoder layer's row, or a row of its attention, when that layer uses
    sliding-window attention (``facts["sliding_layers"]``, from the header's numeric contract; the
    layer list and attention paths from its family descriptor, ``facts["layers_path"]`` and
    ``facts["attention_path"]``, e.g. ``model.layers.7``, ``model.layers.7.self_attn.k_norm``);
    ``""`` otherwise."""
    layers, attention = c.facts.get("layers_path"), c.facts.get("attention_path")
    sliding = set(c.facts.get("sliding_layers") or ())
    if not sliding or not isinstance(layers, str):
        return ""
    inner = rf"(\.{re.escape(attention)}(\.|$)|$)" if isinstance(attention, str) else "$"
    m = re.match(rf"{re.escape(layers)}\.(\d+){inner}", name)
    return " (sliding)" if m and int(m.group(1)) in sliding else ""


def _sliding_note(c: Comparison) -> str:
    layers = c.facts["sliding_layers"]
    return (f"(sliding) = sliding-window attention (window {c.facts.get('sliding_window')} tokens): "
            f"{len(layers)} layers; the others attend globally")


def flips_lines(c: Comparison, limit: int = 10) -> list[str]:
    """One line per argmax flip: position, tokens in A and B (ids, and the decoded text where known),
    top-2 margins, and whether a run's top two tie or lie 1 ULP apart."""
    if c.logits is None:
        return []
    lines = []
    for f in c.logits.argmax_flips[:limit]:
        lines.append(
            f"position {c.positions[0] + f.position}: top-1 {flip_tokens(f)} "
            f"(top-2 margin {_num(f.margin_a)} in A, {_num(f.margin_b)} in B{flip_tie(f)})"
        )
    if len(c.logits.argmax_flips) > limit:
        lines.append(f"... {len(c.logits.argmax_flips) - limit} more")
    return lines


def with_kernels(c: Comparison, columns: tuple[str, ...]) -> tuple[str, ...]:
    """``columns`` plus the ``kernels`` column when the runs recorded kernels (``--kernels``) and the
    columns are the default set."""
    if columns in (DEFAULT_COLUMNS, WIDE_COLUMNS) and any(r["kernels"] for r in rows(c)):
        return columns + ("kernels",)
    return columns


def _point_marker(c: Comparison, r: dict[str, Any]) -> tuple[str, str, str]:
    """A row's name (with ``(sliding)``), its marker (``  ◀ origin`` / ``  ◀ first`` / "") and its
    note (:func:`point_mark`: the dtypes compared in, a capture contract; "" when none)."""
    base = r["name"].split(" ")[0]
    mark = "  ◀ origin" if r["origin"] else ("  ◀ first" if base == c.first_divergent else "")
    return printable(r["name"]) + sliding_mark(c, base), mark, point_mark(c, base)


def point_mark(c: Comparison, name: str) -> str:
    """What a row's numbers mean when it is not a plain same-dtype comparison: ``" [in float32; A is
    bfloat16, B float32; ULP* in bfloat16]"`` (the runs' dtypes differ), ``" [capture contract ×8]"``
    (the sides hold different quantities); ``""`` otherwise."""
    x = c.cross_dtypes.get(name)
    odd = next((m for m in c.contract if m.name == name), None)
    mark = "" if x is None else f" [in {x.compared_in}; {c.run_a} is {x.dtype_a}, {c.run_b} {x.dtype_b}; ULP* in {x.ulps_in}]"
    if odd is not None:
        k = odd.factor if odd.how == "rank sum" or odd.factor >= 1 else 1 / odd.factor
        mark += f" [capture contract: {'partial sums of ' if odd.how == 'rank sum' else '×'}{k:g}{' ranks' if odd.how == 'rank sum' else ''}]"
    return mark


def _caption(c: Comparison, columns: tuple[str, ...], n_shown: int, n_all: int, thinned: int = 0) -> list[str]:
    lines = []
    cut = (f"; {thinned} more such rows, the smallest changes, left out to keep {MAX_ROWS} rows" if thinned else "")
    if n_shown < n_all and c.first_divergent is None:  # nothing differs: no origin, no changes to show
        lines.append(f"{n_shown} of {n_all} rows: the first point, the last layer, the final norm, the logits "
                     "(--all-rows prints all)")
    elif n_shown < n_all:
        nan = ", rows where NaN/Inf appear or change count" if nonfinite_text(c) is not None else ""
        lines.append(f"{n_shown} of {n_all} rows: the first point, the origin, rows where the differing count "
                     f"changes ×2 or max |Δ| ×4{nan}, the last layer, the logits{cut} (--all-rows prints all)")
    lines += _plans(c).splitlines()
    if "ulp" in columns:
        lines.append(ULP_NOTE)
    return lines


#: skipped points of one reason that become one row of the terminal table (unless --all-rows)
SKIP_GROUP = 3


def skip_rows(skipped: Any, grouped: bool) -> list[tuple[str, str, bool]]:
    """The table rows of the points not compared: ``(name, marker, fails)``, one per point; with
    ``grouped``, :data:`SKIP_GROUP` or more of one reason are one row named by their common pattern
    (``model.layers.*.self_attn.kv_cache ×30``), or the first and the count of the others."""
    import re

    rows: list[tuple[str, str, bool]] = []
    groups: dict[tuple[str, bool], list[str]] = {}
    for sk in skipped:
        groups.setdefault((sk.reason, sk.fails), []).append(sk.name)
    for (reason, fails), names in groups.items():
        mark = f"  ◀ not compared: {printable(reason)}"
        if not grouped or len(names) < SKIP_GROUP:
            rows += [(printable(n), mark, fails) for n in names]
            continue
        patterns = {re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names}
        name = f"{patterns.pop()} ×{len(names)}" if len(patterns) == 1 else f"{names[0]} and {len(names) - 1} more"
        rows.append((printable(name), mark + " (--all-rows lists each)", fails))
    return rows


def fit_table(c: Comparison, columns: tuple[str, ...] = DEFAULT_COLUMNS, keep: list[int] | None = None,
              width: int | None = None, thinned: int = 0) -> tuple[Table, list[str]]:
    """The amplification table fitted to ``width`` characters, and the lines that go under it.

    ``columns``: keys of :data:`COLUMNS` (the ``kernels`` column is added when the runs recorded
    kernels, :func:`with_kernels`); ``keep``: indices into :func:`rows` to show (all when None);
    ``width``: the characters available (None: no limit). Columns the width cannot hold are left
    out in the order of :data:`tracer.report.layout.DROP_ORDER` (never the name, differing / total,
    max abs diff, ULP or flips), and a line under the table names them; no number is ever cut
    (:func:`tracer.report.layout.fit_columns`). Kernels that do not fit as a column get a section
    of their own under the table, one line per row. ``thinned``: rows that matter which ``keep``
    leaves out to stay within :data:`MAX_ROWS` (the caption says how many).

    Returns:
        ``(table, lines)``: the rich Table (no title, no caption) and the text lines to print after
        it: kernels, left-out columns, rows left out, the plans, the ULP note.
    """
    columns = with_kernels(c, columns)
    all_rows = rows(c)
    shown = all_rows if keep is None else [all_rows[i] for i in keep]
    names = [_point_marker(c, r) for r in shown]
    notes = {note for _, _, note in names}
    common = notes.pop().strip() if len(notes) == 1 and len(names) > 1 else ""
    if common:  # the same note on every row (the runs' dtypes differ): said once, under the table
        names = [(n, m, "") for n, m, _ in names]
    skipped = skip_rows(c.skipped, grouped=keep is not None)
    cells = {k: [COLUMNS[k][1](r) for r in shown] + ["-"] * len(skipped) for k in columns if k != "point"}
    cells["point"] = [n + m for n, m, _ in names] + [n + m for n, m, _ in skipped]  # a note wraps: not a width
    headers = {k: COLUMNS[k][0] for k in columns}
    # the name column keeps every shown name's layer index when the width allows (never over NAME_MAX)
    name_min = max([NAME_MIN, *(min(readable_width(n), NAME_MAX) for n, _, _ in names)])
    fit = fit_columns(columns, headers, cells, width if width is not None else 1 << 30, name_min=name_min, spare=SPARE)
    wid = dict(zip(fit.columns, fit.widths))
    t = Table(header_style="bold")
    for key in fit.columns:
        # fixed widths, each at least the widest cell: cells never wrap, headers wrap at spaces
        t.add_column(headers[key], justify="left" if key == "point" else "right", width=wid[key], overflow="fold")
    for i, (r, (name, mark, note)) in enumerate(zip(shown, names)):
        style = ("bold red" if r["origin"] else "red") if r["n_diff"] else None
        t.add_row(*[Text(name_cell(name, mark, wid["point"], note)) if k == "point" else cells[k][i] for k in fit.columns],
                  style=style)
    for name, mark, fails in skipped:  # never dropped: a point that could not be compared is a row too
        t.add_row(*[Text(name_cell(name, mark, wid["point"]), overflow="fold") if k == "point" else "-"
                    for k in fit.columns], style="bold red" if fails else "dim")
    lines: list[str] = [f"every row: {common}"] if common else []
    if "kernels" in fit.dropped:
        lines.append("kernels (A vs B), not enough width for a column:")
        lines += [f"  {name}: {r['kernels']}" for r, (name, _, _) in zip(shown, names) if r["kernels"]]
    others = [COLUMNS[k][0] for k in fit.dropped if k != "kernels"]
    if others:
        lines.append(f"left out to fit {width} columns: {', '.join(others)} (a wider terminal, COLUMNS=200, "
                     "or --format csv / json shows them)")
    return t, lines + _caption(c, fit.columns, len(shown), len(all_rows), thinned)


def table(c: Comparison, columns: tuple[str, ...] = DEFAULT_COLUMNS, keep: list[int] | None = None,
          width: int | None = None) -> Table:
    """The amplification table as one rich Table: the title, the rows (:func:`fit_table`, fitted
    to ``width`` when given) and the lines under it as the caption."""
    t, lines = fit_table(c, columns, keep, width)
    t.title, t.caption = Text(printable(_title(c))), Text(printable("\n".join(lines), newlines=True))
    t.title_justify = t.caption_justify = "left"
    return t


ULP_NOTE = ("ULP*: max |a−b| in units of the dtype's spacing at max(|a|,|b|); the integer bit-pattern "
            "distance (huge across zero) is 'max ULP (line)' (--wide) and max_ulp in JSON/CSV")


def logits_lines(c: Comparison) -> list[str]:
    """The logits statistics: KL(A‖B), top-k overlap, rank in B of A's top token."""
    if c.logits is None:
        return []
    lg = c.logits
    return [f"logits: KL(A‖B) mean {_num(lg.kl_mean)} max {_num(lg.kl_max)} nats · top-5 overlap "
            f"{lg.top5_overlap:.4g} · top-10 overlap {lg.top10_overlap:.4g} · A's top token at worst "
            f"#{lg.rank_of_a_top_in_b_max + 1} in B · {flips_text(c)}"]


def replay_lines(c: Comparison) -> list[str]:
    """The ``--decode`` replay: first differing generated token and both continuations."""
    rp = c.replay
    if rp is None:
        return []
    lines = [f"decode: {rp.line()}"]
    if rp.first_diff is not None or rp.text_a is not None:
        for run, toks, text in ((c.run_a, rp.tokens_a, rp.text_a), (c.run_b, rp.tokens_b, rp.text_b)):
            lines.append(f"  {run}: {text!r}" if text is not None else f"  {run}: {list(toks)}")
    return lines


#: the most rows the table shows by default (``--all-rows``: every row), sublayers included, whatever
#: the terminal's height (the caption counts the rows that matter it leaves out)
MAX_ROWS = 15


def print_report(c: Comparison, console: Console | None = None,
                 columns: tuple[str, ...] = DEFAULT_COLUMNS, all_rows: bool = False, command: str = "run",
                 written: bool | None = None) -> None:
    """Print the headline block (:func:`tracer.report.summary.headline`: verdict, origin, first divergent
    point, growth, logits, what to try next), then the title line, the table of the rows that matter
    (:func:`tracer.report.summary.rows_that_matter`: at most :data:`MAX_ROWS`, whatever the
    terminal's height; every row with ``all_rows``) fitted to the console's width (:func:`fit_table`), the
    lines under it, logits statistics, flips, replay, noise verdict and the verdict to ``console``
    (stdout by default).

    Styled in a terminal, every line fitted to its width (:func:`tracer.report.console.fit`: broken
    between words, continuations indented); plain text when piped, fitted to `$COLUMNS` (else 80) the same way.
    ``written``: whether this run wrote the trace (its line then says the size and how to write
    none); None: when ``command`` is ``run``.
    """
    console = console or stdout_console()
    if c.rl is not None:  # rollout-vs-train: what RL stacks log comes first, then where the gap is born
        pairs = rl_report.summary_pairs(c.rl)
        width = max(len(k) for k, _ in pairs) + 2
        for key, text in pairs:
            print_fitted(console, printable(text), width, label=f"{key}:")
        console.print()
    head = headline(c, command)
    width = max(len(k) for k, _ in head) + 2
    for key, text in head:
        style = "bold green" if key == "verdict" and c.identical else ("bold red" if key in ("verdict", "origin") else None)
        print_fitted(console, printable(text), width, label=f"{key}:", style=style)
    console.print()
    keep = None if all_rows else rows_that_matter(c, MAX_ROWS)
    thinned = 0 if keep is None else len(rows_that_matter(c)) - len(keep)
    t, under = fit_table(c, columns, keep, console.width, thinned)
    print_fitted(console, printable(_title(c)))
    print_whole(console, t, table_width([col.width or 0 for col in t.columns]))  # too narrow even so: wider, never cut
    for line in under:
        print_fitted(console, printable(line), 3 if line[:3] in ("A: ", "B: ") else 2)
    for line in logits_lines(c):
        print_fitted(console, line)
    for line in flips_lines(c):
        print_fitted(console, f"  {line}", 4)
    for line in replay_lines(c):
        print_fitted(console, printable(line), 4)
    if c.noise is not None:
        for line in c.noise.lines():
            print_fitted(console, printable(line), 4)
    if c.rl is not None:
        print_rl(c.rl, console)
    for line in c.facts.get("notes", []):
        print_fitted(console, f"  {printable(line)}", 4)
    print_fitted(console, printable(verdict_line(c)), len("verdict: "), label="verdict:",
                 style="bold green" if c.identical else "bold red")
    if (bare := unverified_text(c)) is not None:
        print_fitted(console, printable(bare), len("unverified: "), label="unverified:", style="bold yellow")
    if c.trace:
        wrote = command == "run" if written is None else written
        print_fitted(console, Text(f"trace: {printable(c.trace)}{_written(c.trace, wrote)}", style="dim"),
                     len("trace: "))


def _written(path: str, written: bool) -> str:
    """After the trace a run wrote: its size, and how to write none (a default run writes one, tens of
    MB; ``traces/`` fills up unseen); nothing for a trace that was only read."""
    import os

    from tracer.errors import from_cli, option

    if not written:
        return ""
    try:
        how = "--no-store" if from_cli() else option("store", "none")  # tracer.run(store="none") from Python
        return f" ({format_size(os.path.getsize(path))}; {how} writes none)"
    except OSError:
        return ""


#: run metadata leading every CSV row (the same value on each row of one comparison)
CSV_META = ("model", "scenario", "dtype", "device", "positions_start", "positions_stop", "n_tokens",
            "verdict", "first_divergent", "trace", "unverified")


def csv_meta(c: Comparison) -> dict[str, Any]:
    """The run metadata of :data:`CSV_META` for ``c``."""
    f = c.facts
    return {"model": c.model, "scenario": c.scenario, "dtype": f.get("dtype"), "device": f.get("device"),
            "positions_start": c.positions[0], "positions_stop": c.positions[1], "n_tokens": f.get("n_tokens"),
            "verdict": c.verdict(), "first_divergent": c.first_divergent, "trace": c.trace,
            "unverified": unverified_text(c), **rl_meta(c.rl)}


def to_csv(c: Comparison) -> str:
    """The run metadata (:data:`CSV_META`: model, scenario, dtype, device, compared positions,
    token count, verdict, first divergent point, trace, unverified) then every row key of :func:`rows`, as CSV
    columns; one line per capture point."""
    buf = io.StringIO()
    meta = csv_meta(c)
    all_rows = [{**meta, **r} for r in rows(c)]
    fields = list(all_rows[0]) if all_rows else [*CSV_META, "name"]
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in all_rows:
        w.writerow({k: ("" if r[k] is None else r[k]) for k in fields})
    return buf.getvalue()


def to_markdown(c: Comparison, columns: tuple[str, ...] = WIDE_COLUMNS) -> str:
    """A markdown report: origins, the table (every column by default), logits, replay, verdict."""
    columns = with_kernels(c, columns)
    lines = [f"**{_title(c)}**", "", *(f"- {p}" for p in _plans(c).splitlines()), ""]
    if c.rl is not None:
        lines += markdown_lines(c.rl)
    if origin_lines(c):
        lines += ["**origin of divergence:**", "", *(f"- `{x}`" for x in origin_lines(c)), ""]
    lines += ["| " + " | ".join(COLUMNS[k][0].replace("|", "\\|") for k in columns) + " |",
              "|" + "|".join("---" if k == "point" else "---:" for k in columns) + "|"]
    for r in rows(c):
        cells = [(r["name"] + sliding_mark(c, r["name"]) + point_mark(c, r["name"].split(" ")[0])
                  + (" **◀ origin**" if r["origin"] else ""))
                 if k == "point" else COLUMNS[k][1](r) for k in columns]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    for sk in c.skipped:
        cells = [f"{sk.name} **◀ not compared: {sk.reason}**" if k == "point" else "-" for k in columns]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    lines.append("")
    if "ulp" in columns:
        lines += [ULP_NOTE, ""]
    lines.extend(f"- {line}" for line in logits_lines(c) + flips_lines(c) + replay_lines(c) + list(c.facts.get("notes", [])))
    if c.noise is not None:
        lines.extend(f"- {line}" for line in c.noise.lines())
    lines.append(f"\n**verdict:** {verdict_line(c)}")
    if (bare := unverified_text(c)) is not None:
        lines.append(f"\n**unverified:** {bare}")
    return "\n".join(lines) + "\n"


def _json_default(x: Any) -> Any:
    if isinstance(x, float):
        return None
    return str(x)


def to_json(c: Comparison) -> str:
    """The comparison's document with each origin's sentence (:func:`tracer.report.origins.origin_record`), indented."""
    doc = c.to_dict()
    doc["origins"] = [origin_record(p, c) for p in c.origin_points()]
    return json.dumps(json_safe(doc), indent=2, default=_json_default)
