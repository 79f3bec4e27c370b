"""The ``dims`` strings of engine dumps, as SGLang's comparator parses them.

An SGLang dumper file's meta may carry ``dims``: one token per tensor dimension, then optionally
a ``#`` declaration part. Two grammars are in use, and both are read (sources followed:
sgl-project/sglang ``python/sglang/srt/debug_utils/comparator/dims.py`` at
0a01b3f0f20a4aeb844f20adada9a11243680960, the older one; ``comparator/dims_spec/{dims_parser,
dim_parser,modifier_parser,comment_parser,types}.py`` at 36fdf39c / 622284e3 / a81aeea1 / 0b1520f0 /
951c7659, the current one):

- a dimension: ``name`` (``t``, ``bs``, ``h``, ``d``), a fused one ``(num_heads*head_dim)``, or ``1``
  (a squeezed singleton);
- its parallel modifiers, current grammar ``h[tp]``, ``s[cp:zigzag]``, ``h[tp:partial]``,
  ``s[cp:zigzag+partial]``, ``h[tp,ep]`` (``axis`` or ``axis:qualifier+qualifier``), older grammar
  ``h(tp)``, ``h(tp,partial)``, ``s(cp,zigzag)``. Axes: ``tp``, ``cp``, ``ep``, ``sp``,
  ``recompute_pseudo``; qualifiers: ``zigzag``/``natural`` (ordering), ``partial`` (the ranks hold
  partial sums, reduced by summing), ``sharded`` (the default, accepted);
- the declaration part after ``#``: ``dp:=<group>`` (a data-parallel group alias) and
  ``<axis>:replicated`` (the ranks of that axis hold equal copies).

Anything else (an unknown axis or qualifier, a fused dim of one name, ``(tp)`` as a dimension, a
duplicate name or axis, an axis both sharded and declared replicated) is a one-line
:class:`~tracer.errors.TracerError` naming the token, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tracer.errors import TracerError

AXES = ("tp", "cp", "ep", "sp", "recompute_pseudo")
ORDERINGS = ("zigzag", "natural")
REDUCTIONS = ("partial",)

_NAME = r"[A-Za-z_]\w*"
_SINGLE = re.compile(rf"^(?P<name>{_NAME})(?:\[(?P<new>[^\]]+)\]|\((?P<old>[^)]+)\))?$")
_FUSED = re.compile(r"^\((?P<inner>[^)]+)\)(?:\[(?P<new>[^\]]+)\])?$")
_DP_ALIAS = re.compile(r"^dp:=(\w+)$")
_REPLICATED = re.compile(r"^(\w+):replicated$")
EXAMPLE = "e.g. 't h[tp]', 'bs h[tp:partial]', 't (num_heads*head_dim)[tp] # dp:=moe_dp'"


@dataclass(frozen=True)
class Modifier:
    """One parallel axis of a dimension: ``tp``, with an ordering (``zigzag``) and/or ``partial``."""

    axis: str
    ordering: str | None = None
    reduction: str | None = None


@dataclass(frozen=True)
class Dim:
    """One dimension: its name (``h``, ``num_heads*head_dim``, ``1``) and parallel modifiers."""

    name: str
    modifiers: tuple[Modifier, ...] = ()

    def axis(self, axis: str) -> Modifier | None:
        return next((m for m in self.modifiers if m.axis == axis), None)


@dataclass(frozen=True)
class DimsSpec:
    """A parsed dims string: one :class:`Dim` per tensor dimension, the ``#`` declarations."""

    dims: tuple[Dim, ...]
    dp_group_alias: str | None = None
    replicated_axes: frozenset[str] = field(default_factory=frozenset)

    def tp(self) -> tuple[int, bool] | None:
        """``(dim index, partial)`` of the dimension carrying the ``tp`` axis, or None (no TP axis).
        ``partial``: the ranks hold partial sums of the whole tensor (summed, not concatenated)."""
        for i, d in enumerate(self.dims):
            m = d.axis("tp")
            if m is not None:
                return i, m.reduction == "partial"
        return None

    def other_axes(self) -> list[str]:
        """``s[cp]``-style shardings over axes other than TP (tracer reads TP ranks only)."""
        return [f"{d.name}[{m.axis}]" for d in self.dims for m in d.modifiers if m.axis != "tp"]


def _bad(dims: str, where: str, why: str) -> TracerError:
    return TracerError(f"dims {dims!r}{f' of {where}' if where else ''}: {why}; write it in SGLang's dims grammar, {EXAMPLE}")


