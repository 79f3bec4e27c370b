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
__all__ = ["run", "read_trace", "compare_trace", "import_dump", "write_sglang_dump", "load_model", "sweep",
           "read_sweep", "TracerError", "__version__"]

from .errors import TracerError


def run(*args: Any, **kwargs: Any):
    """Run a scenario and compare its two runs; see :func:`tracer.api.run`."""
    from .api import run as _run

    return _run(*args, **kwargs)


def read_trace(path: str):
    """Open a stored trace; see :class:`tracer.store.TraceReader`."""
    from .store import TraceReader

    return TraceReader(path)


def compare_trace(path: str, run_a: str | None = None, run_b: str | None = None, *,
                  engine_map: str | None = None, atol: float | None = None, rtol: float | None = None,
                  device: str | None = None):
    """Compare two runs of a stored trace (see :func:`tracer.compare.compare_trace`), or an HF
    reference run with an engine dump: ``compare_trace("REF.h5:A", DUMP)`` where DUMP is an SGLang
    dumper folder, a ``PassN.pt`` folder, a ``.safetensors``/``.npz`` file or a trace written by
    :func:`import_dump` (``engine_map``: a TOML map merged over the built-in one; see
    :func:`tracer.compare_dump.compare_dump`). Returns a :class:`tracer.compare.Comparison`.

    Raises:
        TracerError: a bad trace or dump (one line).
    """
    from .compare_dump import compare_dump, dump_side

    dump = dump_side([str(path), str(run_a)]) if run_a is not None and run_b is None else None
    if dump is not None:
        return compare_dump(dump[0], dump[1], engine_map=engine_map, atol=atol, rtol=rtol, device=device)
    if engine_map is not None:
        raise TracerError("engine_map applies to an engine dump: compare_trace('REF.h5:RUN', DUMP, engine_map=...)")
    from .compare import compare_trace as _ct

    return _ct(path, run_a, run_b, atol=atol, rtol=rtol, device=device)


def import_dump(dump: str, reference: str, output: str, *, engine_map: str | None = None,
                overwrite: bool = False, run_name: str = "engine"):
    """Map an engine dump onto reference run ``TRACE[:RUN]`` and write it as a one-run trace;
    see :func:`tracer.compare_dump.import_dump` (returns its :class:`~tracer.enginemap.MappedDump`)."""
    from .compare import split_ref
    from .compare_dump import import_dump as _imp

    return _imp(str(dump), split_ref(str(reference)), str(output), engine_map=engine_map, overwrite=overwrite,
                run_name=run_name)


def write_sglang_dump(trace: str, run: str, out: str, **kwargs: Any):
    """Write a stored HF run as a synthetic SGLang dumper folder; see :func:`tracer.sglang_dump.write_sglang_dump`."""
    from .sglang_dump import write_sglang_dump as _w

    return _w(trace, run, out, **kwargs)


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
