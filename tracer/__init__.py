"""tracer: layer-by-layer numeric divergence tracer for transformer inference.

Importing tracer has no side effects and loads neither torch nor transformers; the public
functions import what they need when called.

    >>> import tracer
    >>> result = tracer.run("smollm2-135m")          # cache miss vs cache hit, layer by layer
    >>> result.comparison.first_divergent
    >>> reader = tracer.read_trace(result.trace)      # any stored tensor, bit-exact
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["run", "read_trace", "compare_trace", "load_model", "sweep", "read_sweep", "TracerError", "__version__"]

from .errors import TracerError


def run(*args: Any, **kwargs: Any):
    """Run a scenario and compare its two runs; see :func:`tracer.api.run`."""
    from .api import run as _run

    return _run(*args, **kwargs)


def read_trace(path: str):
    """Open a stored trace; see :class:`tracer.store.TraceReader`."""
    from .store import TraceReader

    return TraceReader(path)


def compare_trace(path: str, run_a: str | None = None, run_b: str | None = None, **kwargs: Any):
    """Compare two runs of a stored trace; see :func:`tracer.compare.compare_trace` (keywords
    ``atol``, ``rtol``, ``device`` are passed through)."""
    from .compare import compare_trace as _ct

    return _ct(path, run_a, run_b, **kwargs)


def load_model(*args: Any, **kwargs: Any):
    """Load a model by name; see :func:`tracer.models.load_model`."""
    from .models import load_model as _lm

    return _lm(*args, **kwargs)


def sweep(*args: Any, **kwargs: Any):
    """Run a scenario over many prompt lengths (x block sizes); see :func:`tracer.sweep.sweep`."""
    from .sweep import sweep as _sweep

    return _sweep(*args, **kwargs)


def read_sweep(path: str):
    """Read a sweep file; see :func:`tracer.sweep.read_sweep`."""
    from .sweep import read_sweep as _rs

    return _rs(path)
