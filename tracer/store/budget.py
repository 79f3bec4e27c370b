"""``--store auto``: which capture points a trace keeps in full, within ``--max-trace-size``.

Every point is compared on the model's device first, so its statistics are known for all of them
(the stored comparison); full tensors are then written only for the points a user reads first —
the logits, each origin (where a divergence is born) with the point before it (the op's input),
then outward from the first origin — until the byte budget is spent. A trace that fits the
budget whole is kept whole. The choice is plain data (:class:`Kept`), stored in each run's meta
and named in the report.

This module is pure: names and byte counts in, names out (no tensors, no files).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tracer import schema
from tracer.errors import TracerError

#: default ``--max-trace-size``: full tensors kept by ``--store auto``, both runs together
DEFAULT_MAX_TRACE_SIZE = 256 << 20
#: the largest budget accepted (fits the int64 attributes the trace stores it in)
MAX_SIZE = (1 << 63) - 1

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: Any, what: str = "--max-trace-size") -> int:
    """Bytes from ``300MB``, ``2GiB``, ``512m``, ``1.5G`` or a plain integer (bytes).

    Decimal units (kB, MB, GB, TB; k/m/g/t) are powers of 1000; binary ones (KiB, MiB, GiB, TiB)
    powers of 1024.

    Raises:
        TracerError: not a size, or not positive.
    """
    shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:37] + "..."
    if isinstance(text, bool):
        raise TracerError(f"{what} {shown} is not a size; give bytes or e.g. 300MB, 2GiB")
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise TracerError(f"{what} {shown} is not a size; give bytes or e.g. 300MB, 2GiB")

        exact = Decimal(m.group(1)) * _UNITS[unit]
        if exact >= 1 and exact != exact.to_integral_value():
            raise TracerError(f"{what} {shown} is not a whole number of bytes; give a unit (e.g. 1.5G, 300MB) or "
                              "whole bytes")
        n = int(exact)  # exact for any number of digits
    if n <= 0:
        raise TracerError(f"{what} {shown} is under 1 byte; give at least 1 (use --store stats to keep no tensors)")
    if n > MAX_SIZE:
        raise TracerError(f"{what} {shown} is more than {MAX_SIZE:,} bytes (8 EiB); give a real budget, e.g. 2GiB")
    return n


def format_size(n: int) -> str:
    """``n`` bytes as a short human size (binary units), e.g. ``1.5 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Kept(schema.Record):
    """What ``--store auto`` wrote in full.

    Attributes:
        names: the kept capture points, in capture order.
        dropped: the points stored as statistics only (in the comparison), in capture order.
        kept_bytes, total_bytes: tensor bytes kept / captured, both runs together.
        budget: the ``--max-trace-size`` in bytes.
    """

    names: tuple[str, ...] = schema.field(key="kept")
    dropped: tuple[str, ...]
    kept_bytes: int
    total_bytes: int
    budget: int
    reasons: dict[str, str] = schema.field(default_factory=dict)

    def summary(self) -> str:
        """One line for the report, e.g. ``--store auto kept full tensors of 9 of 62 points (...)``."""
        if not self.dropped:
            return (f"--store auto kept every point's tensors ({format_size(self.kept_bytes)}, within "
                    f"--max-trace-size {format_size(self.budget)})")
        n = len(self.names) + len(self.dropped)
        shown = ", ".join(self.names[:6]) + (", ..." if len(self.names) > 6 else "")
        return (f"--store auto kept full tensors of {len(self.names)} of {n} points ({format_size(self.kept_bytes)} of "
                f"{format_size(self.total_bytes)}, --max-trace-size {format_size(self.budget)}): "
                f"{shown or 'none'}; the other {len(self.dropped)} are statistics only (stored comparison)")


@dataclass(frozen=True)
class StoreAuto(Kept):
    """What ``--store auto`` chose, as each stored run's ``meta["store_auto"]`` records it: the
    :class:`Kept` choice, the logits point's name and the capture kind of every dropped point
    (a reader reports those as not stored, with their kind)."""

    logits: str | None = None
    kinds: dict[str, str] = schema.field(default_factory=dict)


def choose(points: list[tuple[str, int]], budget: int, *, origins: tuple[str, ...] = (),
           logits: str | None = None) -> Kept:
    """The points ``--store auto`` keeps in full.

    Args:
        points: ``(name, bytes)`` per capture point in capture order; bytes of both runs together.
        budget: the byte budget (``--max-trace-size``).
        origins: the origin points (a divergence is born there), first one first.
        logits: the logits point's name, if captured.

    Order of preference, each taken only if it still fits: everything when the whole fits; else
    the logits, each origin and the point just before it, then outward from the first origin
    (before, after, before, ...; a side stops at the first point that does not fit). Without an
    origin, outward from the last point before the logits (the deepest layers).

    Returns:
        a :class:`Kept`.
    """
    names = [n for n, _ in points]
    size = dict(points)
    total = sum(size.values())
    if total <= budget:
        return Kept(tuple(names), (), total, total, budget, {n: "whole trace within budget" for n in names})
    kept: dict[str, str] = {}
    used = 0

    def take(name: str, why: str) -> bool:
        nonlocal used
        if name in kept:
            return True
        if used + size[name] > budget:
            return False
        kept[name] = why
        used += size[name]
        return True

    index = {n: i for i, n in enumerate(names)}
    if logits in size:
        take(logits, "logits")
    body = [n for n in names if n != logits]
    origins = tuple(o for o in origins if o in index and o != logits)
    for o in origins:
        if take(o, "origin"):
            prev = index[o] - 1
            if prev >= 0 and names[prev] != logits:
                take(names[prev], f"input side of origin {o}")
    if body:
        pos = {n: i for i, n in enumerate(body)}
        centre = pos[origins[0]] if origins else len(body) - 1
        lo, hi = centre - 1, centre + 1
        take(body[centre], "around the origin" if origins else "deepest layer")
        while lo >= 0 or hi < len(body):
            if lo >= 0 and not take(body[lo], "around the origin" if origins else "deepest layers"):
                lo = -1
            else:
                lo -= 1
            if hi < len(body) and not take(body[hi], "around the origin"):
                hi = len(body)
            else:
                hi += 1
    order = [n for n in names if n in kept]
    return Kept(tuple(order), tuple(n for n in names if n not in kept), used, total, budget,
                {n: kept[n] for n in order})


__all__ = ["DEFAULT_MAX_TRACE_SIZE", "Kept", "choose", "parse_size", "format_size"]
