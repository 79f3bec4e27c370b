"""The single-file HTML report: one self-contained page (inline CSS and JS, figures as inline SVG,
no network, no external assets), readable on a phone and printable.

- :func:`comparison_html`: a run or ``tracer compare``: headline (:mod:`tracer.report.summary`), the
  numeric contract (trace header), the origin with its shapes, the figures, the full table
  (sortable, filterable), logits, flips, decode replay and noise verdict.
- :func:`page`, :func:`table_html`, :func:`headline_html`, :func:`figure_html`: the building blocks
  the audit matrix (:func:`tracer.report.hierarchy.audit_html`) and the sweep map
  (:func:`tracer.report.pages.sweep_html`) use.
- :func:`write_report`: writes a page atomically, never clobbering without ``overwrite``.

Everything here renders data already computed; nothing reads a trace or recomputes a metric.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tracer.errors import TracerError
from tracer.report import rl as rl_report
from tracer.report.origins import origin_lines, origin_record
from tracer.report.outputs import check_report_path  # noqa: F401 - re-exported
from tracer.report.plot import amplification_figure, heatmap_figure, position_diffs_comparison, ulp_figure
from tracer.report.summary import headline, plan_line, unverified_text, verdict_line
from tracer.report.tables import (COLUMNS, WIDE_COLUMNS, _title, flips_lines, logits_lines, point_mark, replay_lines,
                                  rows)
from tracer.store.integrity import write_error_message

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from tracer.diff.result import Comparison
    from tracer.diff.rl import RLComparison

CSS = """
:root{--fg:#1b1f24;--muted:#57606a;--bad:#b42318;--ok:#1a7f37;--bg:#fff;--line:#d0d7de;--band:#f6f8fa}
*{box-sizing:border-box}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg);margin:0 auto;max-width:1200px;padding:12px}
h1{font-size:1.3em;margin:.2em 0} h2{font-size:1.1em;margin:1.2em 0 .4em;border-bottom:1px solid var(--line)}
.verdict{font-weight:600;padding:.4em .6em;border-radius:6px;margin:.4em 0}
.verdict.bad{background:#fdecea;color:var(--bad)} .verdict.ok{background:#e6f4ea;color:var(--ok)}
dl.headline{display:grid;grid-template-columns:max-content 1fr;gap:.2em .8em;margin:.4em 0}
dl.headline dt{font-weight:600;color:var(--muted)} dl.headline dd{margin:0;overflow-wrap:anywhere}
code{font:13px ui-monospace,SFMono-Regular,Menlo,monospace;background:var(--band);padding:0 .2em;border-radius:3px}
.scroll{overflow-x:auto;-webkit-overflow-scrolling:touch;max-width:100%}
table{border-collapse:collapse;font-size:13px;width:100%}
th,td{border-bottom:1px solid var(--line);padding:.25em .5em;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left;white-space:normal;overflow-wrap:anywhere;min-width:12em}
th{background:var(--band);position:sticky;top:0;cursor:pointer;user-select:none}
th[aria-sort=ascending]::after{content:" ▲"} th[aria-sort=descending]::after{content:" ▼"}
tr.diff td{color:var(--bad)} tr.origin td{font-weight:600;background:#fff4f2} tr.skip td{color:var(--muted)}
table.kv td,table.kv th{text-align:left;white-space:normal}
.controls{display:flex;flex-wrap:wrap;gap:.6em;align-items:center;margin:.4em 0}
.controls input[type=search]{flex:1 1 14em;padding:.3em;font-size:14px}
figure{margin:.6em 0;border:1px solid var(--line);border-radius:6px;padding:.4em}
figure svg{width:100%;height:auto;display:block}
figcaption{font-size:13px;color:var(--muted)}
.note{color:var(--muted);font-size:13px}
@media (max-width:600px){body{font-size:14px;padding:6px} dl.headline{grid-template-columns:1fr} dl.headline dt{margin-top:.3em}}
@media print{.controls{display:none} th{position:static} figure{break-inside:avoid} .scroll{overflow:visible}
 body{max-width:none} a{color:inherit;text-decoration:none}}
"""

# sorting (click a header) and filtering (text + "differing only") of every table.sortable
JS = """
(function(){
function key(td){var v=td.getAttribute('data-v');if(v!==null&&v!==''&&!isNaN(+v))return +v;return td.textContent.trim().toLowerCase();}
document.querySelectorAll('table.sortable').forEach(function(t){
 var ths=t.tHead.rows[0].cells;
 Array.prototype.forEach.call(ths,function(th,i){th.addEventListener('click',function(){
  var asc=th.getAttribute('aria-sort')!=='ascending';
  Array.prototype.forEach.call(ths,function(h){h.removeAttribute('aria-sort');});
  th.setAttribute('aria-sort',asc?'ascending':'descending');
  var body=t.tBodies[0],rows=Array.prototype.slice.call(body.rows);
  rows.sort(function(a,b){var x=key(a.cells[i]),y=key(b.cells[i]);
   if(typeof x!==typeof y){x=String(x);y=String(y);} var r=x<y?-1:x>y?1:(+a.dataset.i)-(+b.dataset.i);return asc?r:-r;});
  rows.forEach(function(r){body.appendChild(r);});});});
});
document.querySelectorAll('.controls[data-for]').forEach(function(c){
 var t=document.getElementById(c.getAttribute('data-for'));var q=c.querySelector('input[type=search]');
 var d=c.querySelector('input[type=checkbox]');
 function apply(){var s=(q.value||'').toLowerCase();Array.prototype.forEach.call(t.tBodies[0].rows,function(r){
  var show=r.textContent.toLowerCase().indexOf(s)>=0&&(!d||!d.checked||r.classList.contains('diff'));
  r.style.display=show?'':'none';});}
 q.addEventListener('input',apply);if(d)d.addEventListener('change',apply);});
})();
"""


def esc(x: Any) -> str:
    """HTML-escape ``str(x)``."""
    return html.escape("" if x is None else str(x), quote=True)


def figure_svg(fig: Figure) -> str:
    """A matplotlib Figure as an inline ``<svg>`` element (text kept as text, no external references,
    sized by CSS: the width/height attributes are dropped, the viewBox kept)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "tracer"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)  # RDF namespaces: nothing to fetch, but noise
    head, rest = text.split(">", 1)
    head = re.sub(r'\s(width|height)="[^"]*"', "", head)
    return head.replace("<svg", '<svg role="img"', 1) + ">" + rest


def figure_html(svg: str, caption: str, fig_id: str) -> str:
    """One ``<figure>`` with an inline SVG and its caption."""
    return f'<figure id="{esc(fig_id)}" class="plot">{svg}<figcaption>{esc(caption)}</figcaption></figure>'


def headline_html(pairs: Sequence[tuple[str, str]]) -> str:
    """The headline block (``(label, text)`` pairs) as a definition list; backticks become ``<code>``."""
    def inline(text: str) -> str:
        parts = esc(text).split("`")
        return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))

    return '<dl class="headline">' + "".join(f"<dt>{esc(k)}</dt><dd>{inline(v)}</dd>" for k, v in pairs) + "</dl>"


