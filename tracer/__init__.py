"""tracer: layer-by-layer numeric divergence tracer for transformer inference.

Importing tracer has no side effects and loads neither torch nor transformers; the public
functions import what they need when called. The notebook API (:mod:`tracer.api`)::

    >>> import tracer
    >>> result = tracer.run("smollm2-135m")          # cache miss vs cache hit, layer by layer
    >>> result.comparison.first_divergent
    >>> lm = tracer.load_model("smollm2-135m")
    >>> with tracer.capture(lm) as cap:               # every forward inside is captured
    ...     lm.model(ids)
    >>> tracer.compare(cap_a, cap_b)                  # or two runs, or "file.h5:RUN" references
    >>> reader = tracer.read_trace(result.trace)      # any stored tensor, bit-exact
    >>> tracer.audit(lm); tracer.sweep(lm, lengths="17:64"); tracer.plot(result); tracer.render(result, "markdown")

The result types are exported too (``tracer.RunResult``, ``tracer.Comparison``, ``tracer.PointResult``,
``tracer.Audit``, ``tracer.SweepResult``, ``tracer.RunRecord``, ``tracer.PointKind``, ...: :data:`RECORD_TYPES`),
each imported on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

from tracer.api import (audit, bench, capture, compare, compare_trace, import_dump, load_model, models, options, plot,
                        plot_file, read_sweep, read_trace, render, report_file, run, sweep, to_pandas, trace_info,
                        write_megatron_dump, write_sglang_dump)
from tracer.errors import TracerError

#: the core record types, by the module that defines each: ``tracer.Comparison`` etc. import it on
#: first use (``import tracer`` itself stays light)
RECORD_TYPES: dict[str, str] = {
    "RunResult": "tracer.api",
    "Comparison": "tracer.diff.result", "PointResult": "tracer.diff.result", "SkipRecord": "tracer.diff.result",
    "TensorDiff": "tracer.diff.metrics", "LogitsDiff": "tracer.diff.metrics", "ArgmaxFlip": "tracer.diff.metrics",
    "NoiseVerdict": "tracer.diff.verdict", "Replay": "tracer.diff.replay", "OpReplay": "tracer.diff.accuracy",
    "RLComparison": "tracer.diff.rl",
    "Audit": "tracer.loops.audit", "AuditRow": "tracer.loops.audit", "BenchResult": "tracer.loops.bench",
    "SweepResult": "tracer.store.sweepfile", "SweepRow": "tracer.store.sweepfile",
    "RunRecord": "tracer.execute.records", "CaptureRecord": "tracer.execute.records", "PointKind": "tracer.execute.kinds",
    "LoadedModel": "tracer.load.models", "ModelInfo": "tracer.load.models",
    "Scenario": "tracer.plan.plans", "RunPlan": "tracer.plan.plans",
    "TraceReader": "tracer.store.reader",
}


def __getattr__(name: str) -> type:
    """``tracer.Comparison`` and the other :data:`RECORD_TYPES`, imported when first asked for."""
    module = RECORD_TYPES.get(name)
    if module is None:
        raise AttributeError(f"module 'tracer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(RECORD_TYPES))


__all__ = ["run", "load_model", "capture", "compare", "compare_trace", "read_trace", "audit", "sweep", "read_sweep",
           "plot", "plot_file", "report_file", "trace_info", "models", "options", "bench", "render", "to_pandas", "import_dump",
           "write_sglang_dump", "write_megatron_dump", "TracerError", "__version__", *RECORD_TYPES]
