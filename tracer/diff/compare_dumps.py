"""Two engine dumps against each other: a rollout engine's dump against a trainer's, located layer by layer.

``tracer compare DUMP_A DUMP_B --reference REF.h5:RUN`` and ``tracer.compare_trace(DUMP_A, DUMP_B,
reference="REF.h5:RUN")`` land here. Each dump is read (:mod:`tracer.engines.dumps.read`: SGLang's
dumper folders from an SGLang server, ``sglang_parallel_info``, or from a Megatron-LM trainer,
``megatron_parallel_info``, as Miles and slime write them; per-pass folders; named tensors) and
mapped onto the HF capture points of the reference run (:mod:`tracer.engines.dumps.namemap`, with the
engine's map: ``hooks/engine-llama.toml``, ``hooks/engine-megatron.toml``). The reference gives
the layout (HF names, shapes, the model's KV heads) and the token ids of the whole sequence
(prompt and response): each dump's rows are placed at the positions whose ids they carry, so a
rollout's prefill and decode steps and a trainer's one teacher-forced pass line up. The reference's
values are not compared.

The two mapped dumps are compared with :func:`tracer.diff.compare.compare_pairs` over the positions
both hold, like any two runs: the same table, origin and verdict, with both engines named. Where
both dumps hold logits at common positions whose next token the reference knows, the RL metrics
of those tokens (:func:`tracer.diff.rl.rl_from_logits`: Δlogp, k1/k3 KL, importance ratios, the
share a TIS cap or an MIS mask touches, PPL, flips) ride along in ``comparison.rl``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tracer.diff.compare import compare_pairs
from tracer.diff.compare_dump import is_dump, ref_layout
from tracer.diff.result import Comparison
from tracer.errors import TracerError
from tracer.engines.dumps.namemap import MappedDump, RefLayout, map_dump
from tracer.engines.dumps.rules import load_engine_map
from tracer.engines.dumps.tokens import ranges
from tracer.execute.kinds import PointKind
from tracer.engines.dumps.read import read_dump


def _map_side(dump: str, layout: RefLayout, engine_map: str | None) -> MappedDump:
    raw = read_dump(dump)
    return map_dump(raw, layout, load_engine_map(layout.family, engine_map, engine=raw.facts.get("framework")))


def _logit_rows(m: MappedDump, name: str | None) -> dict[int, torch.Tensor]:
    """Position → logits row of one mapped dump: every compared position, or the few it dumped (SGLang)."""
    if name is None:
        return {}
    if name in m.tensors:
        lo = m.positions[0]
        return {lo + i: row for i, row in enumerate(m.tensors[name])}
    if name in m.partial_logits:
        ps, rows, _src = m.partial_logits[name]
        return {p: rows[i].reshape(-1) for i, p in enumerate(ps)}
    return {}


def _wider(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors in the wider of their two float dtypes (an exact cast)."""
    if a.dtype == b.dtype:
        return a, b
    wide = max((a.dtype, b.dtype), key=lambda dt: torch.finfo(dt).bits)
    return a.to(wide), b.to(wide)


def _engines(ma: MappedDump, mb: MappedDump) -> tuple[str, str]:
    if ma.engine == mb.engine:
        return f"{ma.engine} A", f"{mb.engine} B"
    return ma.engine, mb.engine


def _plan(m: MappedDump) -> str:
    f = m.facts
    par = [f"TP {f.get('tp_size', 1)}"] + [f"{k.split('_')[0].upper()} {f[k]}" for k in ("cp_size", "pp_size") if k in f]
    if f.get("sequence_parallel"):
        par.append("SP")
    return f"{m.engine} {m.path} ({', '.join(par)}, {len(f.get('steps', []))} step(s); GEMM M = tokens per step)"


def _rl(ma: MappedDump, mb: MappedDump, logits: str | None, ids: list[int], lo: int, hi: int,
        params: dict[str, float], notes: list[str]) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """The positions, and both sides' logits there, of the RL metrics: the last run of consecutive
    positions in ``lo..hi-1`` where both dumps hold logits and the next token is the dumps' own.

    The next token of ``p`` is read from the reference's ids; it is the token both dumps computed when
    ``p + 1`` is a compared position (both dumps hold the reference's id there), or when it is the
    reference's last token (the response's last token, which no engine feeds back). Any other ``p + 1``
    lies where the dumps' ids were not the reference's, or were not dumped: a token the rollout may
    never have sampled, left out."""
    ra, rb = _logit_rows(ma, logits), _logit_rows(mb, logits)
    held = sorted(p for p in set(ra) & set(rb) if lo <= p < hi and p + 1 < len(ids))
    common = [p for p in held if p + 1 < hi or p + 1 == len(ids) - 1]
    if len(common) < len(held):
        unverified = [p + 1 for p in held if p not in common]
        notes.append(f"RL metrics: the reference's token at position(s) {ranges(unverified)} is not in both dumps "
                     "(their ids there differ from the reference's, or were not dumped); its logprob is left out")
    if not common:
        notes.append(f"RL metrics: not computed; the dumps hold logits at no common position with a known next token "
                     f"(A: {ranges(sorted(ra)) if ra else 'no logits'}; B: {ranges(sorted(rb)) if rb else 'no logits'})")
        return None
    run = [common[-1]]
    while run[0] - 1 in set(common):
        run.insert(0, run[0] - 1)
    if len(run) < len(common):
        notes.append(f"RL metrics over positions {run[0]}..{run[-1]} (consecutive); logits at {ranges([p for p in common if p < run[0]])} "
                     "are in the layer table only")
    la = torch.stack([ra[p].reshape(-1) for p in run])
    lb = torch.stack([rb[p].reshape(-1) for p in run])
    notes.append(f"RL metrics: the tokens at positions {run[0] + 1}..{run[-1] + 1} (the sequence's own, from the reference's "
                 f"ids), logprobs log_softmax(float32(logits) / τ) at τ={params['tau']:g} on each side; TIS cap "
                 f"{params['is_cap']:g}, MIS band [{1 / params['mask_threshold']:.3g}, {params['mask_threshold']:g}]")
    return run, la, lb