def table_html(table_id: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
               classes: Iterable[str] | None = None, values: Iterable[Sequence[Any]] | None = None,
               filterable: bool = True, diff_toggle: bool = False) -> str:
    """A sortable (click a header) and filterable (search box; ``diff_toggle``: "differing rows
    only", rows of class ``diff``) table. ``values``: per cell, the number it sorts by (None: its text)."""
    rows = list(rows)
    classes = list(classes) if classes is not None else [""] * len(rows)
    values = list(values) if values is not None else [[None] * len(columns)] * len(rows)
    out = []
    if filterable:
        out.append(f'<div class="controls" data-for="{esc(table_id)}"><input type="search" placeholder="filter rows" '
                   f'aria-label="filter rows">' + ('<label><input type="checkbox"> differing rows only</label>'
                                                   if diff_toggle else "") + "</div>")
    out.append(f'<div class="scroll"><table id="{esc(table_id)}" class="sortable"><thead><tr>'
               + "".join(f"<th>{esc(c)}</th>" for c in columns) + "</tr></thead><tbody>")
    for i, (cells, cls, vals) in enumerate(zip(rows, classes, values)):
        tds = "".join(f'<td data-v="{esc(v)}">{esc(x)}</td>' if v is not None and _finite(v) else f"<td>{esc(x)}</td>"
                      for x, v in zip(cells, vals))
        out.append(f'<tr data-i="{i}" class="{esc(cls)}">{tds}</tr>')
    out.append("</tbody></table></div>")
    return "".join(out)


