"""Which row of which engine tensor holds each absolute position of one HF capture point, for
:mod:`tracer.engines.dumps.namemap`: a :class:`Slot` per point, filled by :func:`place` from the
rows each step's requests computed (the first source of a position wins; a later one that differs is
named), read by :func:`rows_of` as the rows of a range of positions (one slice of the dump when one
placement holds them all, else stacked).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from tracer.errors import TracerError


class Slot(dict):
    """Which row of which engine tensor holds each absolute position of one HF point: position →
    ``(tensor, row)``. While every position came from one placement of consecutive rows (one request
    in one step: a layer's rows of a prefill) they are kept as that run alone, ``run = (first
    position, stop, tensor, first row)``, and the dict is empty: the rows of a range are then one
    slice, found without an entry per position. :meth:`spread` makes the entries (a second placement,
    a look at single positions)."""

    __slots__ = ("run",)

    def __init__(self) -> None:
        super().__init__()
        self.run: tuple[int, int, torch.Tensor, int] | None = None

    def empty(self) -> bool:
        return self.run is None and not self

    def positions(self) -> Any:
        """The placed positions (a range for a run, else the keys)."""
        return range(self.run[0], self.run[1]) if self.run is not None else self.keys()

    def spread(self) -> Slot:
        """The run as one entry per position (no run after); itself."""
        if self.run is not None:
            p0, p1, t, r0 = self.run
            self.update(zip(range(p0, p1), zip(itertools.repeat(t), range(r0, r0 + p1 - p0))))
            self.run = None
        return self


def place(slot: Slot, t: torch.Tensor, segs: list[tuple[int, int, int]],
          request: dict[int, tuple[int, int]], n_tokens: int, last: bool, step: int, name: str,
          conflicts: dict[str, list[int]], module: str) -> None:
    """Record which row of ``t`` holds each absolute position (first source wins; the positions where
    a second differs are collected in ``conflicts``). ``segs``: the step's runs placed on the
    reference (:func:`align_steps`); ``request``: every request of the step (:func:`segments`) by
    its first row → ``(stop row, index)``; ``last``: ``t`` holds one row per request, at its last
    position. A request cut short by :func:`align_steps` has no last row of its own (its logits are
    another token's)."""
    if not last and t.shape[0] != n_tokens:
        raise TracerError(f"{module} in step {step} has {t.shape[0]} rows but the step has {n_tokens} tokens; "
                          "the dump's activations and input_ids disagree")
    for a, b, pos in segs:
        full_b, index = request[a]
        if last and full_b != b:
            continue
        if not last and slot.empty():  # the name's first rows: no position is placed twice, one run
            slot.run = (pos, pos + b - a, t, a)
            continue
        slot.spread()  # rows from a second placement: looked up position by position
        pairs = [(pos + (b - a) - 1, index)] if last else list(zip(range(pos, pos + b - a), range(a, b)))
        again = [(p, r) for p, r in pairs if p in slot]
        slot.update((p, (t, r)) for p, r in pairs if p not in slot)
        if again:
            _conflicts(slot, t, again, name, conflicts)


def _conflicts(slot: Slot, t: torch.Tensor, again: list[tuple[int, int]], name: str,
               conflicts: dict[str, list[int]]) -> None:
    """Positions mapped a second time (rows ``r`` of ``t``) whose row differs from the first one's,
    compared per earlier source tensor in one operation."""
    by_source: dict[int, list[tuple[int, int, int]]] = {}
    for p, r in again:
        old, row = slot[p]
        by_source.setdefault(id(old), []).append((p, row, r))
    for group in by_source.values():
        old = slot[group[0][0]][0]
        first = old[[row for _p, row, _r in group]]
        later = t[[r for _p, _row, r in group]].to(old.dtype)
        if first.shape != later.shape:
            conflicts.setdefault(name, []).extend(p for p, _row, _r in group)
            continue
        same = (first == later).reshape(len(group), -1).all(dim=1)
        conflicts.setdefault(name, []).extend(p for (p, _row, _r), ok in zip(group, same.tolist()) if not ok)
    if not conflicts.get(name, True):
        del conflicts[name]


def rows_of(slot: Slot, lo: int, hi: int, ledger: Any, what: str) -> torch.Tensor:
    """The rows of positions ``lo..hi-1``, ``(hi - lo, *feature)``: a view when they are consecutive
    rows of one tensor (one request, one step), else stacked (a copy, charged to ``ledger`` first)."""
    if slot.run is not None and slot.run[0] <= lo and hi <= slot.run[1]:  # one placement: one slice
        p0, _stop, t0, r0 = slot.run
        return t0[r0 + lo - p0:r0 + hi - p0]
    t0, r0 = slot.spread()[lo]
    if all(slot[p][0] is t0 and slot[p][1] == r0 + p - lo for p in range(lo, hi)):
        return t0[r0:r0 + hi - lo]
    if ledger is not None:
        ledger.charge((hi - lo) * t0[0].numel() * t0.element_size(), f"{what}: its rows stacked by position")
    return torch.stack([slot[p][0][slot[p][1]] for p in range(lo, hi)])


__all__ = ["Slot", "place", "rows_of"]
