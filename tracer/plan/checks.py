"""Value checks of user input, before any model loads: ranges, empty lists, input files, and
which options a catalogue scenario takes.

Small pure functions that the run config (:func:`tracer.validate.validate`) calls. Each raises one :class:`TracerError` line naming
the option, the bad value and what to give instead; each returns the checked value.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from tracer.errors import TracerError, did_you_mean
from tracer.files import MAX_TOKENS
from tracer.engines.table import ENGINE_OPTIONS

#: the rules of ``--fail-on`` (None: report only)
FAIL_ON = ("any", "flip", "tolerance")
#: the largest KV block size, chunk size, batch size, decode count
MAX_COUNT = 1 << 20
#: the most tensor-parallel shards simulated (no model has more KV heads)
MAX_TP = 256


def check_int(value: Any, option: str, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """``value`` as an int within ``[minimum, maximum]``.

    Raises:
        TracerError: not an integer (bool included) or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TracerError(f"{option} {value!r} is not an integer; give a whole number such as {max(minimum, 1)}")
    if not minimum <= value <= maximum:
        shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}...({len(str(value))} digits)"
        raise TracerError(f"{option} {shown} is outside {minimum}..{maximum}; give a value in that range")
    return value


def check_length(length: int | None) -> int | None:
    """``--length``: 2..:data:`MAX_TOKENS` tokens (None = the prompt's own length)."""
    return None if length is None else check_int(length, "--length", 2, MAX_TOKENS)


def check_block_size(block_size: int | None, option: str = "--block-size") -> int | None:
    """A KV block size in tokens: 1..:data:`MAX_COUNT` (None = the default)."""
    return None if block_size is None else check_int(block_size, option, 1, MAX_COUNT)


def check_scenario_values(options: dict[str, Any]) -> dict[str, Any]:
    """Ranges of the scenario options the user set (the ``scenario_options`` group of :data:`tracer.config.OPTIONS`):
    ``batch_size`` >= 2 (the traced prompt plus at least one other row), ``batch_row``,
    ``new_tokens``, ``chunk_size`` >= 1 (``batch_row`` >= 0), ``tp`` 1..:data:`MAX_TP`,
    ``block_sizes`` two sizes >= 1, attention implementations (``attn_a``, ``attn_b``, ``train_attn``) this
    machine has.

    Raises:
        TracerError: the first value out of range.
    """
    ranges = {"batch_size": ("--batch-size", 2, MAX_COUNT), "batch_row": ("--batch-row", 0, MAX_COUNT),
              "new_tokens": ("--new-tokens", 1, MAX_COUNT), "chunk_size": ("--chunk-size", 1, MAX_COUNT),
              "tp": ("--tp", 1, MAX_TP)}
    for key, (option, lo, hi) in ranges.items():
        if options.get(key) is not None:
            check_int(options[key], option, lo, hi)
    for key in ("attn_a", "attn_b", "train_attn"):  # an audit's too, whose checks are planned after loading
        if options.get(key) is not None:
            from tracer.load.preflight import check_attn

            check_attn(options[key])
    sizes = options.get("block_sizes")
    if sizes is not None:
        if len(sizes) != 2:
            raise TracerError(f"--block-sizes takes two sizes b1,b2 (got {len(sizes)}); e.g. 16,64")
        for b in sizes:
            check_block_size(b, "--block-sizes")
    return options


def check_compression(compression: str | None) -> str | None:
    """``--compression``: none, lzf or gzip (None and "none" both mean off).

    Raises:
        TracerError: anything else.
    """
    if compression in (None, "none", "lzf", "gzip"):
        return None if compression in (None, "none") else compression
    raise TracerError(f"unknown --compression {compression!r}; use one of none, lzf, gzip")


def scenario_option_names() -> tuple[str, ...]:
    """The scenario-specific options: every keyword of a catalogue builder but the shared ones."""
    from tracer.plan.scenarios import SCENARIOS

    shared = {"n_tokens", "block_size", "split_at", "mitigation", "engine", *ENGINE_OPTIONS}
    names: list[str] = []
    for fn in SCENARIOS.values():
        names += [p for p in inspect.signature(fn).parameters if p not in shared and p not in names]
    return tuple(names)


def applicable_options(scenario: str) -> tuple[str, ...]:
    """The scenario options (and ``block_size``/``split_at``) the catalogue scenario ``scenario`` uses."""
    from tracer.plan.scenarios import SCENARIOS

    return tuple(p for p in inspect.signature(SCENARIOS[scenario]).parameters if p not in ("n_tokens", "mitigation"))


def own_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The options of ``params`` that catalogue scenario ``name`` takes (with ``mitigation`` and
    ``engine``): an audit's options are its checks', and each check's scenario takes its own."""
    from tracer.plan.scenarios import SCENARIOS

    if name not in SCENARIOS:
        return params
    uses = applicable_options(name)
    return {k: v for k, v in params.items() if k in uses or k in ("mitigation", "engine", *ENGINE_OPTIONS)}


