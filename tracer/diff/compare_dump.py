"""An HF reference run versus an engine dump: the same comparison and report as for two HF runs.

``tracer compare REF.h5:A DUMP`` and ``tracer.compare("REF.h5:A", "DUMP")`` land here when one
side is an engine dump (a folder, a ``.safetensors``/``.npz`` file) or a run written by
``tracer import``. The dump is read (:mod:`tracer.engines.dumps.read`), mapped onto the reference's HF
capture points (:mod:`tracer.engines.dumps.namemap`) and compared with :func:`tracer.diff.compare.compare_pairs`
over the positions both sides hold; the report names the engine and lists every point's mapping.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from tracer.diff.batch import tensor_diff
from tracer.diff.capture_contract import ContractMismatch, check_rank_sum, check_scaled
from tracer.diff.compare import compare_pairs
from tracer.diff.crossdtype import CrossAccumulator, pair_dtypes
from tracer.diff.engine import logits_at
from tracer.diff.logits import logits_diff
from tracer.diff.refs import split_ref
from tracer.diff.result import Comparison
from tracer.errors import TracerError
from tracer.engines.dumps.hidden_states import ENGINE as HS_ENGINE, check_slots, is_window_file, read_window
from tracer.engines.dumps.namemap import MappedDump, RefLayout, map_dump, map_window
from tracer.engines.dumps.rules import load_engine_map
from tracer.execute.kinds import PointKind
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.load.kv_contract import KVContract, KvTransfer
from tracer.load.devices import resolve_device
from tracer.engines.dumps.read import read_dump
from tracer.engines.table import REFERENCE
from tracer.store.formats import check_name
from tracer.store.header import EngineDumpMeta, EngineDumpRef
from tracer.store.integrity import check_not_an_input
from tracer.store.trace import TraceReader, TraceWriter, read_tensor

#: run meta key marking a run written by ``tracer import``
IMPORTED = "engine_dump"


def is_dump(ref: str) -> bool:
    """True for a path that is an engine dump: a folder, or a ``.safetensors``/``.npz`` file."""
    p = Path(ref)
    return p.is_dir() or (p.is_file() and p.suffix in (".safetensors", ".npz"))


def ref_layout(reader: TraceReader, run: str) -> RefLayout:
    """The :class:`~tracer.engines.dumps.namemap.RefLayout` of run ``run`` of an open trace.

    Raises:
        TracerError: unknown run, or a run stored without tensors.
    """
    rec = reader.run(run, load_tensors=False)
    caps = reader.captures(run)
    if not caps:
        raise TracerError(f"trace {reader.path} holds no tensors for run {run} (written with --store stats/none); "
                          "re-run the reference with --store tensors")
    names = {n: (i["kind"], i["op"], tuple(i["shape"][1:]), i["dtype"]) for n, (i, _ds) in caps.items()}
    layers = [n for n, v in names.items() if v[0] == PointKind.LAYER]
    model = reader.header.get("model", {})
    kv = model.get("n_kv_heads") if isinstance(model, dict) else None
    return RefLayout(names=names, layer_prefix=layers[0].rsplit(".", 1)[0] if layers else "model.layers",
                     n_layers=len(layers), token_ids=list(rec.token_ids), window=tuple(rec.window),
                     family=model.get("family", "?") if isinstance(model, dict) else "?",
                     kv_heads=int(kv) if isinstance(kv, int) else None)


def _resolve_run(reader: TraceReader, run: str | None) -> str:
    if run is None:
        if not reader.runs:
            raise TracerError(f"trace {reader.path} holds no runs")
        return reader.runs[0]
    return run


def map_engine_dump(dump: str, reader: TraceReader, run: str, engine_map: str | None = None) -> MappedDump:
    """Read ``dump`` and map it onto run ``run`` of the open reference trace ``reader``. A
    hidden-states file of a whole prompt is read for the reference window's rows alone where that
    gives the whole read's mapping (:func:`tracer.engines.dumps.hidden_states.read_window`); anything
    else whole (a window file too: it holds its window's rows alone).

    Raises:
        TracerError: any malformed dump, unknown names, mismatched tokens (one line each).
    """
    layout = ref_layout(reader, run)
    # a hidden-states file: the reference window's rows alone, where that read gives what the whole
    # read gives (read_window and map_window say None otherwise); not a window file (tracer's connector):
    # it holds its window's rows alone, which map_window would take for a whole prompt's (notes, GEMM M)
    whole_prompt = Path(dump).suffix == ".safetensors" and not is_window_file(dump)
    rows = read_window(dump, layout.window, layout.n_layers) if whole_prompt else None
    if rows is not None:
        entries, file_ids, facts = rows
        emap = load_engine_map(layout.family, engine_map, engine=facts.get("framework"))
        mapped = map_window(str(Path(dump)), HS_ENGINE, entries, file_ids, layout, emap, facts)
        if mapped is not None:
            return mapped
    raw = read_dump(dump)
    check_slots(raw, layout.n_layers)
    emap = load_engine_map(layout.family, engine_map, engine=raw.facts.get("framework"))
    return map_dump(raw, layout, emap)


def _imported(reader: TraceReader, run: str) -> MappedDump | None:
    """The :class:`MappedDump` stored by ``tracer import`` as run ``run``, or None for an ordinary run."""
    rec = reader.run(run, load_tensors=False)
    info = rec.meta.get(IMPORTED)
    if info is None:
        return None
    tensors = {n: reader.tensor(run, n) for n in reader.capture_names(run)}
    return MappedDump(engine=info["engine"], path=info["path"], positions=tuple(rec.window), tensors=tensors,
                      mapping=info["mapping"], notes=list(info["notes"]), facts=info.get("facts", {}))


def compare_dump(ref: tuple[str, str | None], dump: str, *, engine_map: str | None = None,
                 atol: float | None = None, rtol: float | None = None, device: str | None = None) -> Comparison:
    """Compare HF reference run ``ref = (trace, run)`` with an engine dump (or an imported run ``FILE:RUN``).

    Positions: those both sides hold (the dump's positions inside the reference's kept window;
    see :func:`tracer.engines.dumps.namemap.map_dump`). Capture points: those the dump maps to. Run A is the
    reference, run B the engine. ``atol``/``rtol``/``device`` as in :func:`tracer.diff.compare.compare_runs`.

    Raises:
        TracerError: a bad reference or dump (one line).
    """
    path_a, run_a = ref
    dev = torch.device(resolve_device(device))
    with TraceReader(path_a) as reader:
        run_a = _resolve_run(reader, run_a)
        layout = ref_layout(reader, run_a)
        mapped = _mapped(dump, reader, run_a, engine_map)
        lo, hi = mapped.positions
        w0, w1 = layout.window
        if not (w0 <= lo and hi <= w1):
            raise TracerError(f"the dump covers positions {lo}..{hi - 1} but run {run_a} kept {w0}..{w1 - 1}; "
                              "compare with the run it was imported against")
        caps = reader.captures(run_a)
        contract: list = []
        world = mapped.facts.get("tp_size")

        def pairs():
            for name, (info, ds) in caps.items():
                t_b = mapped.tensors.get(name)
                if t_b is None:
                    continue

                t_a = read_tensor(ds, rows=slice(lo - w0, hi - w0))
                odd = contract_of(name, t_a, t_b, mapped, world if isinstance(world, int) else None)
                if odd is not None:
                    contract.append(odd)
                yield name, info["kind"], info["op"], t_a.to(dev), t_b.to(dev), info["calls"], []

        header = reader.header
        model = header.get("model", {}) if isinstance(header.get("model"), dict) else {}
        engine = mapped.engine
        tp = mapped.facts.get("tp_size", 1)
        facts = {
            "dtype": model.get("dtype"), "device": model.get("device"), "device_name": header.get("device_name"),
            "n_tokens": len(layout.token_ids),
            "plan_a": f"Hugging Face reference, run {run_a} of {path_a}",
            "plan_b": f"{engine} {mapped.path} (TP {tp}, {len(mapped.facts.get('steps', []))} step(s); GEMM M = tokens per step)",
            "gemm_m_a": reader.run(run_a, load_tensors=False).plan.get("gemm_m"),
            "gemm_m_b": mapped.facts.get("step_tokens"),
            "engine": engine, "engine_path": mapped.path, "mapping": mapped.mapping,
            "notes": [f"engine: {engine} at {mapped.path}; {len(mapped.mapping)} capture points mapped "
                      f"(HF name ← engine name (what was fused, sharded, summed)):",
                      *(f"  {hf} ← {src}" for hf, src in mapped.mapping.items()), *mapped.notes],
        }
        kv = dump_kv_transfer(mapped, layout, model)
        if kv is not None:  # one line: the dump's KV cache is compared without its producer's contract
            facts["notes"].append(f"the dump's KV cache ({kv['transferred']} positions) is compared at the kv_cache "
                                  f"points: {PRODUCER_UNKNOWN}")
        roles = {n: str(i.get("role") or "") for n, (i, _ds) in caps.items()}
        c = compare_pairs(pairs(), scenario=f"HF vs {engine}", model=model.get("name", "?"),
                          positions=(lo, hi), run_a=f"HF:{run_a}", run_b=engine, trace=str(path_a),
                          facts=facts, atol=atol, rtol=rtol, roles=roles)
        for name, (ps, rows_b, src) in mapped.partial_logits.items():  # logits at a few positions: in the verdict too
            rows_a = read_tensor(caps[name][1])[[p - w0 for p in ps]]
            rows_b = rows_b.reshape(rows_a.shape)
            line = partial_logits_line(name, ps, rows_a, rows_b, src)
            if c.logits is None:
                c = logits_at(c, name, ps, rows_a.to(dev), rows_b.to(dev), line, roles)
            else:
                c = replace(c, facts={**c.facts, "notes": [*c.facts.get("notes", []), line]})
        return replace(c, contract=tuple(contract)) if contract else c


def contract_of(name: str, t_a: torch.Tensor, t_b: torch.Tensor, mapped: MappedDump,
                world: int | None) -> ContractMismatch | None:
    """The capture-contract difference at one mapped point (:mod:`tracer.diff.capture_contract`),
    or None: its TP ranks held partial sums its dims do not mark (their sum matches the reference),
    or one side is k× the other at nearly every element.

    Raises:
        TracerError: the point's replicated TP ranks differ and their sum does not match the
            reference either (inconsistent shards).
    """
    if name in mapped.unmarked_partials:
        k = world or 2
        odd = check_rank_sum(name, t_a, t_b, k)
        if odd is None:
            raise TracerError(f"inconsistent shards: {name} is replicated (no TP dim in its dims or map) but the "
                              f"{k} ranks hold different values, and their sum is not the reference either "
                              f"({mapped.mapping.get(name, name)}); give its dims, e.g. \"t h[tp]\"")
        return odd
    return check_scaled(name, t_a, t_b, world)


def partial_logits_line(name: str, positions: list[int], a: torch.Tensor, b: torch.Tensor, src: str) -> str:
    """One line comparing logits the engine dumped at a few positions only: ``(k, vocab)`` rows of
    the reference (``a``) and the engine (``b``). Rows of different dtypes (an engine's float32
    logits against a bf16 reference) are compared as :mod:`tracer.diff.crossdtype` says, and the
    line says so (values compared in the wider dtype, ULPs in the coarser, representability)."""
    how = ""
    if pair_dtypes(a.dtype, b.dtype) is not None:
        cross = CrossAccumulator(a.dtype, b.dtype)
        a, b, ra, rb = cross.views(a, b)
        merged, info = cross.merge(tensor_diff(a, b), tensor_diff(ra, rb))
        d = logits_diff(a, b, tensor=merged)
        how = f" ({info.text('HF', 'the engine')}; max {merged.max_ulp_mag:.3g} ULP of {info.ulps_in})"
    else:
        d = logits_diff(a, b)
    flips = ", ".join(f"position {positions[f.position]}: top-1 {f.token_a} in HF, {f.token_b} in the engine"
                      for f in d.argmax_flips) or "no argmax flip"
    return (f"{name} (logits) at position(s) {', '.join(map(str, positions))} only ← {src}: {d.tensor.n_diff} / "
            f"{d.tensor.n_total} differ, max |Δ| {d.tensor.max_abs_diff:.3g}, KL(HF‖engine) max {d.kl_max:.3g}; "
            f"{flips}{how}")


def _mapped(dump: str, reader: TraceReader, run: str, engine_map: str | None) -> MappedDump:
    if is_dump(dump):
        return map_engine_dump(dump, reader, run, engine_map)

    path, drun = split_ref(dump)
    with TraceReader(path) as r2:
        drun = drun or next((n for n in r2.runs if IMPORTED in r2.run(n, load_tensors=False).meta), None)
        m = _imported(r2, drun) if drun is not None else None
    if m is None:
        raise TracerError(f"{dump} is neither an engine dump nor a run written by 'tracer import'")
    return m


def import_dump(dump: str, reference: tuple[str, str | None], output: str, *, engine_map: str | None = None,
                overwrite: bool = False, run_name: str = "engine") -> MappedDump:
    """Map ``dump`` onto the reference run and write it as a one-run trace ``output``.

    The run holds the HF-named tensors of the compared positions (window = those positions), the
    reference's token ids, and in its meta the engine, the per-point mapping and the notes; the
    header is the reference's, with ``engine_dump`` facts added. ``tracer compare REF.h5:A
    output`` compares it like the dump itself.

    Raises:
        TracerError: bad dump or reference; ``output`` exists and ``overwrite`` is False; ``output`` is
            the reference trace or the dump it reads (never replaced, even with ``overwrite``).
    """
    path, run = reference
    check_name(run_name, "--run")
    check_not_an_input(output, {"-r reference": path, "DUMP": dump}, "-o")  # --overwrite must not replace them
    with TraceReader(path) as reader:
        run = _resolve_run(reader, run)
        layout = ref_layout(reader, run)
        mapped = map_engine_dump(dump, reader, run, engine_map)
        lo, hi = mapped.positions
        w0 = layout.window[0]
        for name in mapped.unmarked_partials:  # never stored as if it were the full sum
            ref_rows = read_tensor(reader.captures(run)[name][1], rows=slice(lo - w0, hi - w0))
            odd = contract_of(name, ref_rows, mapped.tensors[name], mapped, mapped.facts.get("tp_size"))
            raise TracerError(f"{odd.text}; not imported")
        header = dict(reader.header)
        caps_info = {n: reader.capture_info(run, n) for n in mapped.tensors}
    header["engine_dump"] = EngineDumpRef(mapped.engine, mapped.path, f"{path}:{run}").to_dict()
    lo, hi = mapped.positions
    captures = {n: CaptureRecord(name=n, kind=caps_info[n]["kind"], tensor=t.contiguous(), op=caps_info[n]["op"],
                                 role=str(caps_info[n].get("role") or "")) for n, t in mapped.tensors.items()}
    notes = list(mapped.notes) + [f"{n}: the engine's logits at position(s) {', '.join(map(str, ps))} only are not stored "
                                  "in the imported trace; compare the dump itself to see them"
                                  for n, (ps, _t, _s) in mapped.partial_logits.items()]
    info = EngineDumpMeta(mapped.engine, mapped.path, mapped.mapping, tuple(notes),
                          json.loads(json.dumps(mapped.facts, default=str))).to_dict()
    rec = RunRecord(name=run_name, token_ids=layout.token_ids, window=(lo, hi),
                    plan={"name": run_name, "description": f"{mapped.engine} {mapped.path}"},
                    captures=captures, meta={IMPORTED: info})
    kv = dump_kv_transfer(mapped, layout, header.get("model") if isinstance(header.get("model"), dict) else {})
    if kv is not None:  # the KV contract's consumer side beside the run; the producer's is unknown
        rec.meta["kv_transfer"] = kv
    with TraceWriter(output, header=header, overwrite=overwrite) as w:
        w.add_run(rec)
    return mapped


#: what an engine dump's KV cache lacks: the producer's side of the KV contract (traces/README.md)
PRODUCER_UNKNOWN = ("producer contract unknown: an engine dump records no KV contract (its storage dtype, layout, "
                    "block size, kernels), so only the consumer's side, the reference's, is recorded")


def dump_kv_transfer(mapped: MappedDump, layout: RefLayout, model: dict) -> dict | None:
    """``meta["kv_transfer"]`` of an engine dump that holds KV-cache tensors mapped onto the reference's
    ``kv_cache`` points (None for a dump without): role ``imported``, the positions, no contract check
    (``contract`` None: :data:`PRODUCER_UNKNOWN`) and the consumer's :class:`KVContract` (the reference
    as tracer stores it: token rows of keys then values, in the model dtype)."""
    kv = [n for n in mapped.tensors if layout.names.get(n, ("",))[0] == PointKind.KV_CACHE]
    if not kv:
        return None
    features = int(layout.names[kv[0]][2][0]) if layout.names[kv[0]][2] else 0
    heads = int(layout.kv_heads or 0)
    consumer = KVContract(
        engine=REFERENCE, version="", device=str(model.get("device") or ""), model_dtype=str(model.get("dtype") or ""),
        storage_dtype=str(layout.names[kv[0]][3]), layout="NHD", transfer_unit="token", block_size=0,
        layers=len([n for n, v in layout.names.items() if v[0] == PointKind.KV_CACHE]), kv_heads=heads,
        head_dim=features // (2 * heads) if heads else 0, positions=(0, int(mapped.positions[1])),
        packing="per token: every head's keys, then every head's values (tracer's kv_cache point)",
        transfer=f"engine dump {mapped.path}")
    return KvTransfer(role="imported", transferred=int(mapped.positions[1]), boundary=f"engine dump {mapped.path}",
                      consumer=consumer, unknown=PRODUCER_UNKNOWN).to_dict()


def dump_side(refs: list[str]) -> tuple[tuple[str, str | None], str] | None:
    """For ``tracer compare`` arguments ``REF[:RUN] DUMP``: ``((REF, RUN), DUMP)`` when the second is an
    engine dump (folder, ``.safetensors``, ``.npz``) or a trace written by ``tracer import``; else None."""
    if len(refs) != 2:
        return None
    second = refs[1]
    if is_dump(second):
        return split_ref(refs[0]), second
    path, _run = split_ref(second)
    if Path(path).is_file() and path.endswith((".h5", ".hdf5")):
        try:
            with TraceReader(path) as r:
                if "engine_dump" in r.header:
                    return split_ref(refs[0]), second
        except TracerError:
            return None
    return None
