"""``tracer report FILE -o report.html``: the HTML report of a stored trace, audit trace or sweep file.

Sits beside :mod:`tracer.loops.audit` and :mod:`tracer.loops.sweep` (it dispatches to their pages). A trace's
report is drawn from the comparison stored in it (:mod:`tracer.diff.stored`: no tensor is read, no
metric recomputed); only a trace without a stored comparison (written before comparisons were
stored) is compared from its tensors.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from tracer.diff.compare import compare_runs
from tracer.diff.stored import comparison_from_dict
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.files import check_input_file
from tracer.report.html import (check_report_path, comparison_html, contract_html, esc, figure_html, figure_svg,
                                headline_html, page, table_html, write_report)
from tracer.report.summary import headline, unverified_text
from tracer.report.sweep_lines import sweep_summary_lines
from tracer.store.sweepfile import is_sweep_file, read_sweep
from tracer.store.trace import TraceReader


def _stored_matrix(stored: dict[str, dict[str, Any]], header: dict[str, Any], unverified: tuple[str, ...] = ()) -> str:
    """An audit trace: one row per stored comparison (the hierarchy matrix), from the stored documents;
    ``unverified``: the trace, when it carries no checksums (said beside the verdict)."""
    comps = {name: replace(comparison_from_dict(doc), unverified=unverified) for name, doc in stored.items()}
    cols = ["check", "scenario", "holds bitwise?", "first divergent", "last layer differing", "max |logit diff|",
            "argmax flips"]
    cells, vals, classes = [], [], []
    for name, c in comps.items():
        layers = [p for p in c.points if p.kind == PointKind.LAYER]
        last = layers[-1].diff if layers else None
        lg = c.logits
        cells.append([name, c.scenario, "yes" if c.identical else "no", c.first_divergent or "-",
                      f"{last.n_diff:,} / {last.n_total:,}" if last else "-",
                      f"{lg.tensor.max_abs_diff:.3g}" if lg else "-", len(lg.argmax_flips) if lg else "-"])
        vals.append([None, None, None, None, last.n_diff if last else None, lg.tensor.max_abs_diff if lg else None,
                     len(lg.argmax_flips) if lg else None])
        classes.append("" if c.identical else "diff")
    n_div = sum(not c.identical for c in comps.values())
    verdict = f"{len(comps)} stored comparisons: {len(comps) - n_div} bit-identical, {n_div} diverge"
    if unverified:
        verdict += f" · unverified: {unverified_text(next(iter(comps.values())))}"
    sections = [("matrix", table_html("audit", cols, cells, values=vals, classes=classes, diff_toggle=True))]
    for name, c in comps.items():
        if not c.identical:
            sections.append((f"{name}", headline_html(headline(c, "report"))))
    sections.append(("numeric contract", contract_html(header, {})))
    model = header.get("model", {})
    title = f"tracer report · {model.get('name', '?') if isinstance(model, dict) else model}"
    return page(title, verdict, n_div == 0, sections)


def report_html(path: str | os.PathLike, *, device: str | None = None) -> str:
    """The HTML page for ``path``: a sweep file's map, an audit trace's matrix, or a trace's report.

    Raises:
        TracerError: missing or unreadable file, or a trace with neither a stored comparison nor tensors.
    """
    src = Path(path)
    if not src.is_file():
        raise TracerError(f"file {src} not found; pass a trace (tracer run/audit) or a sweep file (tracer sweep)")
    if is_sweep_file(src):
        return sweep_html(read_sweep(src))
    with TraceReader(src) as r:
        header = r.header
        stored = r.comparisons()
        bare = () if r.checksummed else (str(src),)
    if len(stored) > 1:
        return _stored_matrix(stored, header, bare)
    if stored:
        return comparison_html(replace(comparison_from_dict(next(iter(stored.values()))), unverified=bare), header)

    return comparison_html(replace(compare_runs((str(src), None), (str(src), None), device=device), unverified=bare),
                           header)


def write_report_file(path: str | os.PathLike, output: str | os.PathLike | None = None, *,
                      overwrite: bool = False, device: str | None = None) -> Path:
    """``tracer report``: write :func:`report_html` of ``path`` to ``output`` (default: beside it,
    ``<stem>.html``).

    Raises:
        TracerError: see :func:`report_html` and :func:`tracer.report.html.write_report`.
    """
    path = check_input_file(path, "input file")  # '' or a FIFO: one line, before anything else
    out = Path(output) if output is not None else path.with_suffix(".html")
    check_report_path(out, overwrite)
    return write_report(report_html(path, device=device), out, overwrite=overwrite)


def sweep_html(result: Any) -> str:
    """A sweep as a single-file HTML page: the summary lines, the divergence map (inline SVG, when
    matplotlib is installed) and one sortable, filterable row per point (see :mod:`tracer.report.html`)."""

    p = result.params
    title = f"{p.get('scenario')} sweep · {p.get('model')} · {p.get('dtype')} · {p.get('device')}"
    n_div = sum(r.diverged for r in result.rows)
    verdict = f"{n_div} of {len(result.rows)} points diverge" + ("" if result.complete else " (sweep unfinished)")
    sections = [("summary", headline_html([("sweep", line.strip()) for line in sweep_summary_lines(result)]))]
    try:
        from tracer.report.plot import sweep_figure

        sections.append(("divergence map", figure_html(figure_svg(sweep_figure(result)),
                                                      "top: max |logit diff| per prompt length (hollow green: "
                                                      "bit-identical); bottom: max |A − B| per capture point and length",
                                                      "fig-sweep")))
    except (ImportError, TracerError) as e:
        sections.append(("divergence map", f'<p class="note">no figure: {esc(e)}</p>'))
    cols = ["length", "block size", "split at", "first divergent", "last-layer differing fraction",
            "max |logit diff|", "argmax flips"]
    rows = result.rows_at()
    cells = [[r.length, r.block_size, r.split_at, result.point_name(r.first_divergent) or "-",
              f"{r.last_layer_fraction:.3g}", f"{r.logits_max_abs_diff:.3g}", r.argmax_flips] for r in rows]
    vals = [[r.length, r.block_size, r.split_at, r.first_divergent, r.last_layer_fraction, r.logits_max_abs_diff,
             r.argmax_flips] for r in rows]
    sections.append((f"every point ({len(rows)})", table_html("points", cols, cells, values=vals,
                                                               classes=["diff" if r.diverged else "" for r in rows],
                                                               diff_toggle=True)))
    return page(title, verdict, n_div == 0, sections)
