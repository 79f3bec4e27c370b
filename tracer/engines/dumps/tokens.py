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


#: the most requests (runs of consecutive positions) one step may hold; a step with more is refused
#: before any per-request work (engines batch hundreds to a few thousand requests per step)
MAX_REQUESTS = 1 << 16
#: the most requests of one step that may hold the reference's token ids (copies of the traced
#: request, e.g. a batch-invariance run); their rows are placed position by position
MAX_COPIES = 1024


def segments(ids: torch.Tensor, positions: torch.Tensor | None, what: str = "a step") -> list[tuple[int, int, int | None]]:
    """``(row0, row1, pos0)`` runs of consecutive positions (one per request in a batch), found with
    vectorised torch ops (linear in the rows, no per-row Python).

    Raises:
        TracerError: ``positions`` and ``ids`` of different lengths, or more than
            :data:`MAX_REQUESTS` runs (``what`` names the step).
    """
    if positions is None:
        return [(0, len(ids), None)]
    if len(positions) != len(ids):
        raise TracerError(f"{what} has {len(ids)} input_ids but {len(positions)} positions; the dump is inconsistent")
    if len(ids) == 0:
        return []
    pos = positions.reshape(-1).to(torch.long)
    cuts = (torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1)
    if len(cuts) + 1 > MAX_REQUESTS:
        raise TracerError(f"{what} holds {len(cuts) + 1:,} requests (runs of consecutive positions; {len(ids):,} rows); "
                          f"tracer maps at most {MAX_REQUESTS:,} per step: dump the steps of the traced request "
                          "(or a smaller batch)")
    bounds = [0, *cuts.tolist(), len(ids)]
    starts = pos[bounds[:-1]].tolist()
    return [(a, b, p) for a, b, p in zip(bounds, bounds[1:], starts)]


def _matched(ids: torch.Tensor, ref: torch.Tensor, pos: int) -> int:
    """How many leading tokens of ``ids`` (one request, from position ``pos``) equal the reference's."""
    m = max(0, min(len(ids), len(ref) - pos))
    if m == 0:
        return 0
    differ = torch.nonzero(ids[:m] != ref[pos:pos + m]).reshape(-1)
    return int(differ[0]) if len(differ) else m


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
    computes a suffix). A step whose tokens hold ``prompt_ids`` (the whole prompt its rows follow,
    from position 0: a window's hidden-states file) keeps only the rows before that prompt's first
    id other than the reference's. Rows left out are counted in the notes (other requests, decode rows
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
    ref = torch.tensor(ref_ids, dtype=torch.long)
    # steps without positions are located together (chunked prefill: one contiguous run of the
    # prompt), so a chunk whose ids recur in the prompt is not placed on another occurrence; a step
    # longer than the reference is located nowhere (and not turned into a list)
    loose = [raw.tokens[s]["input_ids"] for s in steps
             if s in raw.tokens and raw.tokens[s].get("input_ids") is not None and raw.tokens[s].get("positions") is None]
    fits = len(loose) > 1 and sum(len(x) for x in loose) <= len(ref_ids)
    after = _find(ref_ids, [t for ids in loose for t in ids.tolist()], None) if fits else None
    for step in steps:
        tok = raw.tokens.get(step)
        if tok is None or tok.get("input_ids") is None:
            raise TracerError(f"{raw.path}: step {step} has activations but no input_ids; dump the token ids "
                              "(SGLang dumper core field input_ids, or input_ids in a tensors file)")
        ids = tok["input_ids"]
        # a dump that records the prompt its rows follow (from position 0): rows from its first id
        # other than the reference's on were computed from another prompt
        prompt = tok.get("prompt_ids")
        agree = None if prompt is None else _matched(prompt.reshape(-1).to(torch.long), ref, 0)
        copies = 0
        for a, b, pos in segments(ids, tok.get("positions"), f"{raw.path}: step {step}"):
            n = b - a
            k = n if pos is None else _matched(ids[a:b], ref, pos)
            if agree is not None and pos is not None:
                k = min(k, max(0, agree - pos))
            if pos is not None and k:
                start = pos
                if k < n:
                    left["prefix"].append(f"step {step} rows {a}..{b - 1} (positions {pos}..{pos + n - 1}) equal the "
                                          f"reference's for their first {k}")
            elif pos is None:
                start = _find(ref_ids, ids[a:b].tolist(), after) if n <= len(ref_ids) else None
            else:
                start = None
            if start is None:
                where = f"step {step} rows {a}..{b - 1} (" + (f"positions {pos}..{pos + n - 1}" if pos is not None
                                                              else f"{n} tokens") + f", first id {int(ids[a])})"
                left["beyond" if pos is not None and pos >= len(ref_ids) else "other"].append(where)
                continue
            copies += 1
            if copies > MAX_COPIES:
                raise TracerError(f"{raw.path}: step {step} holds more than {MAX_COPIES:,} requests with the reference's "
                                  "token ids; tracer compares at most that many copies of the traced request per step: "
                                  "dump a smaller batch")
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


def token_rows(t: torch.Tensor, layout: str, slot: dict[str, Any], what: str, ledger: Any = None) -> torch.Tensor:
    """``t`` with its token dims flattened in the order of the step's ``input_ids``: ``sb``
    (Megatron's ``[s, b, ...]``) is transposed to ``[b, s, ...]`` first (a copy when ``b > 1``,
    charged to ``ledger``, the dump's, first); a tensor whose first dim already holds every token
    (THD: ``[t, ...]``) is kept.

    Raises:
        TracerError: leading dims that match neither the layout nor the token count; a copy over
            the input budget.
    """
    n = len(slot["input_ids"])
    if layout == "t":
        return t
    b, s = slot.get("shape") or (1, n)
    if layout == "sb" and t.dim() >= 3 and tuple(t.shape[:2]) == (s, b):
        if ledger is not None and b > 1:
            ledger.charge(t.numel() * t.element_size(), f"{what}: its [s, b] rows reordered as [b, s]")
        return t.transpose(0, 1).reshape(n, *t.shape[2:])
    if layout == "bs" and t.dim() >= 3 and tuple(t.shape[:2]) == (b, s):
        return t.reshape(n, *t.shape[2:])
    if t.dim() >= 1 and t.shape[0] == n:  # THD: [t, ...], one token dim
        return t
    raise TracerError(f"{what} has shape {tuple(t.shape)} but the step's input_ids are [b={b}, s={s}] and the map says "
                      f"tokens = {layout!r}; the dump's activations and token ids disagree")


def ranges(ps: list[int] | range) -> str:
    """``[0, 1, 2, 7]`` → ``"0..2, 7"``; a ``range`` of step 1 is written without a pass over it."""
    if isinstance(ps, range) and ps.step == 1:
        return "none" if not ps else f"{ps.start}..{ps.stop - 1}" if len(ps) > 1 else f"{ps.start}"
    out, start = [], None
    for i, p in enumerate(ps):
        if start is None:
            start = p
        if i + 1 == len(ps) or ps[i + 1] != p + 1:
            out.append(f"{start}..{p}" if p != start else f"{p}")
            start = None
    return ", ".join(out) or "none"


__all__ = ["segments", "align_steps", "token_rows", "ranges", "MAX_REQUESTS", "MAX_COPIES"]