def _finite(v: Any) -> bool:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return False
    return f == f and f not in (float("inf"), float("-inf"))


def kv_table(items: Iterable[tuple[str, Any]]) -> str:
    """A two-column key/value table (the numeric contract)."""
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v if isinstance(v, str) else json.dumps(v, default=str))}</td></tr>"
                   for k, v in items)
    return f'<div class="scroll"><table class="kv">{rows}</table></div>'


def page(title: str, verdict: str, ok: bool, sections: Sequence[tuple[str, str]]) -> str:
    """The whole document: ``<h1>`` title, the verdict banner, then ``(heading, html)`` sections."""
    body = "".join(f"<section><h2>{esc(h)}</h2>{content}</section>" if h else f"<section>{content}</section>"
                   for h, content in sections)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>{esc(title)}</h1><p id=\"verdict\" class=\"verdict {'ok' if ok else 'bad'}\">{esc(verdict)}</p>"
            f"</header>{body}<footer class=\"note\">made by tracer · self-contained: no network, no external files</footer>"
            f"<script>{JS}</script></body></html>\n")


#: trace header keys shown first in the contract (then every other key)
CONTRACT_KEYS = ("tracer_version", "python", "torch", "transformers", "numpy", "h5py", "cuda", "cudnn", "cublas",
                 "driver", "device", "device_name", "cpu", "platform", "hostname", "matmul_allow_tf32",
                 "cudnn_allow_tf32", "deterministic_algorithms", "created")


def contract_html(header: dict[str, Any] | None, facts: dict[str, Any]) -> str:
    """The numeric contract: the trace header (versions, device, TF32/determinism flags, ...) or,
    without a trace, the comparison's facts."""
    if not header:
        return kv_table((k, v) for k, v in facts.items() if v is not None and k != "notes") + \
            '<p class="note">no trace header (run without a stored trace): facts of the comparison only</p>'
    first = [(k, header[k]) for k in CONTRACT_KEYS if k in header]
    rest = [(k, v) for k, v in header.items() if k not in CONTRACT_KEYS]
    return kv_table(first + rest)


def _origins_html(c: Comparison) -> str:
    if not c.origins and not c.logits_origin:
        return '<p class="note">no origin: every capture point is bit-identical</p>'
    parts = []
    for p in c.origins:
        rec = origin_record(p, c)
        parts.append(f"<p><code>{esc(rec['text'])}</code></p>")
        shapes = [(f"{c.run_a}: {k}", v) for k, v in rec["shapes_a"].items()] + \
                 [(f"{c.run_b}: {k}", v) for k, v in rec["shapes_b"].items()]
        kernels = [(f"{run}: kernels", ", ".join(sorted({k for cl in calls for k in cl.get("kernels", ()) or ()})))
                   for run, calls in ((c.run_a, p.calls_a), (c.run_b, p.calls_b))]
        parts.append(kv_table(shapes + [kv for kv in kernels if kv[1]]))
    if c.logits_origin:
        parts.append(f"<p><code>{esc(origin_lines(c)[-1])}</code></p>")
    return "".join(parts)


def comparison_figures(c: Comparison) -> list[tuple[str, str, str]]:
    """``(id, caption, svg)`` of the figures drawn from ``c`` (amplification, the position heat map
    when ``c`` carries per-position data, ULP histogram); empty,
    with no error, when matplotlib is not installed (the page then says so)."""
    try:
        figs = [("fig-amplification", "max |A − B| per capture point in execution order (KV caches below); "
                 "hollow green circles: bit-identical", figure_svg(amplification_figure(c)))]
        carried = position_diffs_comparison(c)
        if carried is not None and carried.names:
            before = (f"; hatched rows ({', '.join(carried.before)}) are white because their differences lie before "
                      f"the compared positions (positions 0..{carried.positions[0] - 1}, the cached prefix)"
                      if carried.before else "")
            figs.append(("fig-heatmap", "max |A − B| per capture point (rows) and compared position (columns); "
                         f"white: bit-identical{before}", figure_svg(heatmap_figure(carried))))
        figs.append(("fig-ulp", "ULP distance histogram of the first divergent point, the middle and last layer, "
                     "the logits", figure_svg(ulp_figure(c))))
        return figs
    except TracerError:
        return []


