"""The HDF5 trace: bit-exact tensors, environment header, runs, comparisons, atomic completion.

The store's public surface (what scripts, notebooks and the other stages import). The on-disk
layout is specified in ``traces/README.md`` (format ``tracer-trace``, version
:data:`FORMAT_VERSION`). In short::

    /                         attrs: format, format_version, complete, created, tool_version
    /header                   attrs: json (+ flat scalar copies)
    /runs                     attrs: order
    /runs/<run>               attrs: plan, meta, window, index (one entry per capture point); dataset token_ids
    /runs/<run>/data/<dtype>  every capture point of that dtype, end to end (:mod:`tracer.store.packed`)
    /comparisons/<name>       attrs: json

bf16 and fp16 tensors are stored as their raw 16-bit patterns (uint16); fp32/fp64 natively.
Version 1 (still read; written with ``TraceWriter(..., format_version=1)``) kept one dataset per
capture point under ``/runs/<run>/captures/`` (:mod:`tracer.store.format_v1`). Either way the
round trip is bit-exact and costs no per-element Python. The JSON documents (header, plan, meta,
index entries, comparisons) are records (:mod:`tracer.store.header`); version 3 changed three of
their facts, and versions 1 and 2 are read as version 3 writes them.

Where things live: :mod:`tracer.store.environment` (the environment header),
:mod:`tracer.store.header` (the trace's facts as records, and the reader of versions 1 and 2),
:mod:`tracer.store.formats` (the format versions, registered per version),
:mod:`tracer.store.format_v1` and :mod:`tracer.store.packed` (the two layouts),
:mod:`tracer.store.writer` (:class:`TraceWriter`), :mod:`tracer.store.reader` (:class:`TraceReader`),
:mod:`tracer.store.validate` (the spec's validation), :mod:`tracer.store.integrity` (checksums,
partial files). This module re-exports their public names and holds the output-path helpers.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from pathlib import Path
from typing import Any

from tracer.errors import TracerError
from tracer.store.environment import VERSION_KEYS, collect_environment, version_differences
from tracer.store.format_v1 import numpy_to_tensor, tensor_to_numpy, write_capture, write_run, write_tensor
from tracer.store.formats import COMPRESSIONS, FORMAT, FORMAT_VERSION
from tracer.store.integrity import check_name_length, check_output, check_output_path  # noqa: F401
from tracer.store.packed import StoredPoint, write_run_packed
from tracer.store.reader import READ_VERSIONS, TraceReader, read_row_blocks, read_tensor, stored_crc
from tracer.store.writer import TraceWriter


def json_safe(x: Any) -> Any:
    """Replace non-finite floats by strings so the document is strict JSON."""
    kind = type(x)  # the exact types first: a comparison's document holds thousands of numbers
    if kind is str or kind is int or kind is bool or x is None:
        return x
    if kind is list or kind is tuple:
        return [json_safe(v) for v in x]
    if kind is dict:
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def default_output(model: str, scenario: str, root: str | Path = "traces") -> Path:
    """``traces/<model>-<scenario>-<UTC timestamp>.h5`` (a free name; never an existing file)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{safe}-{scenario}-{stamp}"
    path, k = base.with_suffix(".h5"), 1
    while path.exists():
        path, k = Path(f"{base}-{k}.h5"), k + 1
    return path


def describe(path: str | Path) -> dict[str, Any]:
    """What ``tracer show`` prints, as data: ``{"header", "runs", "comparisons", "checksummed"}``;
    each run ``{"name", "n_tokens", "window", "plan", "captures", "meta"}`` (no tensor is read).

    Raises:
        TracerError: missing, incomplete or corrupt file.
    """
    with TraceReader(path) as r:
        runs = []
        for name in r.runs:
            rec = r.run(name, load_tensors=False)
            runs.append({"name": name, "n_tokens": len(rec.token_ids), "window": list(rec.window),
                         "plan": rec.plan, "captures": len(r.capture_names(name)), "meta": rec.meta})
        return {"header": r.header, "runs": runs, "comparisons": r.comparisons(), "checksummed": r.checksummed}


__all__ = [
    "FORMAT", "FORMAT_VERSION", "READ_VERSIONS", "COMPRESSIONS", "collect_environment", "VERSION_KEYS",
    "version_differences", "TraceWriter", "TraceReader", "write_tensor", "read_tensor", "read_row_blocks", "stored_crc",
    "write_capture", "write_run", "write_run_packed", "tensor_to_numpy", "numpy_to_tensor", "StoredPoint",
    "json_safe", "default_output", "check_output", "describe",
]
