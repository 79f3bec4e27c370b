"""``tracer bench --engine E`` (an engine other than the reference): the cost of capturing inside
that engine, as a ratio to the engine's own bare run.

One process, one loaded HF model and the engine's instances for the scenario's plans (prefix-cache:
a miss and a hit of the same prompt), every mode interleaved (bare, capture, tracer, bare, ...)
after warm-up, so the ratios are measured side by side on the same machine state:

    bare     both plans through the engine's own API, no hooks (the floor:
             :func:`tracer.engines.door.run_bare`)
    capture  both plans executed by the engine's executor: hooks on every mapped module, the
             rows of the traced prompt copied to the host and mapped onto HF names
             (:func:`tracer.engines.door.execute_plan`), no comparison
    tracer   ``tracer run --engine E --store none``: capture, then the online comparison

Every repetition starts each plan from an empty cache (as tracer's runs do), so the bare floor
computes exactly what the captured runs compute.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tracer import schema

MODES = ("bare", "capture", "tracer")


@dataclass
class EngineBenchResult(schema.Record):
    """Timings (seconds) of each mode per measured repetition, and the configuration."""

    config: dict[str, Any]
    times: dict[str, list[float]] = field(default_factory=dict)

    def median(self, mode: str) -> float:
        """The median wall time of ``mode`` (seconds)."""
        return statistics.median(self.times[mode])

    def ratios(self) -> dict[str, float]:
        """``capture_over_bare`` and ``tracer_over_bare``: medians over the bare floor's."""
        if not self.times.get("bare"):
            return {}
        bare = self.median("bare")
        return {f"{m}_over_bare": self.median(m) / bare for m in MODES if m != "bare" and self.times.get(m)}

    def schema_extras(self, doc: dict[str, Any]) -> None:
        """The JSON document: the fields, and the medians, min, max and ratios."""
        doc["median_s"] = {m: self.median(m) for m, v in self.times.items() if v}
        doc["min_s"] = {m: min(v) for m, v in self.times.items() if v}
        doc["max_s"] = {m: max(v) for m, v in self.times.items() if v}
        doc["ratios"] = self.ratios()


def bench_engine(model: str = "smollm2-135m", *, engine: str, length: int = 1024, dtype: str = "bfloat16",
                 granularity: str = "layers", kv_cache: bool = True, block_size: int | None = None, reps: int = 5,
                 warmup: int = 1, gguf: str | None = None,
                 progress: Callable[[str], None] | None = None) -> EngineBenchResult:
    """Measure the modes of the module docstring for the prefix-cache scenario on ``engine`` at
    ``length`` tokens (``block_size``: None, the engine's default).

    Raises:
        TracerError: bad options (as ``tracer run --engine E``), the engine not installed or not starting.
    """
    from tracer import pipeline
    from tracer.config import RunConfig
    from tracer.validate import validate
    from tracer.engines.door import execute_plan, run_bare

    say = progress or (lambda m: None)
    cfg = validate(RunConfig.from_options(model=model, length=length, dtype=dtype, gguf=gguf, engine=engine,
                                          block_size=block_size, granularity=granularity, kv_cache=kv_cache,
                                          store="none"))
    say(f"loading {model}")
    prep = pipeline.prepare(cfg, say=say)
    lm, ids, scen = prep.loaded, prep.token_ids, prep.scenario
    points = pipeline.capture_points(lm, cfg.capture)
    meta = {"scenario": scen.name, "level": scen.level}
    plans = (scen.plan_a, scen.plan_b)

    def bare() -> None:
        run_bare(lm, ids, scen, meta=meta)

    def capture() -> None:
        for plan in plans:
            execute_plan(lm, ids, plan, points, scen.window, meta=meta)

    modes = {"bare": bare, "capture": capture,
             "tracer": lambda: pipeline.run_scenario(lm, ids, scen, cfg.capture, online=True)}
    say(f"starting {engine} and checking the runs")
    first = pipeline.run_scenario(lm, ids, scen, cfg.capture, online=True).comparison
    facts = first.facts.get("engine_b", {})
    result = EngineBenchResult(config={
        "model": model, "engine": engine, "length": len(ids), "dtype": dtype, "granularity": granularity,
        "kv_cache": kv_cache, "block_size": scen.params.get("block_size"), "reps": reps, "warmup": warmup, "scenario": scen.name, "n_points": len(points),
        "verdict": first.verdict(), "version": facts.get("version"), "device": facts.get("device"),
        "attention_backend": facts.get("attention_backend"), "cached_tokens": first.facts.get("cached_tokens_b"),
        "plans": [p.description for p in plans]})
    result.times = {m: [] for m in modes}
    for i in range(warmup + reps):
        say(f"repetition {i + 1}/{warmup + reps}" + (" (warm-up)" if i < warmup else ""))
        for m, fn in modes.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                result.times[m].append(time.perf_counter() - t0)
    return result


__all__ = ["bench_engine", "EngineBenchResult", "MODES"]
