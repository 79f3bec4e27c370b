"""Assembling what :class:`~tracer.engines.vllm.capture.VllmCapture`'s hooks kept into capture records.

Each HF point's rows of every step, in position order (the first computation of a position wins;
a later one that differs is named in the notes), on the device the hooks kept them on; the logits
where the followed requests computed them (whole when every compared position has a row, else
partial: vLLM computes logits only where it samples); each layer's KV cache over positions
0..N-1. What could not be captured is listed with the reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint
from tracer.engines.dumps.namemap import MappedDump
from tracer.engines.dumps.tokens import ranges
from tracer.execute.records import CaptureRecord

_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def records(cap: Any, points: list[CapturePoint], engine: str) -> tuple[dict[str, CaptureRecord], dict[str, Any]]:
    """The run's captures under HF names, and what could not be captured (``cap``: a
    :class:`~tracer.engines.vllm.capture.VllmCapture` after its run).

    Returns:
        ``(captures, info)``: captures in the reference's execution order, each ``(T, *feature)``
        over the whole window (``kv_cache``: ``(N, keys + values)``), in vLLM's dtype, on vLLM's
        device; ``info`` = ``{"mapping": {hf: "vLLM source (what was split/summed)"},
        "not_captured": {hf: reason}, "partial_logits": {hf: (positions, (k, vocab) tensor)},
        "notes": [...]}``.

    Raises:
        TracerError: the hooks saw no compared position of the traced prompt (capture
            impossible: a compiled or graph-captured model, or a window vLLM served from its
            prefix cache), or a window position that no forward pass computed.
    """
    w0, w1 = cap.window
    seen = np.unique(np.concatenate(list(cap._win_pos.values()))) if cap._win_pos else np.zeros(0, dtype=np.int64)
    if not len(seen):
        raise TracerError(f"the hooks inside vLLM saw no position {w0}..{w1 - 1} of the traced prompt "
                          f"({len(cap.steps)} forward passes); torch.compile or CUDA graphs hide modules "
                          "from hooks, and a prefix-cache hit skips cached positions: run vLLM eager and check the plan")
    if len(seen) != w1 - w0:
        computed = sorted({p for s in cap.steps for t in s["traced"] for p in range(*t["positions"])})
        raise TracerError(f"vLLM computed positions {ranges(seen.tolist())} of the compared {w0}..{w1 - 1} (the traced "
                          f"requests computed {len(computed)} prompt positions); it served the rest from its "
                          "prefix cache: reset it, or plan the cached prefix to end at the window")
    tensors, conflicts = {}, {}
    for name, chunks in cap.rows.items():
        tensors[name] = _stack(cap, name, chunks, conflicts)
    notes = list(cap.notes) + _conflict_notes(cap, conflicts)
    partial, full = _logits_records(cap)
    tensors.update(full)
    mapped = MappedDump(engine=engine, path="vLLM (in-process hooks)", positions=(w0, w1), tensors=tensors,
                        mapping={n: cap.sources[n][1] for n in tensors if n in cap.sources}, notes=notes,
                        partial_logits={n: (ps, t, cap.sources.get(n, ("", n))[1]) for n, (ps, t) in partial.items()})
    return _assemble(cap, points, mapped)

def _stack(cap: Any, name: str, chunks: list[tuple[int, torch.Tensor]], conflicts: dict[str, list]) -> torch.Tensor:
    """One point's rows of every step, in position order (the first computation of a position
    wins; later ones are compared with it on the device)."""
    pos = np.concatenate([cap._win_pos[s] for s, _t in chunks])
    t = chunks[0][1] if len(chunks) == 1 else torch.cat([c for _s, c in chunks])
    w0, w1 = cap.window
    if len(pos) == w1 - w0 and np.array_equal(pos, np.arange(w0, w1)):
        return t.contiguous()
    uniq, first = np.unique(pos, return_index=True)
    index = torch.as_tensor(first, device=t.device)
    if len(first) < len(pos):  # a position computed twice (a recomputed request): the first is kept
        again = np.setdiff1d(np.arange(len(pos)), first)
        ref = torch.as_tensor(first[np.searchsorted(uniq, pos[again])], device=t.device)
        iv = _INT[t.element_size()]
        differs = (t.index_select(0, ref).view(iv) != t.index_select(0, torch.as_tensor(again, device=t.device)).view(iv))
        conflicts.setdefault(name, []).append((pos[again], differs.reshape(len(again), -1).any(dim=1)))
    return t.index_select(0, index)

def _conflict_notes(cap: Any, conflicts: dict[str, list]) -> list[str]:
    """Notes for later sources that differ from the first (one host transfer for all flags)."""
    flags = [f for _n, _s, f in cap.checks] + [f for items in conflicts.values() for _p, f in items]
    if not flags:
        return []
    host = torch.cat([f.reshape(-1) for f in flags]).cpu().numpy()
    out: dict[str, list[int]] = {}
    i = 0
    for name, step, _f in cap.checks:
        if host[i]:
            out.setdefault(name, []).extend(int(p) for p in cap._win_pos[step])
        i += 1
    for name, items in conflicts.items():
        for ps, f in items:
            out.setdefault(name, []).extend(int(p) for p, d in zip(ps, host[i:i + f.numel()]) if d)
            i += f.numel()
    return [f"{name} at position(s) {ranges(sorted(set(ps)))}: a later engine tensor mapped there differs from the "
            "first; the first is compared" for name, ps in out.items() if ps]


def _logits_records(cap: Any) -> tuple[dict[str, tuple[list[int], torch.Tensor]], dict[str, torch.Tensor]]:
    """The traced requests' logits at compared positions: whole (every compared position has
    a row) or partial (vLLM computes logits only where it samples)."""
    name = cap.logits_name
    if name is None:
        return {}, {}
    w0, w1 = cap.window
    got: dict[int, torch.Tensor] = {}
    for _step, where, last, rows in cap.logits:
        for label, i in where.items():
            p = int(last[i])
            if label in cap.traced_labels and w0 <= p < w1 and p < cap.n:
                got.setdefault(p, rows[i])
    if not got:
        return {}, {}
    ps = sorted(got)
    rows = torch.stack([got[p] for p in ps])
    vocab = cap.ref.names[name][2]
    if rows.dim() == 2 and len(vocab) == 1 and rows.shape[1] > vocab[0]:
        cap.notes.append(f"{name}: vLLM's {rows.shape[1]} logits columns cut to the reference's vocabulary of "
                          f"{vocab[0]} (the padding columns are not tokens)")
        rows = rows[:, :vocab[0]]
    if ps == list(range(w0, w1)):
        return {}, {name: rows}
    return {name: (ps, rows)}, {}

def _assemble(cap: Any, points: list[CapturePoint], mapped: MappedDump) -> tuple[dict[str, CaptureRecord], dict[str, Any]]:
    by_name = {p.name: p for p in points}
    captures: dict[str, CaptureRecord] = {}
    not_captured: dict[str, str] = {}
    for name, (kind, op, _feat, _dtype) in cap.ref.names.items():
        point = by_name.get(name)
        op = point.op if point is not None else op
        if kind == PointKind.KV_CACHE:
            rec, why = _kv_record(cap, point)
            if rec is None:
                not_captured[name] = why
            else:
                captures[name] = rec
            continue
        if name in mapped.tensors:
            t = mapped.tensors[name]
            feat = cap.ref.names[name][2]
            if tuple(t.shape[1:]) != tuple(feat) and t[0].numel() == int(np.prod(feat)):
                t = t.reshape(t.shape[0], *feat)
            captures[name] = CaptureRecord(name=name, kind=kind, tensor=t.contiguous(), calls=_calls(cap, name),
                                           op=op, role=point.role if point is not None else "")
        elif name in mapped.partial_logits:
            ps = mapped.partial_logits[name][0]
            not_captured[name] = (f"vLLM computes logits only where it samples (each request's last scheduled "
                                  f"token): position(s) {', '.join(map(str, ps))} of the compared "
                                  f"{cap.window[0]}..{cap.window[1] - 1}; compared there on their own")
        else:
            not_captured[name] = "no vLLM module computes it (engine map: no rule maps a vLLM tensor here)"
    only_ref = [n for n, (k, *_r) in cap.ref.names.items() if n not in captures and k != PointKind.KV_CACHE
                and n not in mapped.partial_logits]
    notes = list(mapped.notes)
    if only_ref:
        notes.append(f"capture points only in the reference (no engine tensor): {', '.join(only_ref[:8])}"
                     f"{f' ... ({len(only_ref)} in all)' if len(only_ref) > 8 else ''}")
    info = {"mapping": dict(mapped.mapping), "not_captured": not_captured, "notes": notes,
            "partial_logits": {n: (list(ps), t) for n, (ps, t, _src) in mapped.partial_logits.items()}}
    for n, (_ps, _t, src) in mapped.partial_logits.items():
        info["mapping"][n] = src
    return captures, info

def _calls(cap: Any, name: str) -> list[dict[str, Any]]:
    """The forward calls of the vLLM module a point came from: positions of the traced prompt
    it computed, and the flattened shapes the module saw (all requests of the step: GEMM M =
    the step's tokens)."""
    source = cap.sources.get(name, ("", ""))[0]
    return [{"positions": c["positions"], "in": c["in"], "out": c["out"]}  # shapes as HF capture records them
            for c in cap.shapes.get(source, []) if c["positions"]]

def _kv_record(cap: Any, point: CapturePoint | None) -> tuple[CaptureRecord | None, str]:
    """The ``kv_cache`` point of one layer: keys then values of positions 0..N-1, as vLLM wrote
    them into its paged cache (the attention layer's inputs), or None and the reason."""
    if point is None:
        return None, "not a capture point of this run"
    parts = cap.kv.get(point.layer_index)
    if not parts:
        return None, "the attention layer's key/value inputs were not seen (no hook fired)"
    pos = np.concatenate([p for p, _t in parts])
    uniq, first = np.unique(pos, return_index=True)  # the first computation of a position is the cached one
    if len(uniq) != cap.kv_n:  # every kept position is < kv_n
        missing = sorted(set(range(cap.kv_n)) - set(uniq.tolist()))
        return None, (cap.kv_missing_why or  # a KV hand-over's rows not decoded says so itself
                      f"positions {missing[0]}..{missing[-1]} came from vLLM's prefix cache, filled before this "
                      "run (reset the prefix cache first)")
    t = parts[0][1] if len(parts) == 1 else torch.cat([x for _p, x in parts])
    if not np.array_equal(first, np.arange(len(pos))):  # out of order, or a position computed twice
        t = t.index_select(0, torch.as_tensor(first, device=t.device))
    kv = t.contiguous()  # (N, kv_heads*head_dim*2): keys, values
    call = {"positions": [0, cap.kv_n], "in": [], "out": [list(kv.shape)]}
    return CaptureRecord(name=point.name, kind=PointKind.KV_CACHE, tensor=kv, calls=[call], op=point.op, role=point.role), ""


def settle_records(captures: dict[str, Any], info: dict[str, Any], window: tuple[int, int],
                   keep_on_device: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A vLLM run's records at its end: moved off the device once (unless ``keep_on_device``; the
    comparison wants them elsewhere), ``info["partial_logits"]`` with them, and the logits points'
    facts (``{name: {"positions", "dtype"}}``: partial logits at their positions, full ones over ``window``)."""
    if not keep_on_device:
        captures = {n: replace(c, tensor=c.tensor.cpu()) for n, c in captures.items()}
        info["partial_logits"] = {n: (ps, t.cpu()) for n, (ps, t) in info["partial_logits"].items()}
    logits = {n: {"positions": ps, "dtype": str(t.dtype).replace("torch.", "")} for n, (ps, t) in info["partial_logits"].items()}
    logits.update({n: {"positions": list(range(*window)), "dtype": str(c.tensor.dtype).replace("torch.", "")}
                   for n, c in captures.items() if c.kind == PointKind.LOGITS})
    return captures, logits


__all__ = ["records", "settle_records"]
