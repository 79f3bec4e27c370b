"""Rendering the RL metrics of ``rollout-vs-train`` (:class:`tracer.diff.rl.RLComparison`).

Pure functions of the result: the summary lines printed before everything else (mean and max
|Δlogp|, the KL estimators, the share a TIS cap or an MIS/IcePop mask would touch, PPL, flips),
the per-token table of the traced sequence, the ``--mitigations`` table (rich tables fitted to the
terminal's width like the amplification table), their markdown and HTML forms, the CSV columns and the per-token DataFrame rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from rich.table import Table

from tracer.diff.rl import HIST_LABELS

if TYPE_CHECKING:
    from rich.console import Console

    from tracer.diff.rl import RLComparison


def _g(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _pct(x: float) -> str:
    return "0%" if x == 0 else f"{100 * x:.3g}%"


def summary_pairs(rl: RLComparison) -> list[tuple[str, str]]:
    """The RL summary as ``(label, text)`` pairs, in print order. ``flips`` counts every sequence's response
    tokens (K × T); the verdict's flips are the traced sequence's (:func:`tracer.report.summary.flips_text`)."""
    how = getattr(rl, "tokens_from", None) or (f"sampled at τ={rl.tau:g}" if rl.sample else "greedy")
    lo = 1.0 / rl.mask_threshold
    out = [
        ("RL step", f"{rl.rollouts} sequence{'s' if rl.rollouts != 1 else ''} × {rl.new_tokens} response tokens, "
                    f"{how}; Δlogp = logp_train − logp_rollout"),
        ("|Δlogp|", f"mean {_g(rl.mean_abs_dlogp)} · max {_g(rl.max_abs_dlogp)} · p99 {_g(rl.p99_abs_dlogp)} · "
                    f"{rl.n_equal} of {rl.n_tokens} tokens bit-identical"),
        ("KL", f"k1 {_g(rl.k1_kl)} · k3 {_g(rl.k3_kl)} · full vocabulary mean {_g(rl.vocab_kl_mean)}, "
               f"max {_g(rl.vocab_kl_max)} nats"),
        ("clipped", f"TIS ratio > {rl.is_cap:g}: {_pct(rl.tis_clipped)} of tokens, {_pct(rl.seq_tis_clipped)} of "
                    "sequences"),
        ("masked", f"MIS/IcePop outside [{lo:.3g}, {rl.mask_threshold:g}]: {_pct(rl.mis_masked)} of tokens, "
                   f"{_pct(rl.seq_mis_masked)} of sequences"),
        ("ratios", f"token {_g(rl.token_ratio_min, 6)} .. {_g(rl.token_ratio_max, 6)} · sequence "
                   f"{_g(rl.seq_ratio_min, 6)} .. {_g(rl.seq_ratio_max, 6)}"),
        ("PPL", f"train {_g(rl.train_ppl, 6)} · rollout {_g(rl.rollout_ppl, 6)} · ratio {_g(rl.ppl_ratio, 6)}"),
        ("flips", "-" if rl.argmax_flips is None else
         f"{rl.argmax_flips} of {rl.n_tokens} response tokens (all {rl.rollouts} sequence{'s' if rl.rollouts != 1 else ''} "
         f"× {rl.new_tokens}) change argmax between the runs"),
    ]
    first = rl.first_divergent_step
    row_text = ("the traced sequence's logits are bit-identical at every response position" if first is None
                else f"the traced sequence (row {rl.row}) first differs at response token {first} (position "
                     f"{rl.steps[first].position})")
    out.append(("per token", row_text))
    return out


def summary_lines(rl: RLComparison) -> list[str]:
    """:func:`summary_pairs` as ``label: text`` lines, labels padded to one width (one line each: the
    terminal report fits them to its width itself)."""
    pairs = summary_pairs(rl)
    w = max(len(k) for k, _ in pairs)
    return [f"{k + ':':<{w + 1}} {v}" for k, v in pairs]


def hist_line(rl: RLComparison) -> str:
    """``|Δlogp| histogram (tokens): 0 12 · ≤1e-8 0 · ...`` (empty bins after the last filled one left out)."""
    last = max((i for i, n in enumerate(rl.hist) if n), default=0)
    cells = [f"{lab} {n}" for lab, n in zip(HIST_LABELS[:last + 1], rl.hist[:last + 1])]
    return "|Δlogp| histogram (tokens): " + " · ".join(cells)


def _name(name: str | None) -> str:
    """A capture point's name without ``model.`` (the terminal table shortens it further at a dot)."""
    if not name:
        return "-"
    return name[len("model."):] if name.startswith("model.") else name


