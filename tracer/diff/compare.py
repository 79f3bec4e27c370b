"""Aligning two runs and comparing them capture point by capture point: the comparison engine.

The comparison streams: it holds one capture point's two tensors at a time, whether they come
from in-memory :class:`~tracer.execute.records.RunRecord` objects or from a stored trace (read in
row blocks by :mod:`tracer.store.stream`). The result types are in :mod:`tracer.diff.result`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch

from tracer.diff.batch import DiffBatch
from tracer.diff.fetch import fetch_together
from tracer.diff.crossdtype import CrossAccumulator, CrossDtype, pair_dtypes, summary_line
from tracer.diff.facts import run_facts
from tracer.store.environment import device_difference, isa_differences, version_differences
from tracer.diff.logits import LogitsAccumulator, logits_accumulator
from tracer.diff.metrics import amplification, bits_equal, has_nonfinite
from tracer.diff.origins import classify_origins
from tracer.diff.positions import PositionStats, one_device
from tracer.diff.replay import replay_diff
from tracer.diff.result import Comparison, PointResult, SkipRecord, check_fail_on, skip_record
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind, point_kind
from tracer.execute.records import RunRecord
from tracer.load.contract import contract_differences
from tracer.load.devices import resolve_device
from tracer.store.stream import RowBlocks, stored_pairs
from tracer.store.formats import check_name
from tracer.store.trace import TraceReader


def _pairs_from_records(a: RunRecord, b: RunRecord) -> Iterator[tuple[str, str, str, torch.Tensor, torch.Tensor, list, list]]:
    for name, ra in a.captures.items():
        rb = b.captures.get(name)
        if rb is None:
            continue
        yield name, ra.kind, ra.op, ra.tensor, rb.tensor, ra.calls, rb.calls


def missing_points(kinds_a: dict[str, str], kinds_b: dict[str, str], run_a: str, run_b: str) -> list[SkipRecord]:
    """A :class:`SkipRecord` for every capture point of one run absent from the other
    (``kinds_x``: capture name → kind, in execution order)."""
    out = [skip_record(n, k, run_b, missing=True) for n, k in kinds_a.items() if n not in kinds_b]
    return out + [skip_record(n, k, run_a, missing=True) for n, k in kinds_b.items() if n not in kinds_a]


def check_alignable(name_a: str, ids_a: list[int], window_a, name_b: str, ids_b: list[int], window_b) -> None:
    """Refuse to compare runs of different prompts or windows.

    Raises:
        TracerError: different token ids or compared windows.
    """
    if list(ids_a) != list(ids_b):
        first = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        raise TracerError(
            f"runs {name_a} and {name_b} processed different token ids ({len(ids_a)} vs {len(ids_b)} tokens, "
            f"first difference at position {first}); compare runs of the same prompt"
        )
    if tuple(window_a) != tuple(window_b):
        raise TracerError(
            f"runs {name_a} and {name_b} kept different positions ({list(window_a)} vs {list(window_b)}); "
            "compare runs of the same scenario"
        )


def _prefix_rows(kind: str, calls: list, window_start: int) -> int | None:
    """Rows of a ``kv_cache`` tensor that lie before the compared window (None for other kinds)."""
    if kind != PointKind.KV_CACHE or not calls:
        return None
    first = int(calls[-1]["positions"][0])
    return max(0, window_start - first)



def _equal_pair(batch: DiffBatch, kind: str, ta: RowBlocks, split: int | None
                ) -> tuple[int, LogitsAccumulator | None, torch.device] | None:
    """Check a pair hinted equal block by block (bits as integers, NaN/inf counted only where the
    bits show some); when every block agrees, record it with :meth:`DiffBatch.add_equal` and return
    ``(index, logits accumulator, device)``; else read its remaining blocks (their CRC-32 checks)
    and return None."""
    shape = tuple(ta.shape)
    acc = LogitsAccumulator(shape[1]) if kind == PointKind.LOGITS and len(shape) == 2 else None
    n_nan = n_inf = 0
    device = torch.device("cpu")
    for _r0, xa, xb in ta.blocks:
        device = xa.device
        if not bits_equal(xa, xb):
            for _ in ta.blocks:
                pass
            return None
        if has_nonfinite(xa):
            n_nan += int(torch.isnan(xa).sum())
            n_inf += int(torch.isinf(xa).sum())
            if acc is not None:
                acc.add(xa, xb)  # rows with a NaN/inf: as any
        elif acc is not None:
            acc.add_equal(xa.shape[0])
    return batch.add_equal(math.prod(shape), n_nan, n_inf, split=split), acc, device


def _stream_pair(batch: DiffBatch, stats: PositionStats, name: str, kind: str, ta: RowBlocks,
                 split_rows: int | None, cross: CrossAccumulator | None = None
                 ) -> tuple[int, LogitsAccumulator | None, int | None]:
    """Feed a pair given in row blocks to the batch, the per-position statistics and (logits) a
    :class:`LogitsAccumulator`; returns its batch index, the accumulator and (a cross-dtype pair,
    ``cross``) the batch index of the pair rounded to the coarser dtype."""
    shape = tuple(ta.shape)
    row = math.prod(shape[1:]) if shape else 1
    split = split_rows * row if split_rows else None
    pos = stats.rows(name, kind, shape, cross.wide if cross is not None else ta.dtype)
    blocks = ta.blocks
    if cross is not None:
        return _stream_cross(batch, pos, kind, shape, blocks, split, cross)
    if ta.equal_hint:
        equal = _equal_pair(batch, kind, ta, split)
        if equal is not None:
            index, acc, device = equal
            if pos is not None:
                pos.equal(device)
                pos.finish()
            return index, acc, None
        blocks = ta.reread()  # the hint was wrong: compare the point in full, read again
    acc = LogitsAccumulator(shape[1]) if kind == PointKind.LOGITS and len(shape) == 2 else None
    index = None
    for r0, xa, xb in blocks:
        if index is None:
            index = batch.add(xa, xb, split=split, more=True)
        else:
            batch.extend(index, xa, xb)
        if pos is not None:
            pos.add(r0, xa, xb)
        if acc is not None:
            acc.add(xa, xb)
    if index is None:  # no rows: an empty pair
        empty = torch.empty(shape, dtype=ta.dtype)
        index = batch.add(empty, empty, split=split)
    batch.close(index)
    if pos is not None:
        pos.finish()
    return index, acc, None


def _stream_cross(batch: DiffBatch, pos: Any, kind: str, shape: tuple[int, ...], blocks: Any, split: int | None,
                  cross: CrossAccumulator) -> tuple[int, LogitsAccumulator | None, int]:
    """:func:`_stream_pair` of a pair whose runs hold different dtypes: each block compared in the
    wider dtype (and the per-position and logits statistics from it), and rounded to the coarser."""
    acc = LogitsAccumulator(shape[1]) if kind == PointKind.LOGITS and len(shape) == 2 else None
    index = rounded = None
    for r0, xa, xb in blocks:
        wa, wb, na, nb = cross.views(xa, xb)
        if index is None:
            index, rounded = batch.add(wa, wb, split=split, more=True), batch.add(na, nb, split=split, more=True)
        else:
            batch.extend(index, wa, wb)
            batch.extend(rounded, na, nb)
        if pos is not None:
            pos.add(r0, wa, wb)
        if acc is not None:
            acc.add(wa, wb)
    if index is None:
        empty_w, empty_n = torch.empty(shape, dtype=cross.wide), torch.empty(shape, dtype=cross.narrow)
        index, rounded = batch.add(empty_w, empty_w, split=split), batch.add(empty_n, empty_n, split=split)
    batch.close(index)
    batch.close(rounded)
    if pos is not None:
        pos.finish()
    return index, acc, rounded


def compare_pairs(pairs: Iterable[tuple[str, str, str, torch.Tensor, torch.Tensor, list, list]], *,
                  scenario: str, model: str, positions: tuple[int, int], run_a: str = "A",
                  run_b: str = "B", trace: str | None = None,
                  facts: dict[str, Any] | None = None, atol: float | None = None,
                  rtol: float | None = None, skipped: Iterable[SkipRecord] = (),
                  roles: dict[str, str] | None = None) -> Comparison:
    """Compare an ordered stream of ``(name, kind, op, tensor_a, tensor_b, calls_a, calls_b)``.

    Tensors of one pair must have equal shapes ``(T, *feature)``; the logits pair ``(T, vocab)``;
    two different floating dtypes are compared in the wider one with ULPs in the coarser
    (:mod:`tracer.diff.crossdtype`: the point's ``cross_dtype`` and a header note say so);
    ``kv_cache`` pairs ``(S, features)`` over all cached positions. The pairs go through one
    :class:`~tracer.diff.batch.DiffBatch`, which holds at most one chunk's worth of pending
    tensors (only the logits pair is kept until the end, for its per-position statistics).
    Afterwards every differing point is classified origin/propagated (:func:`classify_origins`). ``atol``/``rtol`` (either may be None = 0 when the other is
    given) count the elements outside ``atol + rtol * |a|`` per point. A pair empty in one run
    only, and every point in ``skipped`` (missing in one run), is kept as a :class:`SkipRecord`.
    ``roles``: capture name → its role in the block (``CaptureRecord.role``), for the dataflow.

    Raises:
        TracerError: a capture point whose tensors have different shapes (or a non-floating
            dtype that differs) in the two runs, or a bad tolerance.
    """
    check_fail_on(None, atol, rtol)
    tol = None if atol is None and rtol is None else (float(atol or 0.0), float(rtol or 0.0))
    logits_tol = None
    logits = None
    logits_name = None
    logits_calls: tuple[list, list] = ([], [])
    logits_pair = None
    # every pair goes into one batch: kernels for many points at once, and the
    # tensors are released as soon as their chunk is computed (see DiffBatch)
    batch = DiffBatch(tolerance=tol)
    per_position = PositionStats(positions)
    queued: list[tuple[int, str, str, str, list, list, int | None]] = []
    crosses: dict[str, tuple[CrossAccumulator, int]] = {}  # name -> (accumulator, index of the rounded pair)
    skips = list(skipped)
    logits_acc = None
    for name, kind, op, ta, tb, ca, cb in pairs:
        kind = point_kind(kind, name)
        if not isinstance(ta, RowBlocks):  # every kernel below reads both sides: one device (a GPU if either is)
            ta, tb = one_device(ta, tb)
        if (ta.numel() == 0) != (tb.numel() == 0):  # captured in one run only: reported, never dropped
            skips.append(skip_record(name, kind, run_a if ta.numel() == 0 else run_b, missing=False))
            continue
        cross = CrossAccumulator(ta.dtype, tb.dtype) if pair_dtypes(ta.dtype, tb.dtype) else None
        if tuple(ta.shape) != tuple(tb.shape) or (ta.dtype != tb.dtype and cross is None):
            raise TracerError(
                f"capture point {name} has {tuple(ta.shape)} {ta.dtype} in run {run_a} but {tuple(tb.shape)} "
                f"{tb.dtype} in run {run_b}; the runs used different models"
            )
        if isinstance(ta, RowBlocks):  # streamed in row blocks: the same numbers, bounded memory
            index, acc, rounded = _stream_pair(batch, per_position, name, kind, ta,
                                               _prefix_rows(kind, ca, positions[0]), cross)
            if cross is not None:
                crosses[name] = (cross, rounded)
            if kind == PointKind.LOGITS:
                logits_acc, logits_pair, logits_name, logits_calls = acc, (index, None, None), name, (ca, cb)
            else:
                queued.append((index, name, kind, op, ca, cb, _prefix_rows(kind, ca, positions[0])))
            continue
        rows = _prefix_rows(kind, ca, positions[0])
        split = rows * (ta[0].numel() if ta.dim() else 1) if rows else None
        if cross is not None:  # compared in the wider dtype, ULPs in the coarser (tracer.diff.crossdtype)
            ta, tb, na, nb = cross.views(ta, tb)
            crosses[name] = (cross, batch.add(na, nb, split=None if kind == PointKind.LOGITS else split))
            del na, nb
        per_position.add(name, kind, ta, tb)
        if kind == PointKind.LOGITS:  # element-wise statistics in the batch; per-position ones below
            logits_pair = (batch.add(ta, tb), ta, tb)
            logits_name = name
            logits_calls = (ca, cb)
            continue
        queued.append((batch.add(ta, tb, split=split), name, kind, op, ca, cb, rows))
        del ta, tb
    if logits_acc is None and logits_pair is not None:  # per-position logits statistics, queued on the device
        index, ta, tb = logits_pair
        rows_a = ta.reshape(-1, ta.shape[-1]) if ta.dim() > 1 else ta
        rows_b = tb.reshape(-1, tb.shape[-1]) if tb.dim() > 1 else tb
        logits_acc, logits_pair = logits_accumulator(rows_a, rows_b), (index, None, None)
        del ta, tb, rows_a, rows_b
    fetch_together(batch, per_position, logits_acc)  # on a GPU, the comparison's one host synchronisation
    diffs = batch.results()
    cross_info: dict[str, CrossDtype] = {}
    if logits_acc is not None:
        logits = logits_acc.result(diffs[logits_pair[0]])
        logits_tol = batch.outside_tolerance(logits_pair[0]) if tol is not None else None
    if logits is not None and logits_name in crosses:
        cross, rounded = crosses[logits_name]
        merged, cross_info[logits_name] = cross.merge(logits.tensor, diffs[rounded])
        logits = replace(logits, tensor=merged)
    points: list[PointResult] = []
    first_max: float | None = None
    for index, name, kind, op, ca, cb, rows in queued:
        d = diffs[index]
        if name in crosses:
            cross, rounded = crosses[name]
            d, cross_info[name] = cross.merge(d, diffs[rounded])
        n_prefix = None if rows is None else (batch.n_diff_before(index) if rows else 0)
        if first_max is None and d.n_diff > 0:
            first_max = d.max_abs_diff
        amp = None if first_max is None else amplification(first_max, d.max_abs_diff)
        n_tol = batch.outside_tolerance(index) if tol is not None else None
        points.append(PointResult(name=name, kind=kind, op=op, diff=d, amplification=amp,
                                  calls_a=ca, calls_b=cb, n_diff_prefix=n_prefix, n_outside_tol=n_tol,
                                  cross_dtype=cross_info.get(name)))
    facts = dict(facts or {})
    line = summary_line(cross_info, run_a, run_b)
    if line is not None:  # said in the header (and, per point, in the table and the verdict)
        facts["notes"] = list(facts.get("notes", [])) + [line]
    c = Comparison(scenario=scenario, model=model, positions=tuple(positions), run_a=run_a,
                   run_b=run_b, points=tuple(points), logits_name=logits_name, logits=logits,
                   logits_calls=logits_calls, trace=trace, facts=facts,
                   logits_cross_dtype=cross_info.get(logits_name) if logits_name else None,
                   logits_n_outside_tol=logits_tol, atol=atol, rtol=rtol,
                   logits_amplification=amplification(first_max, logits.tensor.max_abs_diff)
                   if logits is not None and first_max is not None else None,
                   per_position=per_position.result(), skipped=tuple(skips))
    return classify_origins(c, roles)


def compare_records(a: RunRecord, b: RunRecord, *, scenario: str, model: str,
                    trace: str | None = None, facts: dict[str, Any] | None = None,
                    atol: float | None = None, rtol: float | None = None) -> Comparison:
    """Compare two in-memory runs (see :func:`compare_pairs`).

    Raises:
        TracerError: the runs processed different prompts or windows.
    """
    check_alignable(a.name, a.token_ids, a.window, b.name, b.token_ids, b.window)
    return compare_pairs(_pairs_from_records(a, b), scenario=scenario, model=model,
                         positions=a.window, run_a=a.name, run_b=b.name, trace=trace, facts=facts,
                         atol=atol, rtol=rtol,
                         skipped=missing_points({n: r.kind for n, r in a.captures.items()},
                                                {n: r.kind for n, r in b.captures.items()}, a.name, b.name),
                         roles={n: r.role for n, r in a.captures.items() if getattr(r, "role", "")})


def compare_trace(path: str, run_a: str | None = None, run_b: str | None = None, *,
                  atol: float | None = None, rtol: float | None = None, device: str | None = None) -> Comparison:
    """Compare two runs stored in one trace file, one capture point at a time.

    ``run_a``/``run_b`` default to the first two runs of the file; ``atol``/``rtol`` as in
    :func:`compare_pairs`; ``device`` as in :func:`compare_runs`. A replay (``--decode``) stored
    in the runs' meta is compared too.

    Raises:
        TracerError: missing/corrupt trace, unknown run names, runs of different prompts, an
            unavailable device.
    """
    return compare_runs((path, run_a), (path, run_b), atol=atol, rtol=rtol, device=device)


def _one_file(a: Any, b: Any) -> bool:
    """Whether paths ``a`` and ``b`` name one file (``./t.h5`` and ``/abs/t.h5``, a link)."""
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def compare_runs(ref_a: tuple[str, str | None], ref_b: tuple[str, str | None], *,
                 atol: float | None = None, rtol: float | None = None,
                 device: str | None = None) -> Comparison:
    """Compare run ``ref_a = (file, run)`` with ``ref_b``, from one trace or two (e.g. made on two
    machines), streaming capture point by capture point. A run of None is resolved as in
    :func:`resolve_refs`; ``atol``/``rtol`` as in :func:`compare_pairs`. A replay (``--decode``)
    stored in the runs' meta is compared too.

    Every point is read front to back in row blocks of about :data:`BLOCK_BYTES` into a few reused
    buffers, :data:`READ_AHEAD` blocks ahead of the comparison on one background thread (a version-2
    trace is read with ``preadv``, which releases the GIL), and compared block by block with the
    numbers of a whole-tensor comparison (:class:`RowBlocks`); each point's CRC-32 is checked after
    its last block, before anything is reported. ``device``: where the metrics are computed
    (``cpu``, ``cuda``, ``cuda:N``; None: cuda if available); on a GPU the buffers are pinned. Host
    memory: the buffers (2 × (READ_AHEAD + 2) × BLOCK_BYTES at most) plus the metrics' chunk
    temporaries, whatever the trace size.

    A trace without checksums is read unverified and named in the result's ``unverified``.

    Raises:
        TracerError: missing/corrupt trace, unknown run names, runs of different prompts or
            windows, an unavailable device.
    """
    (path_a, run_a), (path_b, run_b) = ref_a, ref_b
    for run in (run_a, run_b):  # '' names no run (it used to mean "the default" silently)
        if run is not None:
            check_name(run, "run")
    same = str(path_a) == str(path_b)
    with contextlib.ExitStack() as stack:
        reader_a = stack.enter_context(TraceReader(path_a))
        reader_b = reader_a if same else stack.enter_context(TraceReader(path_b))  # one file: read and validated once
        names_a, names_b = reader_a.runs, reader_b.runs
        if same and (run_a is None or run_b is None):
            if len(names_a) < 2:
                raise TracerError(f"trace {path_a} holds {len(names_a)} run(s); a comparison needs two")
            run_a = run_a or names_a[0]
            run_b = run_b or next(n for n in names_a if n != run_a)
        run_a = run_a or (run_b if run_b in names_a else names_a[0] if names_a else None)
        run_b = run_b or (run_a if run_a in names_b else names_b[0] if names_b else None)
        if run_a == run_b and (same or _one_file(path_a, path_b)):  # agrees with itself, whatever it holds
            raise TracerError(f"run {run_a} of {path_a} would be compared with itself; name two different runs "
                              f"(its runs: {', '.join(names_a)})")
        ra = reader_a.run(run_a, load_tensors=False)
        rb = reader_b.run(run_b, load_tensors=False)
        label_a, label_b = (run_a, run_b) if same else (f"{path_a}:{run_a}", f"{path_b}:{run_b}")
        check_alignable(label_a, ra.token_ids, ra.window, label_b, rb.token_ids, rb.window)
        header = reader_a.header
        caps_a, caps_b = reader_a.captures(run_a), reader_b.captures(run_b)  # name -> (info, dataset)
        for path, reader, run, caps in ((path_a, reader_a, run_a, caps_a), (path_b, reader_b, run_b, caps_b)):
            if not caps:
                raise TracerError(
                    f"trace {path} holds no tensors for run {run} (written with --store "
                    f"{reader.header.get('store', 'stats')}); 'tracer show {path}' prints its stored comparison"
                )
        names = [n for n in caps_a if n in caps_b]
        skipped = missing_points({n: i["kind"] for n, (i, _) in caps_a.items()},
                                 {n: i["kind"] for n, (i, _) in caps_b.items()}, label_a, label_b)
        # --store auto dropped these points' tensors: not compared here, never reported as identical
        autos = [r.meta["store_auto"] for r in (ra, rb) if isinstance(r.meta.get("store_auto"), dict)]
        kinds = {n: k for a in autos if isinstance(a.get("kinds"), dict) for n, k in a["kinds"].items()}
        dropped = [n for a in autos for n in a.get("dropped") or [] if isinstance(n, str)]
        skipped += [SkipRecord(n, point_kind(kinds.get(n, PointKind.LAYER), n), "not stored (--store auto kept statistics only; "
                               "'tracer report' shows the run-time comparison)")
                    for n in dict.fromkeys(dropped) if n not in caps_a or n not in caps_b]
        dev = torch.device(resolve_device(device))
        scen = header.get("scenario", {})
        scen_name = scen.get("name", "?") if isinstance(scen, dict) else str(scen)
        facts = run_facts(header, ra, rb)
        if not same:
            hb = reader_b.header
            facts["notes"] = facts.get("notes", []) + [f"A: {path_a} ({header.get('hostname')}, {header.get('device_name')}, torch {header.get('torch')}); "
                              f"B: {path_b} ({hb.get('hostname')}, {hb.get('device_name')}, torch {hb.get('torch')})"]
            facts["device_differs"] = device_difference(header, hb)  # named first: the likely cause
            facts["isa_differs"] = isa_differences(header, hb)  # then the instruction sets
            if facts["device_differs"]:
                facts["notes"].append(f"likely cause: the devices differ: {facts['device_differs']}; their kernels "
                                      "differ, so the two machines may compute other bits")
            elif facts["isa_differs"]:
                facts["notes"].append("likely cause: the instruction sets differ (" + "; ".join(facts["isa_differs"])
                                      + "); the kernels dispatch on them, so the two machines may compute other bits")
            facts["versions_differ"] = version_differences(header, hb)
            facts["notes"].append("versions that differ: " + ("; ".join(facts["versions_differ"]) or "none"))
            facts["contract_differs"] = contract_differences(header, hb)
            if facts["contract_differs"]:
                facts["notes"].append("warning: the numeric contract differs: " + "; ".join(facts["contract_differs"]))
        pairs = stored_pairs(names, caps_a, caps_b, dev)
        try:
            c = compare_pairs(
                pairs, scenario=ra.meta.get("scenario", scen_name),
                model=header.get("model", {}).get("name", "?") if isinstance(header.get("model"), dict) else str(header.get("model", "?")),
                positions=tuple(ra.window), run_a=label_a, run_b=label_b, trace=str(path_a) if same else f"{path_a} + {path_b}",
                facts=facts, atol=atol, rtol=rtol, skipped=skipped,
                roles={n: str(i.get("role") or "") for n, (i, _) in caps_a.items()},
            )
        finally:
            pairs.close()
        if "decode_tokens" in ra.meta and "decode_tokens" in rb.meta:
            c = replace(c, replay=replay_diff(ra.meta["decode_tokens"], rb.meta["decode_tokens"],
                                              ra.meta.get("decode_text"), rb.meta.get("decode_text")))
        bare = tuple(dict.fromkeys(str(p) for p, r in ((path_a, reader_a), (path_b, reader_b)) if not r.checksummed))
        return replace(c, unverified=bare) if bare else c