def _modifier(token: str, text: str, new: bool, dims: str, where: str) -> Modifier:
    if new:
        axis, _, quals = text.partition(":")
        parts = [q.strip() for q in quals.split("+") if q.strip()]
    else:  # the older grammar: h(tp,partial) - one modifier token per axis, ordering or reduction
        axis, parts = text, []
    axis = axis.strip()
    if axis not in AXES:
        raise _bad(dims, where, f"unknown axis {axis!r} in {token!r} (axes: {', '.join(AXES)})")
    ordering = reduction = None
    for q in parts:
        if q == "sharded":
            continue
        if q in ORDERINGS and ordering is None:
            ordering = q
        elif q in REDUCTIONS and reduction is None:
            reduction = q
        else:
            raise _bad(dims, where, f"unknown or repeated qualifier {q!r} in {token!r} "
                                    f"(qualifiers: {', '.join(ORDERINGS + REDUCTIONS)}, sharded)")
    return Modifier(axis, ordering, reduction)


def _modifiers(token: str, new: str | None, old: str | None, dims: str, where: str) -> tuple[Modifier, ...]:
    if new is not None:
        mods = [_modifier(token, p.strip(), True, dims, where) for p in new.split(",")]
    elif old is not None:  # "tp,partial", "cp,zigzag": axes, then qualifiers that apply to the axis
        mods = []
        for p in (x.strip() for x in old.split(",")):
            if p in ORDERINGS + REDUCTIONS:
                if not mods:
                    raise _bad(dims, where, f"qualifier {p!r} before any axis in {token!r}")
                m = mods[-1]
                if (p in ORDERINGS and m.ordering) or (p in REDUCTIONS and m.reduction):
                    raise _bad(dims, where, f"repeated qualifier {p!r} in {token!r}")
                mods[-1] = Modifier(m.axis, m.ordering or (p if p in ORDERINGS else None),
                                    m.reduction or (p if p in REDUCTIONS else None))
            else:
                mods.append(_modifier(token, p, False, dims, where))
    else:
        return ()
    axes = [m.axis for m in mods]
    if len(axes) != len(set(axes)):
        raise _bad(dims, where, f"an axis repeats in {token!r}")
    return tuple(mods)


def parse_dims(dims: str, where: str = "") -> DimsSpec:
    """Parse a dims string (both grammars; see the module docstring).

    Args:
        dims: ``"t h[tp]"``, ``"bs h[tp:partial]"``, ``"t h(tp,partial)"``, ``"b s h # dp:=moe_dp"``.
        where: the file it came from, for the error.

    Raises:
        TracerError: not a string, empty, an unknown token, axis or qualifier, a duplicate name or
            axis, a declaration that is neither ``dp:=<group>`` nor ``<axis>:replicated``, an axis
            both sharded and replicated (one line naming the token).
    """
    if not isinstance(dims, str):
        raise _bad(str(dims)[:60], where, f"dims must be a string, not {type(dims).__name__}")
    shape, _, decl = dims.partition("#")
    if not shape.strip():
        raise _bad(dims, where, "no dimension before '#'")
    out: list[Dim] = []
    for token in shape.split():
        if token == "1":
            out.append(Dim("1"))
            continue
        fused = _FUSED.match(token)
        if fused is not None:
            names = [s.strip() for s in fused.group("inner").split("*")]
            if len(names) < 2 or not all(re.fullmatch(_NAME, n) for n in names) or len(set(names)) != len(names):
                raise _bad(dims, where, f"unknown token {token!r} (a fused dimension is '(a*b)' of two or more "
                                        "distinct names; a parallel axis goes in brackets after a name: 'h[tp]')")
            out.append(Dim("*".join(names), _modifiers(token, fused.group("new"), None, dims, where)))
            continue
        single = _SINGLE.match(token)
        if single is None:
            raise _bad(dims, where, f"unknown token {token!r}")
        out.append(Dim(single.group("name"), _modifiers(token, single.group("new"), single.group("old"), dims, where)))
    names = [n for d in out if d.name != "1" for n in d.name.split("*")]
    if len(names) != len(set(names)):
        raise _bad(dims, where, f"duplicate dimension name(s) {sorted({n for n in names if names.count(n) > 1})}")
    alias, replicated = None, set()
    for token in decl.split():
        m = _DP_ALIAS.match(token)
        if m is not None and alias is None:
            alias = m.group(1)
            continue
        r = _REPLICATED.match(token)
        if r is not None and r.group(1) in AXES and r.group(1) not in replicated:
            replicated.add(r.group(1))
            continue
        raise _bad(dims, where, f"unknown declaration {token!r} after '#' (expected 'dp:=<group>' or '<axis>:replicated')")
    both = replicated & {m.axis for d in out for m in d.modifiers}
    if both:
        raise _bad(dims, where, f"axis {sorted(both)[0]!r} is both sharded (in a dimension) and declared replicated")
    return DimsSpec(tuple(out), alias, frozenset(replicated))


def check_rank(spec: DimsSpec, ndim: int, dims: str, where: str = "") -> None:
    """Refuse a dims string whose number of dimensions is not the tensor's.

    Raises:
        TracerError: ``len(spec.dims) != ndim``.
    """
    if len(spec.dims) != ndim:
        raise _bad(dims, where, f"it names {len(spec.dims)} dimension(s) but the tensor has {ndim}")
