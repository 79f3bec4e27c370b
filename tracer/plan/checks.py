"""Value checks of user input, before any model loads: ranges, empty lists, input files.

Plan-layer helpers (target: ``tracer/plan/checks.py``), small pure functions that the run
config (and the commands until it exists) call. Each raises one :class:`TracerError` line naming
the option, the bad value and what to give instead; each returns the checked value.
"""

from __future__ import annotations

from typing import Any

from tracer.errors import TracerError
from tracer.files import MAX_TOKENS

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
    """Ranges of the scenario options the user set (see ``tracer.cli.scenario_options``):
    ``batch_size`` >= 2 (the traced prompt plus at least one other row), ``batch_row``,
    ``new_tokens``, ``chunk_size`` >= 1 (``batch_row`` >= 0), ``tp`` 1..:data:`MAX_TP`,
    ``block_sizes`` two sizes >= 1.

    Raises:
        TracerError: the first value out of range.
    """
    ranges = {"batch_size": ("--batch-size", 2, MAX_COUNT), "batch_row": ("--batch-row", 0, MAX_COUNT),
              "new_tokens": ("--new-tokens", 1, MAX_COUNT), "chunk_size": ("--chunk-size", 1, MAX_COUNT),
              "tp": ("--tp", 1, MAX_TP)}
    for key, (option, lo, hi) in ranges.items():
        if options.get(key) is not None:
            check_int(options[key], option, lo, hi)
    sizes = options.get("block_sizes")
    if sizes is not None:
        if len(sizes) != 2:
            raise TracerError(f"--block-sizes takes two sizes b1,b2 (got {len(sizes)}); e.g. 16,64")
        for b in sizes:
            check_block_size(b, "--block-sizes")
    return options


def check_nonempty(spec: str | None, option: str, example: str) -> str | None:
    """A list option given as text must name something: ``--levels ""`` is an error, not "all".

    Raises:
        TracerError: an empty or blank value.
    """
    if spec is not None and not spec.replace(",", "").strip():
        raise TracerError(f"{option} is empty; give e.g. {option} {example}, or leave it out for the default")
    return spec


def check_compression(compression: str | None) -> str | None:
    """``--compression``: none, lzf or gzip (None and "none" both mean off).

    Raises:
        TracerError: anything else.
    """
    if compression in (None, "none", "lzf", "gzip"):
        return None if compression in (None, "none") else compression
    raise TracerError(f"unknown --compression {compression!r}; use one of none, lzf, gzip")


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
