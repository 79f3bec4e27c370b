"""Which engine executes a scenario's plans, as far as planning knows it: ``--engines`` parsed, an
engine's defaults for the scenario options, and the scenarios that run only inside engines:
``--scenario engine`` (level 6) and ``prefill-decode`` (level 7, with its ``--producer`` setting).
Plain data and pure functions over the table of engines (:mod:`tracer.engines.table`; no torch, no
engine import).

Every catalogue scenario is planned for the reference engine; an engine realises it (its plans'
``RunPlan.engine`` and ``engine_settings``) through the door, :func:`tracer.engines.door.realise`,
which then sets the *engine options* the run gave (:data:`tracer.engines.table.ENGINE_OPTIONS`:
``--attention-backend``, ``--batch-invariant``) in the settings of every plan whose engine takes
them (:func:`with_engine_options`); ``--engines NAME:BACKEND`` names one plan's attention backend.
:func:`engine_scenario` is level 6 for real: run A on one engine, run B on another, the same weights
and token ids, every position compared (``--engines``; the default: the first two engines
``--engine`` chooses among). :func:`prefill_decode` hands a producer's KV cache to a consumer
inside an engine that has KV connectors; :func:`producer_difference` parses the one setting in
which the producer differs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tracer.engines.table import ENGINE_OPTIONS, check_engine, default, name_of, row, selectable, takers
from tracer.errors import TracerError
from tracer.plan.plans import RunPlan, Scenario


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"NAME:BACKEND"`` → ``(NAME, BACKEND)`` (upper case); ``"NAME"`` → ``(NAME, None)``: an engine
    and, after a colon, its attention backend by name."""
    name, _, backend = str(spec).strip().partition(":")
    return name.strip(), (backend.strip().upper() or None)


def parse_engines(engines: Any) -> tuple[str, str]:
    """``"A,B"`` or a pair → ``(A, B)``: each a known engine (installed or not: the run's validation
    checks that, :func:`tracer.engines.table.check_engine`), optionally with an attention backend
    (``NAME:BACKEND``, for an engine that takes ``attention_backend``; kept as ``NAME:BACKEND``).

    Raises:
        TracerError: not two engines, one unknown, an empty backend (``NAME:``), or a backend on an
            engine that takes none.
    """
    if isinstance(engines, str):
        engines = tuple(e.strip() for e in engines.split(","))
    engines = tuple(engines)
    if len(engines) != 2 or not all(isinstance(e, str) and e for e in engines):
        raise TracerError(f"--engines needs two engines such as {','.join(selectable()[:2])}, got {list(engines)}")
    out = []
    for spec in engines:
        name, backend = split_spec(spec)
        if backend is None and ":" in spec:  # 'NAME:' ran the engine's own choice, the colon dropped
            raise TracerError(f"--engines {spec}: no attention backend after the colon; give NAME:BACKEND "
                              "or the engine alone")
        name = check_engine(name, "--engines", False)
        if backend is not None and name not in takers("attention_backend"):
            example = next(iter(takers("attention_backend")), None)
            raise TracerError(f"--engines {spec}: {name} takes no attention backend"
                              + (f" ({example}:BACKEND does, e.g. {example}:TRITON_ATTN)" if example else ""))
        out.append(name if backend is None else f"{name}:{backend}")
    return out[0], out[1]


def check_engine_options(engine: str | None, scenario: Any, options: dict[str, Any]) -> None:
    """Refuse engine options (:data:`tracer.engines.table.ENGINE_OPTIONS`) that no plan of the run would
    use (``scenario``: the scenario's name; ``options``: the run's scenario options, ``engines`` among them).

    Raises:
        TracerError: e.g. ``--attention-backend`` on the reference engine (one line).
    """
    given = [k for k in ENGINE_OPTIONS if options.get(k) not in (None, False)]
    if not given:
        return
    engines = ({split_spec(e)[0] for e in parse_engines(options.get("engines") or selectable()[:2])}
               if scenario == "engine" else {name_of(engine)})
    for k in given:
        if not engines & set(takers(k)):
            flag, names = "--" + k.replace("_", "-"), takers(k) or ("no",)
            raise TracerError(f"{flag} is an option of the {'/'.join(names)} engine; use it with --engine {names[0]} "
                              f"(or --scenario engine with a {names[0]} run)")
    if scenario == "engine" and "attention_backend" in given:  # a plan's own backend wins (with_engine_options)
        specs = parse_engines(options.get("engines") or selectable()[:2])
        takes = [split_spec(e) for e in specs if split_spec(e)[0] in takers("attention_backend")]
        if takes and all(backend is not None for _, backend in takes):
            raise TracerError(f"--attention-backend {options['attention_backend']} would apply to no run: "
                              f"--engines {','.join(specs)} names the backend of each engine that takes one; drop --attention-backend, "
                              "or give it with an engine that names none (e.g. --engines "
                              f"{takes[0][0]}:{takes[0][1]},{takes[0][0]})")