#: the per-token table's columns: (heading, cell of a TokenStep)
STEP_COLUMNS = (
    ("tok", lambda s: str(s.step)),
    ("id", lambda s: str(s.token)),
    ("logp A", lambda s: f"{s.logp_a:.4g}"),
    ("Δlogp", lambda s: _g(s.dlogp)),
    ("KL", lambda s: _g(s.kl)),
    ("flip", lambda s: "-" if s.flip is None else ("yes" if s.flip else "")),
    ("first differing", lambda s: _name(s.first_point)),
    ("last |Δ|", lambda s: _g(s.last_layer_max_abs)),
)
#: the order the per-token table's columns give way in a narrow terminal (token, Δlogp, flip and the
#: first differing point stay)
STEP_DROP = ("KL", "logp A", "id", "last |Δ|")


def _bare_table(title: str, columns: Any, items: Any, left: tuple[str, ...], drop: tuple[str, ...],
                width: int | None) -> Table:
    """A table without a box (one space between columns) of ``columns`` over ``items``, fitted to ``width``
    (:func:`tracer.report.layout.fit_columns`: the columns of ``drop`` give way first, named in the
    caption; ``first differing`` shortened at a dot); the title wraps at words."""
    from rich.text import Text

    from tracer.report.layout import BARE, NAME_FLOOR, fit_columns, readable_width, shorten_left

    heads = [h for h, _ in columns]
    cells = {h: [cell(x) for x in items] for h, cell in columns}
    names = cells.get("first differing", [])
    name_min = max([12, *(min(readable_width(n), 34) for n in names)])
    fit = fit_columns(tuple(heads), {h: h for h in heads}, cells, width or 1 << 30, name_key="first differing",
                      name_min=name_min, keep=tuple(h for h in heads if h not in drop), drop_order=drop, gaps=BARE)
    wid = dict(zip(fit.columns, fit.widths))
    if "first differing" in wid:
        wid["first differing"] = max(wid["first differing"], min(NAME_FLOOR, name_min))
    t = Table(title=Text(title), title_justify="left", show_edge=False, pad_edge=False, box=None,
              header_style="bold", padding=(0, 1, 0, 0))
    for h in fit.columns:
        t.add_column(h, justify="left" if h in left else "right", no_wrap=True, width=wid[h])
    for i in range(len(items)):
        t.add_row(*(shorten_left(cells[h][i], wid[h]) if h == "first differing" else cells[h][i] for h in fit.columns))
    if fit.dropped:
        t.caption = Text(f"left out to fit {width} columns: {', '.join(fit.dropped)}")
        t.caption_justify = "left"
    return t


def steps_table(rl: RLComparison, width: int | None = None) -> Table:
    """The traced sequence's response tokens, one row each, fitted to ``width`` characters: token index
    and id, the rollout's logprob, Δlogp, full-vocabulary KL, argmax flip, the first capture point that
    differs at the token's position and the last decoder layer's max |Δ| there."""
    first = rl.steps[0].position if rl.steps else 0
    return _bare_table(f"the traced sequence (row {rl.row}), positions {first}..{first + len(rl.steps) - 1}: "
                       "the gap token by token", STEP_COLUMNS, list(rl.steps), ("first differing",), STEP_DROP, width)


MITIGATION_COLUMNS = (
    ("knob", lambda m: m.knob + ("" if m.ran else " *")),
    ("mean|Δlogp|", lambda m: _g(m.mean_abs_dlogp)),
    ("max|Δlogp|", lambda m: _g(m.max_abs_dlogp)),
    ("k3 KL", lambda m: _g(m.k3_kl)),
    ("identical", lambda m: "yes" if m.identical else "no"),
    ("first differing", lambda m: _name(m.first_divergent)),
)


def mitigations_table(rl: RLComparison, width: int | None = None) -> Table:
    """The ``--mitigations`` table: one row per knob (``*``: changes nothing here; the base run's numbers;
    ``identical``: both runs bit-identical at every compared point and logprob), fitted to ``width``."""
    return _bare_table("which knob closes the gap (--mitigations)", MITIGATION_COLUMNS, list(rl.mitigations),
                       ("knob", "first differing"), ("k3 KL", "max|Δlogp|"), width)


def mitigation_notes(rl: RLComparison) -> list[str]:
    """What each knob changes, one line each."""
    return [f"{m.knob}: {m.what}" for m in rl.mitigations]


