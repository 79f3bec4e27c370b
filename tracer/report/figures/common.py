"""What every figure shares: matplotlib loaded lazily (Agg outside Jupyter), detached figures, axis
labels named after the capture points (thinned when there are too many), the log colour norm."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence

import numpy as np

from tracer.errors import TracerError
from tracer.execute.kinds import PointKind

#: the label of the explicit zero markers (bit-identical points) in the line figures
LABEL_ZERO = "bit-identical (|diff| = 0)"


def _plt():
    """matplotlib.pyplot, with the Agg backend unless pyplot is already in use or we are in IPython.

    Raises:
        TracerError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise TracerError("matplotlib is not installed; pip install 'tracer[plot]' (or matplotlib) to draw figures") from None
    if "matplotlib.pyplot" not in sys.modules and "IPython" not in sys.modules and "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def literal_text(fn: Any) -> Any:
    """Build the figure with matplotlib's mathtext off (``text.parse_math``): every title, label and
    legend shows its string as given. A model folder named ``m$\\foo$`` or a capture name with ``$``
    would otherwise be parsed as TeX and fail the figure after the run."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _plt()
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": False}):
            return fn(*args, **kwargs)

    return wrapper


def _figure(nrows: int = 1, ncols: int = 1, **kw: Any):
    """A new figure and axes, detached from pyplot's registry (so Jupyter shows it once, when returned)."""
    plt = _plt()
    fig, axes = plt.subplots(nrows, ncols, **kw)
    plt.close(fig)
    return fig, axes


def compact_name(name: str, kind: str | None = None) -> str:
    """``model.layers.3.self_attn.kv_cache`` → ``L3 KV``, ``model.layers.3`` → ``L3``,
    ``model.layers.3.mlp.down_proj`` → ``L3 mlp.down_proj`` (dense axis labels); others as :func:`short_name`."""
    parts = short_name(name).split(".")
    # the first numbered component is the decoder layer's index (the layer list's child), whatever
    # the family calls the list (model.layers.3, transformer.h.3)
    at = next((i for i, p in enumerate(parts) if i and p.isdigit()), None)
    if at is not None:
        rest = ".".join(parts[at + 1:])
        if kind == PointKind.KV_CACHE or rest.endswith("kv_cache"):
            return f"L{parts[at]} KV"
        return f"L{parts[at]}" + (f" {rest}" if rest else "")
    return short_name(name)


def short_name(name: str) -> str:
    """``model.layers.3.mlp.down_proj`` → ``layers.3.mlp.down_proj`` (axis labels)."""
    return name[len("model."):] if name.startswith("model.") else name


#: point kinds that always get an axis label when labels are thinned (sublayers)
_LANDMARKS = ("embedding", "layer", "final_norm", "logits", "kv_cache")


def thin_labels(names: Sequence[str], kinds: Sequence[str] | None = None, max_labels: int = 40,
                keep: Iterable[int] = ()) -> list[int]:
    """Indices of the points that get an axis label: all when they fit, else the ``keep`` ones
    (origins), the landmarks (layer outputs, KV caches, embedding, final norm, logits) and, when
    those still do not fit, every k-th landmark; the last point is always labelled."""
    n = len(names)
    if n <= max_labels:
        return list(range(n))
    keep = set(keep)
    marks = [i for i in range(n) if kinds is not None and kinds[i] in _LANDMARKS] or list(range(n))
    room = max(1, max_labels - len(keep) - 1)
    step = max(1, -(-len(marks) // room))
    return sorted(keep | set(marks[::step]) | {n - 1})


def _tick_labels(ax: Any, names: Sequence[str], axis: str = "x", max_labels: int = 40,
                 kinds: Sequence[str] | None = None, keep: Iterable[int] = (), compact: bool = False) -> None:
    idx = thin_labels(names, kinds, max_labels, keep)
    pos = idx
    labels = [compact_name(names[i], kinds[i] if kinds else None) if compact else short_name(names[i]) for i in idx]
    if axis == "x":
        ax.set_xticks(pos)
        ax.set_xticklabels(labels, rotation=90, fontsize=7)
    else:
        ax.set_yticks(pos)
        ax.set_yticklabels(labels, fontsize=7)



def _title(comparison: Any) -> str:
    f = getattr(comparison, "facts", {}) or {}
    bits = [str(comparison.scenario), str(comparison.model)]
    for key in ("dtype", "device_name", "device"):
        if f.get(key):
            bits.append(str(f[key]))
            break
    from tracer.report.summary import positions_text

    bits.append(positions_text(comparison.positions, f.get("n_tokens")))
    return " · ".join(bits)



def _log_norm(values: np.ndarray):
    from matplotlib.colors import LogNorm

    pos = values[(values > 0) & np.isfinite(values)]
    if pos.size == 0:
        return None
    lo, hi = float(pos.min()), float(pos.max())
    return LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10)
