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
"""

from __future__ import annotations

__version__ = "0.1.0"

from tracer.api import (audit, bench, capture, compare, compare_trace, import_dump, load_model, models, plot, plot_file,
                        read_sweep, read_trace, render, report_file, run, sweep, to_pandas, trace_info,
                        write_megatron_dump, write_sglang_dump)
from tracer.errors import TracerError

__all__ = ["run", "load_model", "capture", "compare", "compare_trace", "read_trace", "audit", "sweep", "read_sweep",
           "plot", "plot_file", "report_file", "trace_info", "models", "bench", "render", "to_pandas", "import_dump",
           "write_sglang_dump", "write_megatron_dump", "TracerError", "__version__"]