def _rl_html(rl: RLComparison) -> str:
    """The RL section: summary, |Δlogp| histogram, the traced sequence's tokens, the mitigations."""
    parts = [kv_table(rl_report.summary_pairs(rl)), f'<p class="note">{esc(rl_report.hist_line(rl))}</p>',
             table_html("rl-steps", *rl_report.step_rows(rl))]
    if rl.mitigations:
        parts.append(table_html("rl-mitigations", *rl_report.mitigation_rows(rl)))
        parts += [f'<p class="note">{esc(x)}</p>' for x in rl_report.mitigation_notes(rl)]
    return "".join(parts)


def comparison_html(c: Comparison, header: dict[str, Any] | None = None, *, figures: bool = True) -> str:
    """The HTML report of one comparison (see the module docstring).

    Args:
        c: a :class:`~tracer.diff.result.Comparison`.
        header: the trace header (numeric contract), when there is a trace.
        figures: embed the figures (needs matplotlib; without it the page says so).
    """
    all_rows = rows(c)
    cols = [k for k in WIDE_COLUMNS if k != "hist"] + ["hist"]
    raw = {"diff": "n_diff", "fraction": "fraction", "max_abs": "max_abs_diff", "mean_abs": "mean_abs_diff",
           "ulp": "max_ulp_mag", "ulp_line": "max_ulp", "rel": "rel_error", "cos": "cosine", "sqnr": "sqnr_db",
           "rel1": "frac_rel_lt_1e3", "rel5": "frac_rel_lt_5e3", "growth": "growth", "ampl": "amplification",
           "tol": "n_outside_tol", "flips": "argmax_flips"}
    cells = [[r["name"] + point_mark(c, r["name"].split(" ")[0]) + (" ◀ origin" if r["origin"] else "")
              if k == "point" else COLUMNS[k][1](r) for k in cols]
             for r in all_rows]
    vals = [[None if k == "point" else r.get(raw.get(k, ""), None) for k in cols] for r in all_rows]
    classes = [("diff" if r["n_diff"] else "") + (" origin" if r["origin"] else "") for r in all_rows]
    sections = [("summary", headline_html(headline(c, "report"))),
                ("origin", _origins_html(c))]
    if c.rl is not None:  # rollout-vs-train: the RL metrics first
        sections.insert(0, ("RL metrics: rollout vs trainer", _rl_html(c.rl)))
    if figures:
        figs = comparison_figures(c)
        sections.append(("figures", "".join(figure_html(svg, cap, fid) for fid, cap, svg in figs)
                         or '<p class="note">figures need matplotlib: pip install \'tracer[plot]\'</p>'))
    more = logits_lines(c) + flips_lines(c) + replay_lines(c) + (c.noise.lines() if c.noise is not None else []) \
        + list(c.facts.get("notes", []))
    sections.append((f"every capture point ({len(all_rows)})",
                     table_html("points", [COLUMNS[k][0] for k in cols], cells, classes=classes, values=vals,
                                diff_toggle=True)
                     + "".join(f'<p class="note">{esc(x)}</p>' for x in more)))
    plans = [f"{_side('A', c.run_a)}: {plan_line(c, 'a')}", f"{_side('B', c.run_b)}: {plan_line(c, 'b')}"]
    sections.append(("numeric contract", "".join(f"<p>{esc(p)}</p>" for p in plans) + contract_html(header, c.facts)
                     + (f'<p class="note">trace: {esc(c.trace)}</p>' if c.trace else "")))
    bare = unverified_text(c)
    return page(_title(c), f"verdict: {verdict_line(c)}" + (f" · unverified: {bare}" if bare else ""), c.identical,
                sections)


def _side(letter: str, run: str) -> str:
    """``A`` for a run named ``A``; ``A (L2-prefix-cache.A)`` when the run has a name of its own."""
    return letter if run == letter else f"{letter} ({run})"


def write_report(text: str, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write an HTML page to ``path`` via a temporary sibling, then rename.

    Raises:
        TracerError: ``path`` is a directory, does not end in .html/.htm, or exists without ``overwrite``.
    """
    p = check_report_path(path, overwrite)
    tmp = p.with_name(f".{p.name}.partial-{os.getpid()}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)
    except OSError as e:  # a full disk, ulimit -f, a folder that turned read-only: one line
        raise TracerError(write_error_message(p, e).replace("--output", "--report")) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return p