def _md_row(cells: Any) -> str:
    """One markdown table row; a ``|`` inside a cell (``last |Δ|``) is escaped, so it is not a column border."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def markdown_lines(rl: RLComparison) -> list[str]:
    """The summary, the per-token table and the mitigations as markdown."""
    lines = ["**RL metrics (rollout vs trainer)**", "", *(f"- {k}: {v}" for k, v in summary_pairs(rl)),
             f"- {hist_line(rl)}", ""]
    lines += [_md_row(h for h, _ in STEP_COLUMNS), "|" + "---:|" * len(STEP_COLUMNS)]
    lines += [_md_row(cell(s) for _, cell in STEP_COLUMNS) for s in rl.steps]
    if rl.mitigations:
        lines += ["", _md_row(h for h, _ in MITIGATION_COLUMNS), "|" + "---:|" * len(MITIGATION_COLUMNS)]
        lines += [_md_row(cell(m) for _, cell in MITIGATION_COLUMNS) for m in rl.mitigations]
        lines += ["", *(f"- {x}" for x in mitigation_notes(rl))]
    return lines + [""]


def step_rows(rl: RLComparison) -> tuple[list[str], list[list[str]]]:
    """The per-token table as ``(headings, rows of cells)`` (the HTML report's table)."""
    return [h for h, _ in STEP_COLUMNS], [[cell(s) for _, cell in STEP_COLUMNS] for s in rl.steps]


def mitigation_rows(rl: RLComparison) -> tuple[list[str], list[list[str]]]:
    """The ``--mitigations`` table as ``(headings, rows of cells)``."""
    return [h for h, _ in MITIGATION_COLUMNS], [[cell(m) for _, cell in MITIGATION_COLUMNS] for m in rl.mitigations]


def summary_dict(rl: RLComparison) -> dict[str, Any]:
    """Every scalar field of the :class:`~tracer.diff.rl.RLComparison` (its summary: the per-token
    tuples and the knob rows left out), by name."""
    scalar = (int, float, bool, str, type(None))
    return {f.name: getattr(rl, f.name) for f in dataclasses.fields(rl) if isinstance(getattr(rl, f.name), scalar)}


def csv_meta(rl: RLComparison | None) -> dict[str, Any]:
    """``rl_<field>`` → value of :func:`summary_dict`, and per ``--mitigations`` knob
    ``rl_knob_<knob>_<field>`` for each number and flag of its :class:`~tracer.diff.rl.KnobResult`
    (the CSV columns); empty when ``rl`` is None."""
    if rl is None:
        return {}
    out = {f"rl_{k}": v for k, v in summary_dict(rl).items()}
    for m in rl.mitigations:  # every field of the knob's row but its name and texts: the numbers and flags
        out.update({f"rl_knob_{m.knob.replace('-', '_')}_{k}": v for k, v in m.to_dict().items()
                    if isinstance(v, (bool, int, float))})
    return out


#: the per-token picture's columns (:class:`~tracer.diff.rl.TokenStep`), set on the traced sequence's rows
PICTURE = ("position", "flip", "logits_differ", "logits_max_abs", "first_point", "last_layer_max_abs")


def token_records(rl: RLComparison) -> list[dict[str, Any]]:
    """One dict per response token of every sequence (K × T): ``sequence, step, token, logp_a, logp_b,
    dlogp, ratio, vocab_kl, traced`` and the per-token picture :data:`PICTURE` (position, argmax flip,
    differing logits, the first capture point that differs there, the last layer's max |Δ|), which
    the traced sequence's rows carry and the others leave None (the DataFrame of
    ``tracer.to_pandas(result.comparison.rl)``)."""
    out = []
    for j, (toks, la, lb, d) in enumerate(zip(rl.tokens, rl.logp_a, rl.logp_b, rl.dlogp)):
        for i, tok in enumerate(toks):
            step = rl.steps[i] if j == rl.row and i < len(rl.steps) else None
            out.append({"sequence": j, "step": i, "token": tok, "logp_a": la[i], "logp_b": lb[i], "dlogp": d[i],
                        "ratio": math.exp(d[i]) if d[i] < 709 else math.inf,
                        "vocab_kl": None if rl.vocab_kl is None else rl.vocab_kl[j][i], "traced": j == rl.row,
                        **{k: None if step is None else getattr(step, k) for k in PICTURE}})
    return out


__all__ = ["summary_pairs", "summary_lines", "hist_line", "steps_table", "mitigations_table", "markdown_lines",
           "step_rows", "mitigation_rows", "summary_dict", "csv_meta", "token_records", "PICTURE"]


def print_rl(rl: RLComparison, console: Console) -> None:
    """The RL per-token table, the |Δlogp| histogram and the ``--mitigations`` table, to ``console``
    (the terminal report of :func:`tracer.report.tables.print_report`), fitted to its width."""
    from tracer.report.console import fitted, print_fitted

    width = console.width if fitted(console) else None
    console.print()
    console.print(steps_table(rl, width))
    print_fitted(console, hist_line(rl), len("|Δlogp| histogram (tokens): "))
    if rl.mitigations:
        console.print()
        console.print(mitigations_table(rl, width))
        for line in mitigation_notes(rl):
            print_fitted(console, f"  {line}", 4)