def with_engine_options(scen: Scenario, options: dict[str, Any]) -> Scenario:
    """``scen`` with the engine options given in ``options`` (:data:`tracer.engines.table.ENGINE_OPTIONS`)
    in the ``engine_settings`` of every plan whose engine takes them (a plan's own attention backend,
    ``--engines NAME:BACKEND``, wins), and in its ``params``; ``scen`` itself when none is given."""
    given = {k: v for k, v in options.items() if k in ENGINE_OPTIONS and v not in (None, False)}
    if not given:
        return scen
    plans = {}
    for key in ("plan_a", "plan_b"):
        plan: RunPlan = getattr(scen, key)
        own = dict(plan.engine_settings or ())
        add = {k: (str(v).upper() if k == "attention_backend" else v) for k, v in given.items()
               if name_of(plan.engine) in takers(k) and k not in own}
        if add:
            extra = ", ".join(f"attention {v}" if k == "attention_backend" else "batch-invariant mode"
                              for k, v in sorted(add.items()))
            plan = replace(plan, engine_settings=tuple(sorted({**own, **add}.items())),
                           description=f"{plan.description} [{extra}]")
        plans[key] = plan
    return replace(scen, plan_a=plans["plan_a"], plan_b=plans["plan_b"], params={**scen.params, **given})


