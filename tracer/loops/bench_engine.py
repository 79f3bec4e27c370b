"""``tracer bench --engine E`` (an engine other than the reference): the cost of capturing inside
that engine, as a ratio to the engine's own bare run.

One process, one loaded HF model and the engine's instances for the scenario's plans (prefix-cache:
a miss and a hit of the same prompt), every mode interleaved (bare, capture, tracer, bare, ...)
after warm-up, so the ratios are measured side by side on the same machine state:

    bare     both plans through the engine's own API, no hooks (the floor:
             :func:`tracer.engines.door.run_bare`)
    capture  both plans executed by the engine's executor: hooks on every mapped module, the
             rows of the traced prompt kept on the engine's device and mapped onto HF names
             (:func:`tracer.engines.door.execute_plan`), no comparison
    tracer   ``tracer run --engine E --store none``: capture, then the online comparison

Every repetition starts each plan from an empty cache (as tracer's runs do), so the bare floor
computes exactly what the captured runs compute.

With ``batch_invariant`` (an engine option, :data:`tracer.engines.table.ENGINE_OPTIONS`), the same
modes are then measured again with the engine's batch-invariant mode on (``bare_bi``,
``capture_bi``, ``tracer_bi``), in the same process: after the others, since the mode cannot be
switched off once on. The ratio ``bare_bi_over_bare`` is what the mode costs the engine itself.
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
        out = {f"{m}_over_bare": self.median(m) / bare for m in MODES if m != "bare" and self.times.get(m)}
        if self.times.get("bare_bi"):
            bi = self.median("bare_bi")
            out["bare_bi_over_bare"] = bi / bare
            out.update({f"{m}_bi_over_bare_bi": self.median(f"{m}_bi") / bi for m in MODES
                        if m != "bare" and self.times.get(f"{m}_bi")})
        return out

    def schema_extras(self, doc: dict[str, Any]) -> None:
        """The JSON document: the fields, and the medians, min, max and ratios."""
        doc["median_s"] = {m: self.median(m) for m, v in self.times.items() if v}
        doc["min_s"] = {m: min(v) for m, v in self.times.items() if v}
        doc["max_s"] = {m: max(v) for m, v in self.times.items() if v}
        doc["ratios"] = self.ratios()


def bench_engine(model: str = "smollm2-135m", *, engine: str, length: int = 1024, dtype: str = "bfloat16",
                 granularity: str = "layers", kv_cache: bool = True, block_size: int | None = None, reps: int = 5,
                 warmup: int = 1, gguf: str | None = None, device: str | None = None,
                 attention_backend: str | None = None, batch_invariant: bool = False, loaded: Any = None,
                 progress: Callable[[str], None] | None = None) -> EngineBenchResult:
    """Measure the modes of the module docstring for the prefix-cache scenario on ``engine`` at
    ``length`` tokens (``block_size``: None, the engine's default; ``device``: where the HF reference
    model is loaded, or ``loaded``: that model already loaded; the engine picks its own device;
    ``attention_backend``, ``batch_invariant``: engine options).

    Raises:
        TracerError: bad options (as ``tracer run --engine E``), the engine not installed or not
            starting, ``batch_invariant`` where the engine does not implement it (before anything runs).
    """
    from tracer import pipeline
    from tracer.config import RunConfig
    from tracer.validate import validate
    from tracer.engines.door import check, execute_plan, run_bare
    from tracer.plan.engines import with_engine_options

    say = progress or (lambda m: None)
    cfg = validate(RunConfig.from_options(model=model, length=length, dtype=dtype, gguf=gguf, engine=engine,
                                          block_size=block_size, granularity=granularity, kv_cache=kv_cache,
                                          store="none", device=device, attention_backend=attention_backend))
    say(f"loading {model}")
    prep = pipeline.prepare(cfg, loaded, say=say)
    lm, ids, scen = prep.loaded, prep.token_ids, prep.scenario
    bi = with_engine_options(scen, {"batch_invariant": True}) if batch_invariant else None
    if bi is not None:  # refused before anything is measured where the engine has no such mode
        check(bi, lm.info.device)
    points = pipeline.capture_points(lm, cfg.capture)
    meta = {"scenario": scen.name, "level": scen.level}
    plans = (scen.plan_a, scen.plan_b)

    def bare() -> None:
        run_bare(lm, ids, scen, meta=meta)

    def capture() -> None:
        for plan in plans:
            execute_plan(lm, ids, plan, points, scen.window, meta=meta, keep_on_device=True)

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
        "model_runner": facts.get("model_runner"), "device_name": facts.get("device_name"),
        "batch_invariant": batch_invariant,
        "plans": [p.description for p in plans]})
    result.times = {m: [] for m in modes}
    _measure(modes, result, warmup, reps, say, "")
    if bi is not None:  # the same modes with the mode on: after the others (it stays on in this process)
        say(f"batch-invariant mode: starting {engine} with it on")
        first_bi = pipeline.run_scenario(lm, ids, bi, cfg.capture, online=True).comparison
        result.config["verdict_batch_invariant"] = first_bi.verdict()
        modes_bi = {"bare_bi": lambda: run_bare(lm, ids, bi, meta=meta),
                    "capture_bi": lambda: [execute_plan(lm, ids, p, points, scen.window, meta=meta, keep_on_device=True)
                                           for p in (bi.plan_a, bi.plan_b)],
                    "tracer_bi": lambda: pipeline.run_scenario(lm, ids, bi, cfg.capture, online=True)}
        result.times.update({m: [] for m in modes_bi})
        _measure(modes_bi, result, warmup, reps, say, "batch-invariant ")
    return result


def repetition_label(i: int, warmup: int, reps: int) -> str:
    """What the progress line says during round ``i`` (0-based) of ``warmup`` warm-up rounds then
    ``reps`` timed ones, each counted on its own: ``warm-up 1/1``, then ``repetition 1/2``,
    ``repetition 2/2`` (``--reps 2`` used to read ``repetition 3/3``)."""
    return f"warm-up {i + 1}/{warmup}" if i < warmup else f"repetition {i - warmup + 1}/{reps}"


def _measure(modes: dict[str, Callable[[], Any]], result: EngineBenchResult, warmup: int, reps: int,
             say: Callable[[str], None], label: str) -> None:
    """Every mode once per repetition, interleaved; the times after the warm-up into ``result``."""
    for i in range(warmup + reps):
        say(label + repetition_label(i, warmup, reps))
        for m, fn in modes.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                result.times[m].append(time.perf_counter() - t0)


__all__ = ["bench_engine", "EngineBenchResult", "MODES", "repetition_label"]
