"""Token alignment of an engine dump: which rows of each step hold which positions of the reference prompt.

Used by :mod:`tracer.engines.dumps.namemap`. A step's ``input_ids`` (and ``positions``, when dumped) are
cut into runs of consecutive positions (one per request of a batch, one per packed sequence),
each kept where its ids equal the reference's; Megatron's ``[s, b, ...]`` activations are
flattened in the order of the step's ``[b, s]`` ids. Nothing is dropped silently: rows left out
are counted in notes.
"""

from __future__ import annotations

from typing import Any

import torch

from tracer.errors import TracerError
from tracer.execute.records import RawDump


def segments(ids: torch.Tensor, positions: torch.Tensor | None) -> list[tuple[int, int, int | None]]:
    """``(row0, row1, pos0)`` runs of consecutive positions (one per request in a batch)."""
    if positions is None:
        return [(0, len(ids), None)]
    if len(positions) != len(ids):
        raise TracerError(f"a step has {len(ids)} input_ids but {len(positions)} positions; the dump is inconsistent")
    cuts = [0] + [i for i in range(1, len(ids)) if int(positions[i]) != int(positions[i - 1]) + 1] + [len(ids)]
    return [(a, b, int(positions[a])) for a, b in zip(cuts, cuts[1:])]


def _find(ref: list[int], seg: list[int], after: int | None) -> int | None:
    """Start of ``seg`` in ``ref``: right after the previous step if it fits, else the last occurrence."""
    n = len(seg)
    if n == 0:
        return None
    if after is not None and ref[after:after + n] == seg:
        return after
    hits = [i for i in range(len(ref) - n + 1) if ref[i:i + n] == seg]
    return hits[-1] if hits else None


def align_steps(raw: RawDump, ref_ids: list[int]) -> tuple[dict[int, list[tuple[int, int, int]]], list[str]]:
    """Which rows of each step hold which absolute positions of the reference prompt.

    Steps are taken in order (chunked prefill: consecutive steps continue each other); within a
    step, runs of consecutive ``positions`` are requests of a batch, kept when their token ids
    equal the reference's at those positions (a run whose ids equal the reference's for its first
    k tokens only keeps those k: a request sharing the reference's prefix, a packed sequence
    followed by padding); without ``positions`` a step's ids are located in the reference prompt
    (right after the previous step when they fit there, else the last occurrence: a cache hit
    computes a suffix). Rows left out are counted in the notes (other requests, decode rows
    beyond the reference), one line per kind.

    Returns:
        ``({step: [(row0, row1, pos0), ...]}, notes)``.

    Raises:
        TracerError: a step without ``input_ids``, or no request whose token ids match the reference.
    """
    plan: dict[int, list[tuple[int, int, int]]] = {}
    notes: list[str] = []
    left: dict[str, list[str]] = {"beyond": [], "other": [], "prefix": []}
    steps = sorted({e.step for e in raw.entries})
    # steps without positions are located together (chunked prefill: one contiguous run of the
    # prompt), so a chunk whose ids recur in the prompt is not placed on another occurrence
    loose = [raw.tokens[s]["input_ids"].tolist() for s in steps
             if s in raw.tokens and raw.tokens[s].get("input_ids") is not None and raw.tokens[s].get("positions") is None]
    after = _find(ref_ids, [t for ids in loose for t in ids], None) if len(loose) > 1 else None
    for step in steps:
        tok = raw.tokens.get(step)
        if tok is None or tok.get("input_ids") is None:
            raise TracerError(f"{raw.path}: step {step} has activations but no input_ids; dump the token ids "
                              "(SGLang dumper core field input_ids, or input_ids in a tensors file)")
        ids = tok["input_ids"].tolist()
        for a, b, pos in segments(tok["input_ids"], tok.get("positions")):
            seg = ids[a:b]
            k = len(seg)
            if pos is not None and ref_ids[pos:pos + len(seg)] != seg:
                k = next((i for i, t in enumerate(seg) if pos + i >= len(ref_ids) or ref_ids[pos + i] != t), len(seg))
            if pos is not None and k:
                start = pos
                if k < len(seg):
                    left["prefix"].append(f"step {step} rows {a}..{b - 1} (positions {pos}..{pos + len(seg) - 1}) equal the "
                                          f"reference's for their first {k}")
            elif pos is None:
                start = _find(ref_ids, seg, after)
            else:
                start = None
            if start is None:
                where = f"step {step} rows {a}..{b - 1} (" + (f"positions {pos}..{pos + len(seg) - 1}" if pos is not None
                                                              else f"{len(seg)} tokens") + f", first id {seg[0]})"
                left["beyond" if pos is not None and pos >= len(ref_ids) else "other"].append(where)
                continue
            plan.setdefault(step, []).append((a, a + k, start))
            after = start + k
    notes += _left_notes(left, len(ref_ids))
    if not plan:
        raise TracerError(f"{raw.path}: token ids do not match the reference prompt in any step "
                          f"({'; '.join(n.split(':')[0] for n in notes[:3])}); compare a dump of the same prompt")
    return plan, notes


def _left_notes(left: dict[str, list[str]], n_ref: int) -> list[str]:
    """One note per kind of rows :func:`align_steps` left out, with the first few of them."""
    what = {"beyond": f"beyond the reference's {n_ref} tokens (decode steps or padding past it); not compared",
            "other": "token ids not the reference's at those positions (other requests); not compared",
            "prefix": "only those compared (a request sharing the reference's prefix, or padding after it)"}
    out = []
    for kind, rows in left.items():
        if rows:
            more = f" ... ({len(rows)} runs in all)" if len(rows) > 3 else ""
            out.append(f"{'; '.join(rows[:3])}{more}: {what[kind]}")
    return out


def token_rows(t: torch.Tensor, layout: str, slot: dict[str, Any], what: str) -> torch.Tensor:
    """``t`` with its token dims flattened in the order of the step's ``input_ids``: ``sb``
    (Megatron's ``[s, b, ...]``) is transposed to ``[b, s, ...]`` first; a tensor whose first dim
    already holds every token (THD: ``[t, ...]``) is kept.

    Raises:
        TracerError: leading dims that match neither the layout nor the token count.
    """
    n = len(slot["input_ids"])
    if layout == "t":
        return t
    b, s = slot.get("shape") or (1, n)
    if layout == "sb" and t.dim() >= 3 and tuple(t.shape[:2]) == (s, b):
        return t.transpose(0, 1).reshape(n, *t.shape[2:])
    if layout == "bs" and t.dim() >= 3 and tuple(t.shape[:2]) == (b, s):
        return t.reshape(n, *t.shape[2:])
    if t.dim() >= 1 and t.shape[0] == n:  # THD: [t, ...], one token dim
        return t
    raise TracerError(f"{what} has shape {tuple(t.shape)} but the step's input_ids are [b={b}, s={s}] and the map says "
                      f"tokens = {layout!r}; the dump's activations and token ids disagree")


def ranges(ps: list[int]) -> str:
    """``[0, 1, 2, 7]`` → ``"0..2, 7"``."""
    out, start = [], None
    for i, p in enumerate(ps):
        if start is None:
            start = p
        if i + 1 == len(ps) or ps[i + 1] != p + 1:
            out.append(f"{start}..{p}" if p != start else f"{p}")
            start = None
    return ", ".join(out) or "none"


__all__ = ["segments", "align_steps", "token_rows", "ranges"]
