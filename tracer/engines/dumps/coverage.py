"""What an engine dump and its HF reference hold on one side only: the notes a mapping adds for
positions and names that are not compared (:func:`tracer.engines.dumps.namemap.map_dump`).

Each function returns the note's text; the mapping decides when a note applies."""

from __future__ import annotations

from tracer.engines.dumps.tokens import ranges
from tracer.execute.kinds import PointKind
from tracer.execute.records import RawDump


def only_in_reference(missing: list[int], raw: RawDump) -> str:
    """The note on the reference's kept positions that are not compared: not in the dump, or in it
    with other token ids than the reference's (rows the alignment left out; the dump's ``positions``
    say which were dumped)."""
    dumped: set[int] = set()
    for tok in raw.tokens.values():
        pos = tok.get("positions")
        if pos is not None:
            dumped.update(int(p) for p in pos.reshape(-1).tolist())
    other = [p for p in missing if p in dumped]
    absent = [p for p in missing if p not in dumped]
    parts = ([f"{ranges(absent)} (not dumped by the engine)"] if absent else []) + \
        ([f"{ranges(other)} (dumped, but for other token ids than the reference's: another prompt)"] if other else [])
    return "positions only in the reference: " + "; ".join(parts)


def only_in_dump(positions: str, window: tuple[int, int]) -> str:
    """The note on dumped positions outside the reference's kept ``window`` (``positions``: as
    :func:`ranges` writes them)."""
    return f"positions only in the dump: {positions} (outside the reference's kept window {window[0]}..{window[1] - 1})"


def one_side(ref_names: dict[str, tuple], uncaptured: set[str], compared: set[str], ignored: set[str],
              ignored_inputs: list[str]) -> list[str]:
    """The notes on names present on one side only: ``ref_names`` (the reference's capture points,
    name → ``(kind, ...)``, :class:`~tracer.engines.dumps.namemap.RefLayout`'s ``names``), ``uncaptured`` (HF names engine tensors map onto
    that the reference did not capture), ``compared`` (HF names given rows, whole or in part),
    ``ignored`` (engine modules matched by an ignore pattern), ``ignored_inputs`` (the dump's
    module inputs)."""
    notes = []
    extra = sorted(uncaptured)
    if extra:
        notes.append(f"engine tensors mapped to HF points the reference did not capture (trace it with --granularity "
                     f"sublayers): {', '.join(extra[:6])}{f' ... ({len(extra)} in all)' if len(extra) > 6 else ''}")
    only_ref = [n for n, (k, *_r) in ref_names.items() if n not in compared and k != PointKind.KV_CACHE]
    if only_ref:
        notes.append(f"capture points only in the reference (no engine tensor): {', '.join(only_ref[:8])}"
                     f"{f' ... ({len(only_ref)} in all)' if len(only_ref) > 8 else ''}")
    if ignored:
        notes.append(f"engine tensors read and not mapped (ignore patterns): {', '.join(sorted(ignored)[:6])}"
                     f"{' ...' if len(ignored) > 6 else ''}")
    if ignored_inputs:
        notes.append(f"module inputs in the dump not compared: {len(ignored_inputs)} names")
    return notes


__all__ = ["only_in_reference", "only_in_dump", "one_side"]
