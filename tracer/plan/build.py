"""A scenario from a run's options: by catalogue name, from a user's Scenario or builder, or as a
preview before the prompt is tokenized, with its resources checked on this machine.

:func:`build` looks the name up in :data:`tracer.plan.scenarios.SCENARIOS`, refuses options the
builder does not take, fills the engine's defaults (:func:`tracer.plan.engines.engine_defaults`)
and applies ``--mitigation``; the builders themselves are the catalogue
(:mod:`tracer.plan.scenarios`). Every scenario is planned for the reference engine: another engine
realises it through the door (:func:`tracer.engines.door.realise`).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from tracer.errors import TracerError
from tracer.engines.table import ENGINE_OPTIONS
from tracer.plan.engines import engine_defaults, with_engine_options
from tracer.plan.plans import Scenario
from tracer.plan.scenarios import SCENARIOS, check_mitigation, with_mitigation


def build(name: str, n_tokens: int, **params: Any) -> Scenario:
    """Build the named scenario for a prompt of ``n_tokens`` tokens.

    ``params`` are the scenario options (``block_size``, ``split_at``, ``batch_size``, ``padding``,
    ``batch_row``, ``new_tokens``, ``block_sizes``, ``chunk_size``, ``tp``, ``reduce``,
    ``reduce_dtype``, ``tp_mode``, ``tp_partials``, ``tp_vocab_parallel``, ``kv_format``,
    ``attn_a``, ``attn_b``, ``devices``, ``mitigation``, and ``rollout-vs-train``'s ``rollouts``,
    ``sample``, ``temperature``, ``seed``, ``train_batching``, ``train_attn``, ``lm_head_fp32``,
    ``train_dtype``, ``is_cap``, ``mask_threshold``, ``mitigations``, ``engine``'s ``engines``) and
    ``engine`` (whose defaults, e.g. its KV block size, fill unset options; the door realises the
    scenario on it, :func:`tracer.engines.door.realise`), and the engine options
    (``attention_backend``, ``batch_invariant``: kept in the scenario's ``params``, set in the plans
    of the engines that take them, :func:`tracer.plan.engines.with_engine_options`); each builder
    takes the ones it uses, None means its default.

    Raises:
        TracerError: unknown scenario name (listing the known ones), an option the scenario does
            not use, or bad parameters.
    """
    if name not in SCENARIOS:
        raise TracerError(f"unknown scenario '{name}'; use one of: {', '.join(SCENARIOS)}")
    fn = SCENARIOS[name]
    accepted = inspect.signature(fn).parameters
    engine = params.pop("engine", None)
    engine_options = {k: params.pop(k) for k in ENGINE_OPTIONS if k in params}
    params = engine_defaults(engine, accepted, params)
    mitigation = params.get("mitigation")
    check_mitigation(mitigation)
    extra = sorted(k for k, v in params.items() if v is not None and k != "mitigation" and k not in accepted)
    if extra:
        valid = ", ".join(p for p in accepted if p not in ("n_tokens", "mitigation")) or "none"
        raise TracerError(f"option(s) {', '.join(extra)} do not apply to scenario {name}; its options: {valid}")
    kwargs = {k: v for k, v in params.items() if k in accepted and v is not None}
    scen = fn(n_tokens, **kwargs)
    scen = scen if "mitigation" in accepted else with_mitigation(scen, mitigation)
    return with_engine_options(scen, engine_options)


#: the scenarios built lately, by (name, N, options): a run's early check (:func:`tracer.validate.validate`,
#: before the model loads), its position check and its plan share one Scenario (frozen data)
_BUILT: dict[str, Scenario] = {}
_KEEP = 8


def make_scenario(scenario: Any, n_tokens: int, options: dict[str, Any]) -> Any:
    """A :class:`~tracer.plan.scenarios.Scenario` from a catalogue name, a Scenario, or ``f(n_tokens)``.
    A catalogue scenario is built once per (name, N, options): asked again, the same object comes back.
    The engine options among ``options`` are kept in the scenario's ``params`` (and set in the plans of
    the engines that take them), a user's scenario's too.

    Raises:
        TracerError: bad options, or a callable that does not return a Scenario.
    """
    if isinstance(scenario, str):
        key = json.dumps([scenario, n_tokens, options], sort_keys=True, default=repr)
        if key not in _BUILT:
            scen = build(scenario, n_tokens, **options)
            while len(_BUILT) >= _KEEP:
                _BUILT.pop(next(iter(_BUILT)))
            _BUILT[key] = scen
        return _BUILT[key]
    scen = scenario(n_tokens) if callable(scenario) and not isinstance(scenario, Scenario) else scenario
    if not isinstance(scen, Scenario):
        raise TracerError(f"scenario must be a name, a Scenario or a function n_tokens -> Scenario, got {type(scen).__name__}")
    return with_engine_options(scen, options)


def check_resources(scen: Any) -> Any:
    """Refuse a scenario whose plans need a device or attention implementation this machine lacks.

    Raises:
        TracerError: naming the missing device or implementation.
    """
    from tracer.load.preflight import check_attn, check_device

    for plan in (scen.plan_a, scen.plan_b):
        for dev in plan.devices or ():
            try:
                check_device(dev)  # the name, and CUDA where it cannot exist, without torch
                if dev.strip().lower() != "cpu":
                    from tracer.load import devices

                    devices.resolve_device(dev)
            except TracerError as e:
                raise TracerError(f"scenario {scen.name} runs on {dev}, which this machine cannot use ({e}); "
                                  "pass --devices with two devices it has, e.g. cpu,cpu") from None
        if plan.attn is not None:
            check_attn(plan.attn)
    return scen


def preview(name: str, n_tokens: int | None, params: dict[str, Any]) -> Scenario:
    """The scenario as far as it can be built before the prompt is tokenized (every
    length-independent error): for N when N is known, else for a long prompt without the split point.

    Raises:
        TracerError: bad options.
    """
    if n_tokens is not None:
        return make_scenario(name, n_tokens, params)
    return make_scenario(name, 100_000, {k: v for k, v in params.items() if k != "split_at"})


__all__ = ["build", "make_scenario", "check_resources", "preview"]