def compare_dumps(dump_a: str, dump_b: str, reference: tuple[str, str | None], *, engine_map: str | None = None,
                  atol: float | None = None, rtol: float | None = None, device: str | None = None,
                  tau: float = 1.0, is_cap: float = 2.0, mask_threshold: float = 2.0) -> Comparison:
    """Compare two engine dumps of one sequence (run A: ``dump_a``, e.g. the rollout; run B: ``dump_b``,
    e.g. the trainer), both mapped onto the HF names of ``reference = (trace, run)``.

    Positions: those both dumps hold (each dump's positions that carry the reference's token ids:
    one contiguous range per dump, intersected). Capture points: those both dumps map to, in the
    reference's execution order; where their dtypes differ (an fp32 LM head against a bf16 one)
    both are compared in the wider dtype, and the notes say so. Logits one dump holds at a few
    positions only (SGLang's next-token logits) are compared there, on their own line. ``rl``: the
    RL metrics (:func:`tracer.diff.rl.rl_from_logits`) of the tokens whose logits both dumps hold,
    with ``tau``, ``is_cap``, ``mask_threshold`` as in ``rollout-vs-train``.

    Raises:
        TracerError: a bad reference or dump, dumps of other tokens, no position on both sides (one line).
    """
    from tracer.diff.rl import rl_from_logits
    from tracer.load.devices import resolve_device
    from tracer.store.trace import TraceReader

    for d in (dump_a, dump_b):
        if not is_dump(d):
            raise TracerError(f"{d} is not an engine dump (a dumper folder, a PassN.pt folder, .safetensors or .npz); "
                              "with --reference both arguments are dumps")
    path, run = reference
    dev = torch.device(resolve_device(device))
    with TraceReader(path) as reader:
        if run is None and not reader.runs:
            raise TracerError(f"trace {path} holds no runs; give a reference trace with a run of the sequence")
        run = run if run is not None else reader.runs[0]
        base = ref_layout(reader, run)
        caps = {n: reader.capture_info(run, n) for n in base.names}
        header = reader.header
    layout = replace(base, window=(0, len(base.token_ids)))  # every position of the sequence: the reference only names them
    ma, mb = _map_side(dump_a, layout, engine_map), _map_side(dump_b, layout, engine_map)
    lo, hi = max(ma.positions[0], mb.positions[0]), min(ma.positions[1], mb.positions[1])
    if lo >= hi:
        raise TracerError(f"dump A holds positions {ma.positions[0]}..{ma.positions[1] - 1} and dump B "
                          f"{mb.positions[0]}..{mb.positions[1] - 1} of the reference's tokens: none on both sides; "
                          "compare dumps of the same sequence")
    names = [n for n in layout.names if n in ma.tensors and n in mb.tensors]
    wide = [n for n in names if ma.tensors[n].dtype != mb.tensors[n].dtype]
    ea, eb = _engines(ma, mb)
    notes = [f"A: {ea} at {ma.path}; B: {eb} at {mb.path}; reference {path}:{run} (names and token ids only); "
             f"{len(names)} capture points on both sides (HF name ← A's engine name · B's):",
             *(f"  {n} ← {ma.mapping[n]} · {mb.mapping[n]}" for n in names),
             *(f"A: {x}" for x in ma.notes), *(f"B: {x}" for x in mb.notes)]
    for side, m, other in (("A", ma, mb), ("B", mb, ma)):
        alone = [n for n in m.tensors if n not in other.tensors and n not in other.partial_logits]
        if alone:
            notes.append(f"capture points in dump {side} only: {', '.join(alone[:6])}{f' ... ({len(alone)} in all)' if len(alone) > 6 else ''}")
    if wide:
        da, db = ma.tensors[wide[0]].dtype, mb.tensors[wide[0]].dtype
        notes.append(f"values compared in the wider dtype at {len(wide)} point(s) where the dumps' dtypes differ "
                     f"(A {str(da).split('.')[-1]}, B {str(db).split('.')[-1]}): {', '.join(wide[:3])}")
    trainer = [side for side, m in (("A", ma), ("B", mb)) if m.facts.get("framework") == "megatron"]
    if "A" in trainer:  # the RL metrics read A as the rollout, B as the trainer
        notes.append(f"warning: dump A is a trainer's ({ma.engine}){' as is dump B' if 'B' in trainer else ''}; the "
                     "RL metrics take A as the rollout and B as the trainer (Δlogp = logp_B − logp_A): give the "
                     "rollout engine's dump first")
    logits = layout.special(PointKind.LOGITS)
    params = {"tau": float(tau), "is_cap": float(is_cap), "mask_threshold": float(mask_threshold)}
    got = _rl(ma, mb, logits, layout.token_ids, lo, hi, params, notes)

    def pairs():
        for n in names:
            ta = ma.tensors[n][lo - ma.positions[0]:hi - ma.positions[0]]
            tb = mb.tensors[n][lo - mb.positions[0]:hi - mb.positions[0]]
            ta, tb = _wider(ta, tb)
            yield n, caps[n]["kind"], caps[n]["op"], ta.to(dev), tb.to(dev), [], []

    model = header.get("model", {}) if isinstance(header.get("model"), dict) else {}
    facts = {"dtype": model.get("dtype"), "device": str(dev), "n_tokens": len(layout.token_ids),
             "plan_a": _plan(ma), "plan_b": _plan(mb), "gemm_m_a": ma.facts.get("step_tokens"),
             "gemm_m_b": mb.facts.get("step_tokens"), "engine": f"{ea} vs {eb}", "engine_path": ma.path,
             "engine_path_b": mb.path, "reference": f"{path}:{run}", "mapping": ma.mapping, "mapping_b": mb.mapping,
             "notes": notes}
    roles = {n: str(caps[n].get("role") or "") for n in names}
    comparison = compare_pairs(pairs(), scenario=f"{ea} vs {eb}", model=model.get("name", "?"), positions=(lo, hi),
                               run_a=ea, run_b=eb, trace=None, facts=facts, atol=atol, rtol=rtol, roles=roles)
    comparison = _partial_logits(comparison, ma, mb, logits, names, dev, roles)
    if got is None:
        return comparison
    run_pos, la, lb = got
    ids = layout.token_ids
    rl = rl_from_logits(run_pos, [ids[p + 1] for p in run_pos], la, lb, per_position=comparison.per_position,
                        **params)
    return replace(comparison, rl=rl)