def engine_defaults(engine: str | None, accepted: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the engine's defaults (its table row's ``defaults``) for the options the builder
    accepts and the user left unset."""
    out = dict(params)
    for key, value in row(engine).defaults.items():
        if key in accepted and out.get(key) is None:
            out[key] = value
    return out


def engine_scenario(n_tokens: int, *, engines: Any = selectable()[:2]) -> Scenario:
    """Level 6: the prompt in one forward pass on engine A versus on engine B (same weights folder,
    same dtype, same token ids). Compared: all N positions; the logits where both engines computed
    them (an engine that computes them only where it samples: there). Each engine realises its plan
    (:func:`tracer.engines.door.realise`).

    Raises:
        TracerError: not two known engines.
    """
    a, b = parse_engines(engines)
    n = n_tokens
    plans = []
    for name, spec in (("A", a), ("B", b)):
        e, backend = split_spec(spec)
        what = row(e).label + (f", attention {backend}" if backend else "")
        plans.append(RunPlan(name, ((0, n),), f"{what}: all {n} tokens in one forward pass", engine=name_of(e),
                             engine_settings=(("attention_backend", backend),) if backend else ()))
    return Scenario(name="engine", level=6, invariant=f"engine choice ({a} vs {b})", plan_a=plans[0], plan_b=plans[1],
                    window=(0, n), params={"n_tokens": n, "engines": [a, b]})



#: what ``prefill-decode``'s ``producer`` may set differently from the consumer: setting -> its type
PRODUCER_SETTINGS: dict[str, type] = {"block_size": int, "max_num_batched_tokens": int, "dtype": str,
                                      "kv_cache_dtype": str, "attention_backend": str}
#: the engines' KV-cache dtype names beside the model dtypes (``auto``: the model dtype; fp8: an 8-bit float cache)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


#: the largest token count a ``--producer`` setting takes (the bound of ``--block-size``)
MAX_PRODUCER_TOKENS = 1 << 20


def producer_difference(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """``prefill-decode``'s ``producer`` option as ``{setting: value}``: ``KEY=VALUE`` (one difference at a
    time, so that the report can name what made the numbers differ), or ``{}`` (the control).

    Raises:
        TracerError: more than one setting, an unknown one, or a value of the wrong type (one line).
    """
    if not text:
        return {}
    known = ", ".join(PRODUCER_SETTINGS)
    items = list(dict(text).items()) if isinstance(text, dict) else [p for p in str(text).split(",") if p.strip()]
    if len(items) != 1:
        raise TracerError(f"--producer sets one difference at a time (KEY=VALUE, KEY one of {known}), got "
                          f"{len(items)}: {text}")
    item = items[0]
    if isinstance(item, str) and "=" not in item:
        raise TracerError(f"--producer {item.strip()}: expected KEY=VALUE (e.g. block_size=64)")
    key, value = item if isinstance(item, tuple) else item.split("=", 1)
    key, value = str(key).strip().replace("-", "_"), str(value).strip()
    if key not in PRODUCER_SETTINGS:
        raise TracerError(f"--producer {key}: unknown setting; use one of {known}")
    if not value:
        raise TracerError(f"--producer {key}=: give a value")
    if PRODUCER_SETTINGS[key] is int:
        try:
            number = int(value)
        except ValueError:
            raise TracerError(f"--producer {key}={value}: {key} is a number of tokens") from None
        if not 1 <= number <= MAX_PRODUCER_TOKENS:
            raise TracerError(f"--producer {key}={value}: {key} must be a number of tokens from 1 to "
                              f"{MAX_PRODUCER_TOKENS:,}")
        return {key: number}
    if key == "dtype":  # the one dtype table: bf16 is bfloat16
        from tracer.dtypes import SUPPORTED, canonical

        try:
            return {key: canonical(value)}
        except TracerError:
            raise TracerError(f"--producer dtype={value}: unknown dtype; use {SUPPORTED}") from None
    if key == "kv_cache_dtype":
        if value.lower() in KV_CACHE_DTYPES:
            return {key: value.lower()}
        from tracer.dtypes import canonical

        try:
            return {key: canonical(value)}
        except TracerError:
            raise TracerError(f"--producer kv_cache_dtype={value}: unknown KV-cache dtype; use auto, a model dtype "
                              f"or one of {', '.join(KV_CACHE_DTYPES[1:])}") from None
    return {key: value}


def prefill_decode(n_tokens: int, *, new_tokens: int = 8, block_size: int = default(None, "block_size"),
                   producer: str | None = None) -> Scenario:
    """Level 7: disaggregated prefill and decode inside an engine. Run A: the consumer alone prefills
    the prompt (a KV cache miss) and greedy-decodes ``new_tokens`` tokens. Run B: a producer prefills
    the prompt and hands its KV cache over (the engine's KV connector); the consumer loads it,
    computes what was not transferred, and decodes. ``producer``: the one setting in which the
    producer differs from the consumer, ``KEY=VALUE`` (its keys: ``tracer help scenario``;
    none: the control, which must be bit-identical). Compared: the KV cache (transferred vs computed), the positions the consumer
    computes in both runs and every decode step (the engine sets the window's start at the
    transferred prefix). Runs only inside an engine that has KV connectors (``tracer help engines``).

    Raises:
        TracerError: ``new_tokens`` < 1, or a bad ``producer`` (:func:`producer_difference`).
    """
    if new_tokens < 1:
        raise TracerError(f"--new-tokens must be at least 1, got {new_tokens}")
    diff = producer_difference(producer)
    n, t = n_tokens, new_tokens
    what = f", the producer with {', '.join(f'{k}={v}' for k, v in diff.items())}" if diff else ""
    return Scenario(
        name="prefill-decode", level=7, invariant="disaggregated prefill and decode (a KV cache handed over)",
        plan_a=RunPlan("A", ((0, n),), f"the consumer alone: all {n} tokens prefilled (a KV cache miss), {t} tokens "
                       f"generated ({t - 1} decode step{'s' * (t != 2)})", generate=t),
        plan_b=RunPlan("B", ((0, n),), f"a producer prefills the prompt and hands its KV cache over{what}; the "
                       f"consumer loads it and generates {t} tokens", generate=t),
        window=(n - 1, n - 1 + t),
        params={"n_tokens": n, "new_tokens": t, "block_size": block_size, "producer": diff, "engine_only": True})


__all__ = ["check_engine", "split_spec", "parse_engines", "check_engine_options", "with_engine_options",
           "engine_defaults", "engine_scenario", "PRODUCER_SETTINGS", "KV_CACHE_DTYPES", "MAX_PRODUCER_TOKENS",
           "producer_difference", "prefill_decode"]
