"""Joining one engine tensor's TP shards into the whole tensor an HF capture point holds.

Used by :mod:`tracer.engines.dumps.namemap`. The ranks' copies of one (module, element, step) are
checked (every rank of the TP group, one shape and dtype) and joined as their ``dims``
(:mod:`tracer.execute.dims`) or the map rule say: concatenated along the TP dim (column-parallel),
added in float64 (``tp:partial``: partial sums before the all-reduce), concatenated along the
sequence (Megatron's sequence parallelism), or kept once when the ranks hold equal copies. A fused
output (q/k/v, gate/up, Megatron's query groups) is split into its HF parts on every rank first.
"""

from __future__ import annotations

from typing import Any

import torch

from tracer.errors import TracerError
from tracer.execute.records import DumpEntry


#: the start of the note of a replicated point whose TP ranks hold different values: taken as partial
#: sums (float64 sum); :func:`tracer.diff.compare_dump.compare_dump` checks the sum against the reference
UNMARKED_PARTIAL = "ranks differ although no dims mark them partial"


def _tp_of_dims(first: DumpEntry, ndim: int) -> tuple[int | None, bool, bool, str]:
    """``(dim, partial, replicated, note)`` of the TP axis in the entry's ``dims``
    (:mod:`tracer.execute.dims`): the dim it shards (None: no TP axis), whether the ranks hold partial
    sums, whether ``# tp:replicated`` declares equal copies, and a note naming what the dims say
    beyond TP (other parallel axes, a ``dp:=`` group), which tracer does not unshard ("" if none).

    Raises:
        TracerError: a dims string that does not parse, or names another number of dimensions.
    """
    from tracer.execute.dims import check_rank, parse_dims

    if first.dims is None or first.dims == "":
        return None, False, False, ""
    spec = parse_dims(first.dims, first.file)
    check_rank(spec, ndim, first.dims, first.file)
    dim, partial = spec.tp() or (None, False)
    beyond = spec.other_axes() + ([f"dp:={spec.dp_group_alias}"] if spec.dp_group_alias else [])
    note = f"dims also say {', '.join(beyond)}: tracer joins TP ranks only" if beyond else ""
    return dim, partial, "tp" in spec.replicated_axes, note


def _unshard(shards: dict[int, DumpEntry], rule: dict[str, Any], what: str) -> tuple[list[torch.Tensor], str]:
    """Join one (module, element, step)'s TP shards; returns the parts (one, or the split parts) and a note.

    ``h[tp]`` / ``h(tp)`` (or a column-parallel rule): concatenated along that dim; ``h[tp:partial]``
    / ``h(tp,partial)``: the ranks' partial sums added in float64 (kept in float64: the comparison
    then says how it compares with the reference's dtype); no TP axis: the ranks must hold equal
    copies, else their float64 sum is kept with a note starting with :data:`UNMARKED_PARTIAL` (the
    comparison decides whether they were partial sums).

    Raises:
        TracerError: missing ranks, shapes/dtypes that differ, a bad dims string.
    """
    first = next(iter(shards.values()))
    size = first.tp_size
    ranks = sorted(shards)
    if len(ranks) != size or ranks != list(range(len(ranks))):  # never a list of tp_size items: the meta is input
        raise TracerError(f"inconsistent shards: {what} has TP ranks {ranks} of tp_size {size} ({first.file}); "
                          "dump every rank of the TP group")
    sizes = sorted({e.tp_size for e in shards.values()})
    if len(sizes) > 1:
        raise TracerError(f"inconsistent shards: the TP ranks of {what} disagree on tp_size ({sizes}; {first.file}); "
                          "dump every rank of one TP group")
    ts = [shards[r].tensor for r in ranks]
    if any(t.shape != ts[0].shape or t.dtype != ts[0].dtype for t in ts):
        shapes = ", ".join(f"rank {r}: {tuple(t.shape)} {t.dtype}" for r, t in zip(ranks, ts))
        raise TracerError(f"inconsistent shards: {what} has different shapes/dtypes across TP ranks ({shapes})")
    dim, partial, replicated, beyond = _tp_of_dims(first, ts[0].dim())
    parts, note = _join(ts, rule, dim, partial, replicated, size, what, first.file, first.sp)
    return parts, "; ".join(x for x in (note, beyond) if x)