def _partial_logits(c: Comparison, ma: MappedDump, mb: MappedDump, logits: str | None, names: list[str],
                    dev: torch.device, roles: dict[str, str]) -> Comparison:
    """``c`` with the logits compared at the positions both dumps hold them, when one dump holds them at a
    few positions only (SGLang's next-token logits; the layer table compares logits held everywhere):
    they count in the verdict and the check like any logits (:func:`tracer.diff.engine.logits_at`)."""
    if logits is None or logits in names:
        return c
    lo, hi = c.positions
    ra, rb = _logit_rows(ma, logits), _logit_rows(mb, logits)
    ps = sorted(p for p in set(ra) & set(rb) if lo <= p < hi)
    if not ps:
        return c
    from tracer.diff.engine import logits_at
    from tracer.diff.logits import logits_diff

    a, b = _wider(torch.stack([ra[p] for p in ps]), torch.stack([rb[p] for p in ps]))
    d = logits_diff(a, b)
    flips = ", ".join(f"position {ps[f.position]}: top-1 {f.token_a} in A, {f.token_b} in B"
                      for f in d.argmax_flips) or "no argmax flip"
    line = (f"{logits} (logits) at position(s) {ranges(ps)} only (one dump holds next-token logits at its steps' "
            f"last tokens): {d.tensor.n_diff} / {d.tensor.n_total} differ, max |Δ| {d.tensor.max_abs_diff:.3g}, "
            f"KL(A‖B) max {d.kl_max:.3g}; {flips}")
    return logits_at(c, logits, ps, a.to(dev), b.to(dev), line, roles)


def dumps_args(refs: list[str], reference: Any) -> tuple[str, str] | None:
    """For ``tracer compare DUMP_A DUMP_B --reference REF``: ``(DUMP_A, DUMP_B)``; None without ``reference``.

    Raises:
        TracerError: ``--reference`` with other than two arguments; two dumps without ``--reference``.
    """
    if reference is None:
        if len(refs) == 2 and all(is_dump(r) for r in refs):
            raise TracerError("two engine dumps are compared on the names and token ids of an HF reference run: "
                              "add --reference REF.h5:RUN (a trace of the same sequence, e.g. tracer run ... "
                              "--scenario rollout-vs-train --positions all --granularity sublayers -o REF.h5)")
        return None
    if len(refs) != 2:
        raise TracerError(f"--reference compares two engine dumps: give DUMP_A DUMP_B (got {len(refs)} argument(s))")
    return refs[0], refs[1]


__all__ = ["compare_dumps", "dumps_args"]
