"""The figures, one module each (matplotlib imported lazily; the optional extra ``plot``): the
amplification line, the per-position heat map, the ULP histogram, the sweep map, and what they
share (:mod:`tracer.report.figures.common`). Reached through :mod:`tracer.report.plot`."""