def _join(ts: list[torch.Tensor], rule: dict[str, Any], dim: int | None, partial: bool, replicated: bool, size: int,
          what: str, file: str, sp: bool = False) -> tuple[list[torch.Tensor], str]:
    """:func:`_unshard`'s joining of checked shards ``ts`` (rank order); ``sp``: Megatron's sequence
    parallelism (outside the TP regions each rank holds a slice of the sequence)."""
    split = rule.get("split")
    if partial:
        # "h[tp:partial]": each rank holds a partial sum (before the all-reduce); SGLang's comparator adds them
        total = torch.stack([t.to(torch.float64) for t in ts]).sum(0)
        parts = [total] if split is None else _split(total, rule, total.dim() - 1, 1, what)
        return parts, f"{size} TP partial sums added (float64, kept in float64)"
    if dim is None and rule.get("shard") == "columns" and not replicated:
        dim = ts[0].dim() - 1
    if dim is None and sp and size > 1:
        # Megatron sequence parallelism: outside the TP regions each rank holds its slice of the sequence, [s/tp, b, ...]
        whole = torch.cat(ts, dim=0)
        note = f"{size} sequence-parallel shards along the sequence"
        return ([whole] if split is None else _split(whole, rule, whole.dim() - 1, 1, what)), note
    if size == 1 or dim is None:
        if size > 1 and any(not _same_bits(t, ts[0]) for t in ts[1:]):
            if replicated:
                raise TracerError(f"inconsistent shards: {what} is declared '# tp:replicated' but the {size} ranks "
                                  f"hold different values ({file})")
            total = torch.stack([t.to(torch.float64) for t in ts]).sum(0)
            parts = [total] if split is None else _split(total, rule, total.dim() - 1, 1, what)
            return parts, (f"{UNMARKED_PARTIAL}: the {size} ranks' float64 sum is compared "
                           f"(replicated by its map, no TP axis in its dims; {file})")
        if split is not None:  # one rank (or replicated copies) of a fused output: split it all the same
            return _split(ts[0], rule, ts[0].dim() - 1 if dim is None else dim, 1, what), ""
        return [ts[0]], ""
    note = f"{size} TP shards along dim {dim}"
    if split is None:
        return [torch.cat(ts, dim=dim)], note
    return [torch.cat(list(parts), dim=dim) for parts in zip(*[_split(t, rule, dim, size, what) for t in ts])], note


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included, -0.0 != 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _split(t: torch.Tensor, rule: dict[str, Any], dim: int, tp: int, what: str) -> list[torch.Tensor]:
    if rule.get("split") == "qkv_groups":
        return _split_groups(t, rule, dim, tp, what)
    sizes = [s // tp for s in rule["_sizes"]]
    if sum(sizes) != t.shape[dim] or any(s * tp != full for s, full in zip(sizes, rule["_sizes"])):
        raise TracerError(f"{what}: width {t.shape[dim]} on each of {tp} ranks does not split into "
                          f"{rule['_sizes']} (the HF widths) / {tp}; check the map's split or the model")
    return list(torch.split(t, sizes, dim=dim))


def _split_groups(t: torch.Tensor, rule: dict[str, Any], dim: int, tp: int, what: str) -> list[torch.Tensor]:
    """One TP rank's Megatron ``linear_qkv`` output, ``[..., groups/tp × (q + k + v) / groups]`` with
    each query group's ``[q heads of the group | k head | v head]`` side by side, → its q, k, v
    parts (``[..., groups/tp × width / groups]`` each, heads in order)."""
    groups, widths = rule["_groups"], rule["_sizes"]
    per = [w // groups for w in widths]
    if groups % tp or any(p * groups != w for p, w in zip(per, widths)):
        raise TracerError(f"{what}: {groups} query groups do not split q/k/v widths {widths} over {tp} TP ranks; "
                          "check the model's KV heads ([engine] kv_heads in a --map file)")
    g = groups // tp
    x = t.movedim(dim, -1)
    if x.shape[-1] != g * sum(per):
        raise TracerError(f"{what}: width {x.shape[-1]} on each of {tp} ranks is not {g} query groups of {sum(per)} "
                          f"(q, k, v widths {widths} over {groups} groups); check the map's split or the model")
    x = x.reshape(*x.shape[:-1], g, sum(per))
    return [p.reshape(*p.shape[:-2], g * w).movedim(-1, dim) for p, w in zip(torch.split(x, per, dim=-1), per)]


#: what one TP rank holds of a point (:func:`join_ranks`)
RANK_HOLDS = ("whole", "columns", "partial", "halves")


def join_ranks(ts: list[torch.Tensor], holds: str, what: str, sizes: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, str, bool]:
    """One point's tensors of every TP rank (rank order, one shape and dtype) joined by the rules
    the dump import applies (:func:`_join`), for a capture taken in each rank of a live engine.

    Args:
        ts: rank r's ``[T, width_r]`` tensor at ``ts[r]``.
        holds: ``whole`` (every rank computed the same tensor after its all-reduce: rank 0's is
            kept, the others compared with it bit for bit), ``columns`` (column shards,
            concatenated along the last dim), ``partial`` (partial sums: added in float64, the
            sum rounded to the ranks' dtype), ``halves`` (each rank ``[its part of A | its part of
            B]``, e.g. keys and values: A's shards then B's).
        what: the point and step, for messages.
        sizes: ``halves``: the whole widths of A and B.

    Returns:
        ``(tensor, note, equal)``: the whole tensor, a note naming the join ("" for ``whole``), and
        whether the ranks held equal bits (``whole`` only; True otherwise).

    Raises:
        TracerError: an unknown ``holds``, shapes/dtypes that differ across ranks, widths that do
            not split (one line).
    """
    if holds not in RANK_HOLDS:
        raise TracerError(f"{what}: unknown TP layout {holds!r}; use one of {', '.join(RANK_HOLDS)}")
    if holds == "halves" and not sizes:
        raise TracerError(f"{what}: a TP join of halves needs the whole widths of both halves")
    if any(t.shape != ts[0].shape or t.dtype != ts[0].dtype for t in ts):
        shapes = ", ".join(f"rank {r}: {tuple(t.shape)} {t.dtype}" for r, t in enumerate(ts))
        raise TracerError(f"inconsistent shards: {what} has different shapes/dtypes across TP ranks ({shapes})")
    if holds == "whole":
        return ts[0], "", all(_same_bits(t, ts[0]) for t in ts[1:])
    rule: dict[str, Any] = {"halves": {"split": "halves", "_sizes": list(sizes or ())}, "columns": {"shard": "columns"}}.get(holds, {})
    dim = None if holds == "partial" else ts[0].dim() - 1
    parts, note = _join(ts, rule, dim, holds == "partial", False, len(ts), what, "")
    whole = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    if holds == "partial":
        return whole.to(ts[0].dtype), f"{len(ts)} TP partial sums added in float64, rounded to {ts[0].dtype}", True
    return whole, note, True
