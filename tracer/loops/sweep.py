"""``tracer sweep``: one scenario over many prompt lengths (and KV block sizes), one summary row per point.

The model is loaded once; for every prompt length ``N`` in ``--lengths`` (prefixes of one long
prompt) and every block size in ``--block-sizes`` the scenario runs through
:func:`tracer.pipeline.run_scenario`, and only a small summary per point is kept (first divergent
capture point, per-point diff counts, logits max |diff|, argmax flips), appended to the sweep file
(:mod:`tracer.store.sweepfile`) and flushed, so an interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tracer import pipeline
from tracer.config import RunConfig, applicable_options
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.engines.door import realise
from tracer.engines.table import default, is_reference
from tracer.plan.build import check_resources, make_scenario
from tracer.progress import DELAY_S, ItemProgress, StatusProgress
from tracer.prompt_checks import prompt_ids
from tracer.store.integrity import check_name_length, check_output_path

if TYPE_CHECKING:
    from tracer.diff.result import Comparison
    from tracer.load.models import LoadedModel
    from tracer.plan.scenarios import Scenario

#: the largest value and the most values one --lengths / --block-sizes list may hold
MAX_VALUE = 1 << 24
MAX_POINTS = 100_000
from tracer.store.sweepfile import (MATRIX_FIELDS, ROW_FIELDS, SweepFile, SweepResult, SweepRow, compress_ranges,
                                    default_output, is_sweep_file, read_sweep)

def parse_int_list(spec: str, what: str = "--lengths") -> list[int]:
    """Expand ``"17:512"``, ``"16:1024:8"``, ``"100,200,300"`` or a mix (``"17:64,100"``).

    A range is ``start:stop[:step]`` with **stop inclusive** (``17:512`` is 17, 18, ..., 512;
    ``16:64:16`` is 16, 32, 48, 64); step defaults to 1. Duplicates are dropped, order kept.

    Raises:
        TracerError: malformed item, step < 1, stop < start, a value < 1, or an empty list.
    """
    out: list[int] = []
    seen: set[int] = set()
    for item in str(spec).split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise TracerError(f"{what} item {item!r} is not an int or start:stop[:step] range; e.g. 17:512 or 64,128") from None
        if len(nums) == 1:
            values = nums
        elif len(nums) in (2, 3):
            start, stop, step = nums[0], nums[1], (nums[2] if len(nums) == 3 else 1)
            if step < 1 or stop < start:
                raise TracerError(f"{what} range {item!r} must have start <= stop and step >= 1 (stop is inclusive)")
            if stop > MAX_VALUE or (stop - start) // step >= MAX_POINTS:  # before anything is allocated
                raise TracerError(f"{what} range {item!r} is too large: at most {MAX_POINTS} values up to {MAX_VALUE}")
            values = list(range(start, stop + 1, step))
        else:
            raise TracerError(f"{what} item {item!r} has too many ':'; use start:stop[:step]")
        for v in values:
            if not 1 <= v <= MAX_VALUE:
                raise TracerError(f"{what} holds {v if len(str(v)) < 24 else str(v)[:12] + '...'}; values must be positive, at most {MAX_VALUE}")
            if v not in seen:
                seen.add(v)
                out.append(v)
    if not out:
        raise TracerError(f"{what} is empty; give e.g. 17:512 or 64,128")
    return out


def plan_points(lengths: list[int], block_sizes: list[int]) -> list[tuple[int, int]]:
    """The ``(length, block_size)`` grid in run order: block size outer, length inner."""
    return [(n, b) for b in block_sizes for n in lengths]


def row_from_comparison(c: Comparison, *, length: int, block_size: int, wall_s: float) -> tuple[SweepRow, list[str], list[str]]:
    """Summarise a :class:`~tracer.diff.result.Comparison` into a :class:`SweepRow` (+ point names, kinds)."""
    names = [p.name for p in c.points]
    kinds = [p.kind for p in c.points]
    n_diff = [p.diff.n_diff for p in c.points]
    n_total = [p.diff.n_total for p in c.points]
    mad = [float(p.diff.max_abs_diff) for p in c.points]
    if c.logits is not None:
        names.append(c.logits_name)
        kinds.append(PointKind.LOGITS)
        n_diff.append(c.logits.tensor.n_diff)
        n_total.append(c.logits.tensor.n_total)
        mad.append(float(c.logits.tensor.max_abs_diff))
    first = next((i for i, n in enumerate(n_diff) if n), -1)
    layer_idx = [i for i, k in enumerate(kinds) if k == PointKind.LAYER]
    last = layer_idx[-1] if layer_idx else None
    frac = (n_diff[last] / n_total[last]) if last is not None and n_total[last] else 0.0
    row = SweepRow(
        length=int(length), block_size=int(block_size), split_at=int(c.positions[0]),
        n_positions=int(c.positions[1] - c.positions[0]), first_divergent=first,
        n_diff=tuple(n_diff), n_total=tuple(n_total), max_abs_diff=tuple(mad),
        last_layer_fraction=float(frac),
        logits_max_abs_diff=float(c.logits.tensor.max_abs_diff) if c.logits is not None else 0.0,
        argmax_flips=len(c.logits.argmax_flips) if c.logits is not None else 0,
        wall_s=float(wall_s),
    )
    return row, names, kinds


# ---------------------------------------------------------------- the sweep file


def sweep(cfg: RunConfig, *, lengths: str | list[int] = "17:512", block_sizes: str | list[int] | None = None,
          keep_tensors: bool = False, loaded: LoadedModel | None = None, progress: bool | str = True,
          on_point: Callable[[SweepRow], None] | None = None) -> SweepResult:
    """Run ``cfg``'s scenario for every prompt length × block size; one summary row per point.

    The prompts are prefixes of one token sequence: the text prompt (default: the built-in one)
    tokenized and repeated to the longest length, or the given token ids (which must be at least
    that long). Each point is a :func:`tracer.pipeline.run_scenario` on the model loaded once,
    compared online (or, with ``keep_tensors``, through a temporary trace copied into the file).

    Args:
        cfg: model, prompt, scenario, capture and store options (``store`` ``none``: in memory;
            ``output``: the sweep file, default ``traces/sweep-<model>-<scenario>.h5``; an existing
            sweep file with the same parameters is resumed, with others it is an error unless
            ``overwrite``).
        lengths: prompt lengths N: ``"17:512"`` (start:stop[:step], stop inclusive), ``"64,128"``,
            or a list of ints. Every N must exceed every block size (a cache hit needs one full block).
        block_sizes: KV block sizes, same syntax (``"16,32,64"``) or a list, for the scenarios that
            take a block size (None: the engine's own default, :func:`tracer.engines.table.default`); a scenario that splits no prompt into KV blocks (repeat,
            batch, rollout-vs-train, ...) refuses them, and its lengths need not exceed a block.
        keep_tensors: also store both runs' captured tensors of every point (large).
        on_point: called with each finished row (after it is flushed).
        progress: per-point progress on stderr (:class:`tracer.progress.ItemProgress`): True or
            ``"auto"``: a bar with count and ETA in a terminal, one log line per point otherwise;
            ``"lines"``: log lines; False: nothing. Loading the model shows a status (a spinner, or
            a ``load:`` line once it takes 2 s).

    Returns:
        a :class:`SweepResult` with every row of the file (earlier sessions' rows included).

    Raises:
        TracerError: bad axes, block sizes for a scenario without KV blocks, prompt too short, a file
            of other parameters, every bad run option.
    """
    scenario = cfg.scenario.name
    uses_block = "block_size" in applicable_options(scenario)
    if block_sizes is not None and not uses_block:
        raise TracerError(f"--block-size/--block-sizes do not apply to scenario {scenario} (it splits no prompt into "
                          "KV blocks); drop them")
    if block_sizes is None and uses_block:  # the engine's own default block
        block_sizes = [default(cfg.scenario.engine, "block_size")]
    ns, bs = _axes(lengths, DEFAULT_BLOCK_SIZES if block_sizes is None else block_sizes, cache_hit=uses_block)
    out = _sweep_path(cfg, scenario)
    ids = cfg.prompt.token_ids
    if ids is not None and len(ids) < max(ns):
        raise TracerError(f"the token ids hold {len(ids)} tokens but --lengths goes up to {max(ns)}; "
                          "give a longer --token-ids-file or lower the lengths")
    if loaded is None:
        with StatusProgress("load", mode=progress, delay_s=DELAY_S) as status:
            status(f"loading {cfg.model.name}")
            loaded = pipeline.load(cfg, progress=status.loader)
    info = loaded.info
    all_ids = prompt_ids(cfg, loaded, length=max(ns))
    params = {
        "model": info.name, "scenario": scenario, "mitigation": cfg.scenario.mitigation,
        "granularity": cfg.capture.granularity, "dtype": info.dtype, "device": info.device,
        "attn": info.attn_implementation, "lengths": ns, "block_sizes": bs, "keep_tensors": bool(keep_tensors),
        "prompt_sha256": hashlib.sha256(json.dumps(all_ids).encode()).hexdigest(),
    }
    extra = {k: v for k, v in cfg.scenario.options}
    if extra:
        params["options"] = extra
    if not is_reference(cfg.scenario.engine):  # a sweep on one engine never resumes another's
        params["engine"] = cfg.scenario.engine
    header = pipeline.trace_header(loaded, None, max(ns), cfg.capture, "stats", extra={"sweep": params}).to_dict()
    sf = SweepFile(out, params, header, overwrite=cfg.store.overwrite) if out is not None else None
    try:
        done = sf.done() if sf is not None else set()
        rows: list[SweepRow] = []
        names: list[str] = []
        kinds: list[str] = []
        todo = [pt for pt in plan_points(ns, bs) if pt not in done]
        with ItemProgress("sweep", len(done) + len(todo), done=len(done), mode=progress) as bar:
            for n, b in todo:
                bar.update(description=f"N={n} b={b}")  # piped: a line now, and every 10 s while the point runs
                t0 = time.perf_counter()
                scen = _point_scenario(cfg, n, b if uses_block else None)
                tmp = sf.path.with_name(f".{sf.path.stem}.point-{os.getpid()}.h5") if keep_tensors and sf else None
                try:  # tensors go through a temporary trace, copied into the sweep file
                    comparison = _run_point(pipeline, cfg, loaded, all_ids[:n], scen, tmp)
                    row, names, kinds = row_from_comparison(comparison, length=n, block_size=b,
                                                            wall_s=time.perf_counter() - t0)
                    if sf is not None:
                        sf.append(row, names, kinds, runs_from=tmp)
                finally:
                    if tmp is not None and tmp.exists():
                        tmp.unlink()
                rows.append(row)
                bar.advance(f"N={n} b={b} {'diverges' if row.diverged else 'bit-identical'}")
                if on_point is not None:
                    on_point(row)
        if sf is not None:
            sf.finish(complete=True)
            return sf.result()
        return SweepResult(params=params, points=names, kinds=kinds, rows=rows, complete=True)
    finally:
        if sf is not None:
            sf.close()


#: the block-size axis when none is given (and the one recorded for scenarios without KV blocks)
DEFAULT_BLOCK_SIZES = [default(None, "block_size")]


def block_axis(block_sizes: str | list[int] | None, block_size: int | None = None) -> str | list[int] | None:
    """The block-size axis: ``block_sizes``, or the one ``block_size``; None when neither is given
    (:func:`sweep` then uses :data:`DEFAULT_BLOCK_SIZES` where the scenario has KV blocks).

    Raises:
        TracerError: both given.
    """
    if block_size is not None and block_sizes is not None:
        raise TracerError("give --block-size or --block-sizes, not both")
    return block_sizes if block_sizes is not None else (None if block_size is None else [block_size])


def _axes(lengths: str | list[int], block_sizes: str | list[int], cache_hit: bool = True) -> tuple[list[int], list[int]]:
    """The length and block-size axes, checked: non-empty, positive blocks, and (``cache_hit``: a
    scenario that reuses a cached prefix of whole blocks) lengths above every block, else at least 2."""
    ns = parse_int_list(lengths, "--lengths") if isinstance(lengths, str) else [int(x) for x in lengths]
    bs = parse_int_list(block_sizes, "--block-sizes") if isinstance(block_sizes, str) else [int(x) for x in block_sizes]
    if not ns or not bs:
        raise TracerError("a sweep needs at least one length and one block size")
    if min(bs) < 1:
        raise TracerError(f"--block-size must be a positive number of tokens, got {min(bs)}")
    if not cache_hit and min(ns) < 2:
        raise TracerError(f"--lengths starts at {min(ns)}; a comparison needs at least 2 tokens")
    if cache_hit and min(ns) <= max(bs):
        raise TracerError(f"--lengths starts at {min(ns)}, but a cache hit needs more than one KV block "
                          f"({max(bs)} tokens); start the lengths at {max(bs) + 1} or more")
    return ns, bs


def _sweep_path(cfg: RunConfig, scenario: str) -> Path | None:
    """The sweep file (None: in memory), refused when it is a folder or another kind of file."""
    if cfg.store.mode == "none":
        return None

    engine = "" if is_reference(cfg.scenario.engine) else f"-{cfg.scenario.engine}"
    out = check_name_length(cfg.store.output if cfg.store.output is not None
                            else default_output(cfg.model.name, scenario + engine), "--output")
    check_output_path(out, cfg.store.overwrite, "--output", resume=True)  # before is_sweep_file opens it
    if out.is_dir():
        raise TracerError(f"--output {out} is a directory; give a file path ending in .h5")
    if out.exists() and not cfg.store.overwrite and not is_sweep_file(out):
        raise TracerError(f"{out} exists and is not a sweep file; choose another --output")
    return out


def _point_scenario(cfg: RunConfig, n: int, block_size: int | None) -> Scenario:
    params = cfg.scenario.params()
    if block_size is not None:
        params["block_size"] = block_size
    return check_resources(realise(make_scenario(cfg.scenario.name, n, params), params.get("engine")))


def _run_point(pipeline: Any, cfg: RunConfig, loaded: LoadedModel, ids: list[int], scen: Scenario, tmp: Path | None) -> Any:
    """One point: compared online, or stored in the temporary trace ``tmp`` (``keep_tensors``)."""
    if tmp is None:
        return pipeline.run_scenario(loaded, ids, scen, cfg.capture).comparison
    header = pipeline.trace_header(loaded, scen, len(ids), cfg.capture, "tensors")
    with pipeline.open_writer(tmp, header, overwrite=True) as writer:
        return pipeline.run_scenario(loaded, ids, scen, cfg.capture, writer=writer, online=False,
                                     header=header, trace=str(tmp)).comparison


__all__ = ["sweep", "parse_int_list", "plan_points", "row_from_comparison", "SweepResult", "SweepRow", "SweepFile",
           "read_sweep", "is_sweep_file", "default_output", "compress_ranges", "MATRIX_FIELDS", "ROW_FIELDS"]
