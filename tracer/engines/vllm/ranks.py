"""Joining the capture states of vLLM's TP ranks into one, as the dump import joins a dump's ranks.

Each worker of a TP-``k`` engine core writes the state of its own capture
(:func:`tracer.engines.vllm.remote.write_rank_file`); :func:`gather_ranks` checks that the ranks
kept the same steps and points and joins them by the engine map's TP rules
(:func:`tracer.engines.dumps.shards.join_ranks`) into the one state the caller's
:class:`~tracer.engines.vllm.capture.VllmCapture` loads. Runs in the caller, never in a worker.
"""

from __future__ import annotations

from typing import Any

import torch

from tracer.errors import TracerError


def _same_chunks(states: dict[int, dict[str, Any]], key: str, name: Any) -> list[list[tuple[Any, torch.Tensor]]]:
    """Every rank's chunks ``states[r][key][name]`` (rank order), checked to be the same steps.

    Raises:
        TracerError: a rank that kept other chunks than rank 0 (one line)."""
    per = [states[r][key].get(name, []) for r in sorted(states)]
    marks = [[c[0] if key == "rows" else len(c[0]) for c in chunks] for chunks in per]
    if any(m != marks[0] for m in marks[1:]):
        bad = next(r for r, m in zip(sorted(states), marks) if m != marks[0])
        raise TracerError(f"TP rank {bad} kept other {key} chunks for {name} than rank 0 ({marks[0]} vs "
                          f"{marks[sorted(states).index(bad)]}); vLLM's ranks run the same steps")
    return per


def gather_ranks(states: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One capture state (:meth:`~tracer.engines.vllm.capture.VllmCapture.state`) from the states
    of every TP rank, each joined by the dump import's TP rules
    (:func:`tracer.engines.dumps.shards.join_ranks`): a point a rank holds a column shard of
    (``tp_shards``: the map's ``shard = "columns"``: fused q/k/v and gate/up parts, the attention
    output, the MLP's activation) concatenated along its width in rank order; a row-parallel
    layer's partial sums (``partial``) added in float64; a point every rank holds whole (the
    embedding, the layers' and the all-reduced ``o_proj``/``down_proj`` outputs, the norms) taken
    from rank 0 and compared with the other ranks bit for bit; the KV cache (each rank's
    ``[keys | values]`` of its KV heads) joined keys with keys and values with values. The step
    facts, tokens and logits are rank 0's (vLLM gathers the logits there). One rank: its state.

    Args:
        states: TP rank → the state that rank's worker wrote
            (:func:`tracer.engines.vllm.remote.read_rank_file`).

    Returns:
        the gathered state; its ``notes`` say which points were joined and whether the whole
        points agreed on every rank (those that did not are named; rank 0's are kept).

    Raises:
        TracerError: ranks missing (not 0..k-1), ranks that kept other steps or shapes (one line).
    """
    from tracer.engines.dumps.shards import join_ranks

    ranks = sorted(states)
    if ranks != list(range(len(ranks))):
        raise TracerError(f"vLLM's workers wrote the capture of TP rank(s) {ranks}; tracer needs every rank 0..k-1")
    first = states[0]
    if len(ranks) == 1:
        return first
    for key in ("rows", "kv"):
        other = next((r for r in ranks if set(states[r][key]) != set(first[key])), None)
        if other is not None:
            raise TracerError(f"TP rank {other} kept {key} for other points than rank 0; vLLM's ranks run the same "
                              "modules, so a rank's capture is incomplete")
    holds = first.get("tp_shards", {})
    out, differ, joined = dict(first), [], {}
    out["rows"], out["sources"] = {}, dict(first["sources"])
    for name, chunks in first["rows"].items():
        per = _same_chunks(states, "rows", name)
        how = holds.get(name, "whole")
        rows, note = [], ""
        for i, (step, _t) in enumerate(chunks):
            t, note, equal = join_ranks([p[i][1] for p in per], how, f"{name} (step {step})")
            rows.append((step, t))
            if not equal and name not in differ:
                differ.append(name)
        out["rows"][name] = rows
        if note and name in out["sources"]:  # the mapping line says how the ranks were joined, as a dump's does
            module, line = out["sources"][name]
            out["sources"][name] = (module, f"{line[:-1]}; {note})" if line.endswith(")") else f"{line} ({note})")
        joined[how] = joined.get(how, 0) + 1
    out["kv"] = {}
    for layer, chunks in first["kv"].items():
        per = _same_chunks(states, "kv", layer)
        out["kv"][layer] = []
        for i, (pos, t) in enumerate(chunks):
            half = len(ranks) * t.shape[-1] // 2
            kv, _note, _eq = join_ranks([p[i][1] for p in per], "halves", f"KV cache of layer {layer}", (half, half))
            out["kv"][layer].append((pos, kv))
    size = len(ranks)
    said = [f"{joined[h]} point(s) {w}" for h, w in (("columns", f"joined from {size} column shards"),
                                                   ("partial", f"added from {size} partial sums (float64)"))
            if joined.get(h)]
    if out["kv"]:
        said.append(f"{len(out['kv'])} KV cache(s) joined by KV heads")
    whole = joined.get("whole", 0)
    agree = (f"{whole - len(differ)} of {whole} whole points equal on every rank (rank 0's kept)" if not differ else
             f"{len(differ)} of {whole} whole points differ between ranks, e.g. {differ[0]} (rank 0's kept)")
    out["notes"] = list(first["notes"]) + [f"TP {size}: " + "; ".join(said + [agree])]
    return out
