"""The ULP-distance histogram of a few capture points."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tracer.diff.metrics import ULP_BINS
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.report.figures.common import literal_text, _figure, _title, short_name


def select_points(comparison: Any, layers: Sequence[str | int] | None = None) -> list[tuple[str, Any]]:
    """``(name, TensorDiff)`` of the chosen capture points (names, suffixes or indices; logits allowed).

    Default: the first divergent point, the middle and the last ``layer`` point, and the logits.

    Raises:
        TracerError: a name or index that is not a capture point of the comparison.
    """
    table = [(p.name, p.diff, p.kind) for p in comparison.points]
    if comparison.logits is not None:
        table.append((comparison.logits_name or "logits", comparison.logits.tensor, "logits"))
    if layers:
        chosen = []
        for key in layers:
            key = str(key).strip()
            if key.lstrip("-").isdigit():
                i = int(key)
                if not -len(table) <= i < len(table):
                    raise TracerError(f"--layers index {i} is outside 0..{len(table) - 1}; pass indices or capture names")
                chosen.append(table[i][:2])
                continue
            hits = [row for row in table if row[0] == key] or [row for row in table if short_name(row[0]) == key]
            if not hits and key == "logits" and comparison.logits is not None:
                hits = [table[-1]]
            if not hits:
                raise TracerError(f"--layers {key!r} is not a capture point; e.g. {short_name(table[1][0]) if len(table) > 1 else table[0][0]} or an index")
            chosen.append(hits[0][:2])
        return chosen
    picks: list[int] = []
    first = next((i for i, row in enumerate(table) if row[1].n_diff), None)
    layer_idx = [i for i, row in enumerate(table) if row[2] == PointKind.LAYER]
    after = [i for i in layer_idx if first is None or i >= first] or layer_idx  # middle of the divergent stretch
    for i in (first, after[len(after) // 2] if after else None, layer_idx[-1] if layer_idx else None,
              len(table) - 1 if comparison.logits is not None else None):
        if i is not None and i not in picks:
            picks.append(i)
    return [table[i][:2] for i in sorted(picks)]


@literal_text
def ulp_figure(comparison: Any, layers: Sequence[str | int] | None = None, *, title: str | None = None,
               figsize: tuple[float, float] | None = None):
    """Grouped bars: elements per ULP-distance bin (0, 1, 2, 3-4, 5-8, 9-16, >16), one group per point.

    Counts on a log scale; each point's bar container holds 7 bars whose heights are its
    ``TensorDiff.ulp_hist`` (label = capture name). The legend sits below the axes, never over a bar.

    Raises:
        TracerError: unknown ``layers`` entries (see :func:`select_points`).
    """
    chosen = select_points(comparison, layers)
    fig, ax = _figure(figsize=figsize or (8.0, 4.2 + 0.2 * len(chosen)), layout="constrained")
    x = np.arange(len(ULP_BINS))
    width = 0.8 / max(1, len(chosen))
    for k, (name, d) in enumerate(chosen):
        ax.bar(x + (k - (len(chosen) - 1) / 2) * width, np.asarray(d.ulp_hist, dtype=np.float64), width,
               label=f"{short_name(name)} ({d.n_diff:,} of {d.n_total:,} differ)")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(ULP_BINS)
    ax.set_xlabel("ULP distance between A and B (storage dtype)")
    ax.set_ylabel("elements (log)")
    # below the axes, never over the bars (a log axis has no empty corner to put it in)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=1 if len(chosen) > 2 else len(chosen),
               fontsize=8, frameon=False)
    ax.set_title(title or f"ULP distance histogram · {_title(comparison)}", fontsize=9)
    fig.tracer_data = {"names": [n for n, _ in chosen], "hist": [list(d.ulp_hist) for _, d in chosen]}
    return fig