def check_applicable(scen: Any) -> None:
    """Refuse options that the chosen catalogue scenario does not use (``scen``: a
    :class:`tracer.config.ScenarioConfig`).

    Raises:
        TracerError: unknown scenario name, or an option set that the scenario ignores.
    """
    from tracer.plan.scenarios import SCENARIOS

    if not isinstance(scen.name, str):  # a Scenario or a builder of the user's: they take no options
        given = scen.params()
        given.pop("mitigation", None)
        given.pop("engine", None)
        for k in ENGINE_OPTIONS:  # engine options: applied to the plans by the door (tracer.engines.door.realise)
            given.pop(k, None)
        if given:
            raise TracerError(f"option(s) {', '.join(sorted(given))} apply to catalogue scenarios only; "
                              "build them into your own Scenario")
        return
    if scen.name not in SCENARIOS:
        close = did_you_mean(str(scen.name), list(SCENARIOS))
        raise TracerError(f"unknown scenario '{scen.name}'" + (f" (did you mean {close}?)" if close else "")
                          + f"; use one of: {', '.join(SCENARIOS)}")
    uses = applicable_options(scen.name)
    extra = sorted(k for k in scen.params() if k not in ("mitigation", "engine", *ENGINE_OPTIONS) and k not in uses)
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        valid = ", ".join("--" + k.replace("_", "-") for k in uses) or "none"
        owners = sorted({name for k in extra for name in SCENARIOS if k in applicable_options(name)})
        hint = f" ({flags} is an option of --scenario {owners[0]})" if len(extra) == 1 and len(owners) == 1 else ""
        raise TracerError(f"{flags} does not apply to scenario {scen.name}; its options: {valid}{hint}")


PREFILL_DECODE_REFUSED = ("--kernels, --op-replay and --decode are not available with prefill-decode yet (it decodes "
                          "--new-tokens itself); drop them")


def check_capture_options(scen: Any, *, kernels: bool, op_replay: bool, decode: int) -> None:
    """The capture and check options a planned scenario (``scen``: a
    :class:`~tracer.plan.plans.Scenario`) cannot take, refused before any model loads: ``prefill-decode``
    decodes ``--new-tokens`` itself, so ``--kernels``, ``--op-replay`` and ``--decode`` are refused
    (its engine's executor would refuse them only after
    both engines had loaded).

    Raises:
        TracerError: :data:`PREFILL_DECODE_REFUSED`, one line.
    """
    if getattr(scen, "name", None) == "prefill-decode" and (kernels or op_replay or decode):
        raise TracerError(PREFILL_DECODE_REFUSED)


def check_fail_on(fail_on: str | None, atol: float | None, rtol: float | None) -> None:
    """Validate ``--fail-on`` and the tolerances (before any model is loaded).

    Raises:
        TracerError: unknown rule, negative/NaN tolerance, or ``tolerance`` without atol/rtol.
    """
    if fail_on is not None and fail_on not in FAIL_ON:
        raise TracerError(f"unknown --fail-on '{fail_on}'; use one of: {', '.join(FAIL_ON)}")
    for opt, v in (("--atol", atol), ("--rtol", rtol)):
        if v is not None and not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
            raise TracerError(f"{opt} {v} is not a finite number >= 0; give e.g. {opt} 1e-3")
    if fail_on == "tolerance" and atol is None and rtol is None:
        raise TracerError("--fail-on tolerance needs --atol and/or --rtol (e.g. --atol 1e-2)")


def positions_needed(scen: Any, n_tokens: int, decode: int = 0) -> int:
    """The positions a scenario of an N-token prompt uses: the prompt, what a plan generates
    (``generate-cache``), the longest RL sequence (``rollout-vs-train``: prompt + response), and the
    decode replay's ``decode`` tokens after the prompt."""
    need = max(n_tokens, int(scen.window[1]))
    for plan in (scen.plan_a, scen.plan_b):
        need = max(need, n_tokens + int(plan.generate or 0))
        rl = getattr(plan, "rl", None)
        if rl is not None:
            need = max(need, max(rl.lengths) + int(rl.new_tokens))
    return need + int(decode)


def check_positions(need: int, max_positions: int | None, scaled: bool, model: str) -> str | None:
    """Refuse a run that needs more positions than the model has (``max_position_embeddings``): it ran
    without a word (``--length 16384`` on a 4,096-position model) or for ever (``--new-tokens 100000``).

    Returns:
        None within the model's positions; a one-line note when beyond them but the config declares
        RoPE scaling (``scaled``: the model is meant to run longer than its nominal positions).

    Raises:
        TracerError: beyond the model's positions without RoPE scaling.
    """
    if max_positions is None or need <= max_positions:
        return None
    what = (f"this run needs {need:,} positions (prompt, generated and decoded tokens) but {model} has "
            f"{max_positions:,} (max_position_embeddings)")
    if scaled:
        return f"note: {what}; its config declares RoPE scaling, so it runs, beyond the positions it was trained on"
    raise TracerError(f"{what}; give a shorter --length, fewer --new-tokens / --decode tokens, or another model")
