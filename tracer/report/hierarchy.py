"""The audit's hierarchy table rendered: rich table, JSON, CSV, markdown (rendering only).

Takes an :class:`~tracer.loops.audit.Audit` (the table as data) and draws it; nothing is computed here.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from tracer.diff.metrics import flips_phrase
from tracer.plan.hierarchy import SEED_STATUS, invariant
from tracer.report.console import fitted, print_fitted, print_whole, stdout_console
from tracer.report.html import esc, headline_html, kv_table, page, table_html
from tracer.report.layout import fit_columns, shorten_left
from tracer.report.tables import _num
from tracer.store.trace import json_safe


def _fmt_row(r: Any) -> dict[str, str]:
    mit = "; ".join(f"{k}: {'restores' if v is True else 'no' if v is False else 'n/a'}" for k, v in r.mitigations.items())
    holds = {"passed": "yes", "failed": "no", "skipped": "skipped"}[r.status]
    return {
        "level": str(r.check.level), "check": r.check.label, "invariant": invariant(r.check), "holds": holds,
        "last": "-" if r.last_layer is None else f"{r.last_layer[0]:,} / {r.last_layer[1]:,}",
        "logit": _num(r.max_logit_diff) if r.max_logit_diff is not None else "-",
        "flips": "-" if r.argmax_flips is None else str(r.argmax_flips),
        "first": r.first_divergent or ("-" if r.status != "skipped" else (r.reason or "")),
        "mitigations": mit or "-", "seed": SEED_STATUS[r.check.level],
    }


_COLUMNS = (("level", "level"), ("check", "check"), ("invariant", "invariant"), ("holds", "holds bitwise?"),
            ("last", "last layer differing"), ("logit", "max abs logit diff"), ("flips", "argmax flips"),
            ("first", "first divergent (or why skipped)"), ("mitigations", "mitigations"), ("seed", "seed's status"))


def _title(a: Any) -> str:
    f = a.facts
    dev = f"{f.get('device')} ({f.get('device_name')})" if f.get("device_name") else str(f.get("device"))
    return f"determinism audit · model {a.model} · {f.get('dtype')} · {dev} · {f.get('n_tokens')} tokens · torch {f.get('torch')}"


def _summary(a: Any) -> str:
    c = a.counts()
    return f"{c['total']} check{'' if c['total'] == 1 else 's'}: {c['passed']} hold{'s' if c['passed'] == 1 else ''} bitwise, {c['failed']} diverge, {c['skipped']} skipped"


#: the audit table's columns that stay at every width, and the order the others give way in
AUDIT_KEEP = ("level", "check", "holds", "logit", "flips", "first")
AUDIT_DROP = ("seed", "invariant", "mitigations", "last")
#: kept columns that give way in a terminal too narrow for them (the "diverges:" lines above say the flips)
AUDIT_SPARE = ("logit", "flips")
#: text columns that wrap (the others hold numbers or one word and never do)
AUDIT_TEXT = ("check", "invariant", "first", "mitigations", "seed")
#: the narrowest a text column gets: a check's label in two or three lines at 80 columns (not a word a line),
#: a first divergent point still "…self_attn.kv_cache"
AUDIT_TEXT_MIN = 16


def print_audit(a: Any, console: Any = None) -> None:
    """The summary first (counts, then one line per diverging check), the hierarchy table fitted to
    the console's width (:func:`tracer.report.layout.fit_columns`: the seed's status and the
    invariant give way first, named under the table, then in a narrow terminal the logit and flips
    columns; numbers never cut; a point's name shortened at a dot), the summary line again and the
    trace path; every line fitted to a terminal (:func:`tracer.report.console.print_fitted`)."""
    from rich.table import Table
    from rich.text import Text

    console = console or stdout_console()
    print_fitted(console, _summary(a), len("verdict: "), label="verdict:",
                 style="bold green" if not a.counts()["failed"] else "bold red")
    for r in a.rows:  # summary first: what diverges, from where
        if r.status == "failed":
            print_fitted(console, f"L{r.check.level} {r.check.label}: from {r.first_divergent}, "
                                  f"{flips_phrase(r.argmax_flips)}", len("diverges: "), label="diverges:")
    console.print()
    rows = [_fmt_row(r) for r in a.rows]
    heads = dict(_COLUMNS)
    width = console.width if fitted(console) else 1 << 30
    fit = fit_columns(tuple(k for k, _ in _COLUMNS), heads, {k: [c[k] for c in rows] for k in heads}, console.width,
                      name_key="first", keep=AUDIT_KEEP, drop_order=AUDIT_DROP, flexible=AUDIT_TEXT,
                      spare=AUDIT_SPARE if width < 1 << 30 else (), flex_min=AUDIT_TEXT_MIN)
    print_fitted(console, Text(_title(a)))
    t = Table(header_style="bold", show_lines=False)
    wid = dict(zip(fit.columns, fit.widths))
    for key in fit.columns:
        t.add_column(heads[key], width=wid[key], overflow="fold")
    for r, cells in zip(a.rows, rows):
        style = {"passed": "green", "failed": "red", "skipped": "dim"}[r.status]
        t.add_row(*(Text(shorten_left(cells[k], wid[k]) if k == "first" and " " not in cells[k] else cells[k])
                    for k in fit.columns), style=style)  # Text: a reason's "pip install -e '.[extra]'" is not markup
    print_whole(console, t, fit.width)  # too narrow even so: wider, never cut
    if fit.dropped:
        print_fitted(console, f"left out to fit {console.width} columns: {', '.join(heads[k] for k in fit.dropped)} "
                              "(a wider terminal, COLUMNS=200, or --format markdown / json shows them)")
        if "seed" in fit.dropped:
            for level in sorted({r.check.level for r in a.rows}):
                print_fitted(console, f"  seed's status of level {level}: {SEED_STATUS[level]}", 4)
    print_fitted(console, _summary(a))
    if a.trace:
        print_fitted(console, Text(f"trace: {a.trace}", style="dim"), len("trace: "))


def audit_html(a: Any) -> str:
    """The audit as a single-file HTML page: the counts, the hierarchy matrix (sortable,
    filterable; rows coloured by status) and the facts (see :mod:`tracer.report.html`)."""
    counts = a.counts()
    failed = [r for r in a.rows if r.status == "failed"]
    head = [("checks", _summary(a))]
    if failed:
        head.append(("diverge", "; ".join(f"L{r.check.level} {r.check.label} (from {r.first_divergent})" for r in failed)))
    head += [(f"skipped: L{r.check.level}", f"{r.check.label}: {r.reason}") for r in a.rows if r.status == "skipped"]
    cells = [_fmt_row(r) for r in a.rows]
    table = table_html("audit", [h for _, h in _COLUMNS], ([c[k] for k, _ in _COLUMNS] for c in cells),
                       classes=[{"passed": "", "failed": "diff", "skipped": "skip"}[r.status] for r in a.rows],
                       values=[[r.check.level] + [None] * 4 + [r.max_logit_diff, r.argmax_flips] + [None] * 3 for r in a.rows],
                       diff_toggle=True)
    sections = [("summary", headline_html(head)), ("determinism hierarchy", table),
                ("facts", kv_table(a.facts.items()) + (f'<p class="note">trace: {esc(a.trace)}</p>' if a.trace else ""))]
    return page(_title(a), _summary(a), counts["failed"] == 0, sections)


def audit_json(a: Any) -> str:
    """The audit's document (:meth:`Audit.to_dict`) as indented JSON."""
    return json.dumps(json_safe(a.to_dict()), indent=2, default=str)


def audit_csv(a: Any) -> str:
    """One CSV row per check (nested values as JSON)."""
    buf = io.StringIO()
    rows = [r.to_dict() for r in a.rows]
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["key"], lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()


def audit_markdown(a: Any) -> str:
    """The hierarchy table as markdown, its title above and its summary below."""
    lines = [f"**{_title(a)}**", "", "| " + " | ".join(h for _, h in _COLUMNS) + " |",
             "|" + "---|" * len(_COLUMNS)]
    for r in a.rows:
        cells = _fmt_row(r)
        lines.append("| " + " | ".join(cells[k].replace("|", "\\|") for k, _ in _COLUMNS) + " |")
    lines += ["", _summary(a)]
    return "\n".join(lines) + "\n"
