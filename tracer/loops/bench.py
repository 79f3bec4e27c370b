"""Benchmark: tracer's overhead over the model's own forward calls, and its I/O against the disk.

All modes run in one process, interleaved, after warm-up, so ratios are measured side by side on
the same machine state; the order of the timed modes rotates by one every repetition, so no mode
always follows the disk I/O or another mode's memory traffic. Reported: median and min–max of
each mode's wall time, the ratios the performance targets use, and peak host / device memory.
Each mode is timed from a synchronised device to a synchronised device (``torch.cuda.synchronize()``
on a GPU), nothing else in between.

Modes (one "repetition" of a mode = the scenario's two run plans, A then B):
    a  floor: the model's own forward calls of both plans as a user writes them without tracer
       (:func:`tracer.loops.floor.plain_forwards`; for prefix-cache ``m(ids)``, then
       ``o = m(ids[:, :P])`` and ``m(ids[:, P:], past_key_values=o.past_key_values)``): no
       pipeline, no plan objects, no hooks, no synchronisation but the one that ends the timing
    b  tracer, online comparison (``--store none``: captures compared on the model's device, no file)
    c  tracer writing the HDF5 trace of every tensor (``--store tensors``)
    c_auto  tracer with the default ``--store auto`` (every point compared on the device; full
       tensors of the logits and the points around the origin within ``--max-trace-size``)
    d  ``compare`` from the stored trace (no model)
    e  raw sequential write and read of the same number of bytes (plain file I/O, same folder)

Peers (:mod:`tracer.loops.peers`), in the same loop, each doing mode b's job the way its best
users do it without tracer (the floor's forward calls, per-layer differing elements on the
compared window): ``peer_hf`` (HF ``output_hidden_states=True``), ``peer_hooks`` (forward hooks
copying the window rows to pinned host memory) and ``peer_nnsight`` (nnsight ``.save()`` of the
window rows, when nnsight is installed). Every repetition checks each peer's per-layer counts
against tracer's, and the bench refuses (:class:`~tracer.errors.TracerError`) when they differ:
timings of different work are useless. ``extra_modes`` adds modes of the caller's own (a plain
loop written independently of the floor's code, as a cross-check: ``scripts/bench-h200.py``).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tracer import pipeline, schema
from tracer.config import RunConfig
from tracer.diff.compare import compare_trace
from tracer.errors import TracerError
from tracer.load.devices import model_device
from tracer.load.hf_cache import cache_kwarg
from tracer.loops import floor
from tracer.loops.bench_engine import repetition_label
from tracer.loops import peers as peer_mod  # looked up at call time: a test substitutes a peer
from tracer.plan.checks import check_int
from tracer.store.integrity import check_output_path
from tracer.validate import validate

#: tracer's own modes; the peers that run add theirs (:data:`tracer.loops.peers.PEERS`)
MODES = ("a", "b", "c", "c_auto", "d", "e_write", "e_read")


@dataclass
class BenchResult(schema.Record):
    """Timings (seconds) per mode and derived ratios; see the module docstring."""

    config: dict[str, Any]
    times: dict[str, list[float]] = field(default_factory=dict)
    trace_bytes: int = 0
    peak_host_mb: float = 0.0
    peak_device_mb: float | None = None
    #: peer name → {"status": "checked", "covers", "points"} or {"status": "skipped", "reason"}
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def median(self, mode: str) -> float:
        """The median wall time of ``mode`` (seconds)."""
        return statistics.median(self.times[mode])

    def ratios(self) -> dict[str, float]:
        """(b)/(a), (c)/(a), trace write and compare-read throughput relative to raw disk I/O, each
        peer's time over (a), (b) over the fastest peer's, and (a) over each extra mode's
        (``a_over_plain``: the floor against an independent plain loop of the same calls)."""
        a = self.median("a")
        r = {"b_over_a": self.median("b") / a, "c_over_a": self.median("c") / a}
        if self.times.get("c_auto"):
            r["c_auto_over_a"] = self.median("c_auto") / a
        # bytes/s of (c) over its whole time (the forward passes included: a lower bound on the
        # store's own throughput; (c) - (b) is too noisy to divide by on short runs)
        write_s = self.median("c")
        raw_w = self.trace_bytes / self.median("e_write")
        raw_r = self.trace_bytes / self.median("e_read")
        r["c_write_bw_over_raw"] = (self.trace_bytes / write_s) / raw_w
        r["d_read_bw_over_raw"] = (self.trace_bytes / self.median("d")) / raw_r
        peers = [m for m in self.times if m.startswith("peer_") and self.times[m]]
        for m in peers:
            r[f"{m}_over_a"] = self.median(m) / a
        if peers:  # the target: tracer (b) no slower than any peer
            r["b_over_fastest_peer"] = self.median("b") / min(self.median(m) for m in peers)
        for m in self.times:
            if m not in MODES and not m.startswith("peer_") and self.times[m]:
                r[f"a_over_{m}"] = a / self.median(m)
        return r

    def paired_ratios(self) -> dict[str, float]:
        """The same ratios to (a) as :meth:`ratios` (``b_over_a``, ``c_over_a``, ``c_auto_over_a``, each
        peer's, and ``a_over_<extra>``), each the median over repetitions of that repetition's own ratio
        (every mode of a repetition runs in one round, so a round's ratio is paired: it drops what a
        slow round does to all its modes; the ratio of medians does not)."""
        a = self.times.get("a") or []

        def paired(num: list[float], den: list[float]) -> float:
            return statistics.median(x / y for x, y in zip(num, den))

        r: dict[str, float] = {}
        for m, v in self.times.items():
            if not v or not a or m in ("a", "d", "e_write", "e_read"):
                continue
            if m in MODES or m.startswith("peer_"):
                r[f"{m}_over_a"] = paired(v, a)
            else:
                r[f"a_over_{m}"] = paired(a, v)
        return r

    def schema_extras(self, doc: dict[str, Any]) -> None:
        """The JSON document of ``tracer bench --json``: the fields, and the derived medians, min, max and ratios."""
        doc["median_s"] = {m: self.median(m) for m in self.times}
        doc["min_s"] = {m: min(v) for m, v in self.times.items()}
        doc["max_s"] = {m: max(v) for m, v in self.times.items()}
        doc["ratios"] = self.ratios()
        doc["paired_ratios"] = self.paired_ratios()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _raw_write(path: Path, nbytes: int, block: int = 16 << 20) -> None:
    buf = os.urandom(min(block, max(nbytes, 1)))
    left = nbytes
    with open(path, "wb") as f:
        while left > 0:
            n = min(left, len(buf))
            f.write(buf[:n])
            left -= n


def _raw_read(path: Path, block: int = 16 << 20) -> None:
    with open(path, "rb") as f:
        while f.read(block):
            pass


def _counts(comparison: Any) -> dict[str, int]:
    """Capture name → differing elements of tracer's comparison."""
    return {p.name: p.diff.n_diff for p in comparison.points}


def _peer_modes(made: list[Any], tracer_counts: dict[str, int], result: BenchResult,
                say: Callable[[str], None]) -> dict[str, Callable[[], dict[str, int]]]:
    """The peers of ``made`` that run here (mode name → callable returning their counts), each
    checked once against tracer's counts; the skipped ones and why go to ``result.peers``.

    Raises:
        TracerError: a peer whose counts differ from tracer's (:func:`tracer.loops.peers.check_counts`).
    """
    modes = {}
    for peer in made:
        if peer.run is not None:
            say(f"checking {peer.name}")
            try:
                got = peer.run()
            except TracerError as e:  # the peer cannot run this scenario or model: say why
                peer.skipped = str(e)
            else:
                peer_mod.check_counts(peer.name, got, tracer_counts)
                result.peers[peer.name] = {"status": "checked", "label": peer.label, "covers": peer.covers,
                                           "points": len(got)}
                modes[peer.name] = peer.run
        if peer.skipped is not None:
            result.peers[peer.name] = {"status": "skipped", "label": peer.label, "reason": peer.skipped}
    return modes


#: the most repetitions (and warm-up repetitions) ``bench`` runs
MAX_REPS = 1000

#: makes an extra mode: ``factory(model, ids (1, N) on the model's device, scenario)`` → the callable to time
ModeFactory = Callable[[Any, torch.Tensor, Any], Callable[[], Any]]


def bench(model: str = "smollm2-135m", *, length: int = 1024, dtype: str = "bfloat16",
          device: str | None = None, granularity: str = "layers", block_size: int | None = None,
          scenario: str = "prefix-cache", reps: int = 5, warmup: int = 1, outdir: str | None = None,
          gguf: str | None = None, kv_cache: bool = True, peers: bool = True,
          extra_modes: dict[str, ModeFactory] | None = None,
          progress: Callable[[str], None] | None = None) -> BenchResult:
    """Measure modes a–e and the peers for one model/dtype/device/length (see the module docstring).

    ``scenario``: one of :data:`tracer.loops.floor.SCENARIOS` (plans of plain forward calls).
    ``block_size``: prefix-cache's KV block size (None: the scenario's default; another scenario refuses it).
    ``kv_cache``: capture the per-layer KV-cache points (:func:`tracer.execute.points.discover_points`).
    Mode (d) computes the metrics on the model's device, as ``tracer compare`` does by default.
    ``peers``: also measure the peers (:mod:`tracer.loops.peers`), in the same loop.
    ``extra_modes``: name → :data:`ModeFactory`, timed in the same loop (names must not be the bench's own).

    Raises:
        TracerError: bad model/options (as :func:`tracer.api.run`), a scenario the floor cannot write,
            an extra mode named like one of the bench's; a peer whose per-layer differing counts are
            not tracer's (in any repetition).
    """
    say = progress or (lambda m: None)
    check_int(reps, "--reps", 1, MAX_REPS)  # 10**30 repetitions ran for ever
    check_int(warmup, "--warmup", 0, MAX_REPS)
    if scenario not in floor.SCENARIOS:
        raise TracerError(f"the bench measures the scenarios whose plans are plain forward calls: "
                          f"{', '.join(floor.SCENARIOS)}; not {scenario!r}")
    clash = sorted(set(extra_modes or {}) & (set(MODES) | set(peer_mod.PEERS)))
    if clash:
        raise TracerError(f"extra modes {', '.join(clash)} are named like the bench's own; rename them")
    if outdir is not None and Path(outdir).exists() and not Path(outdir).is_dir():
        raise TracerError(f"--outdir {outdir} is a file; give a folder (it is created if missing)")
    if outdir is not None:
        check_output_path(Path(outdir) / "bench.h5", True, "--outdir")  # name length, writable folder
    options = {} if block_size is None else {"block_size": block_size}  # None: the scenario's default
    cfg = validate(RunConfig.from_options(model=model, length=length, dtype=dtype, device=device, gguf=gguf,
                                          scenario=scenario, granularity=granularity, kv_cache=kv_cache,
                                          store="none", **options))
    lm = pipeline.load(cfg)
    own_folder = outdir is None
    folder = Path(outdir or tempfile.mkdtemp(prefix="tracer-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    # files of our own, never a name the user may already have there
    scratch = Path(tempfile.mkdtemp(prefix="tracer-bench-", dir=folder)) if not own_folder else folder
    trace = scratch / "bench-trace.h5"
    raw = scratch / "bench-raw.bin"
    stored = cfg.with_options(store="tensors", output=str(trace), overwrite=True)
    auto = cfg.with_options(store="auto", output=str(scratch / "bench-auto.h5"), overwrite=True)
    made: list[Any] = []
    try:
        result = _measure(lm, cfg, stored, auto, trace, raw, scenario, reps, warmup, peers, extra_modes or {},
                          made, say)
    finally:
        for peer in made:  # the model as the peers' libraries left it
            if peer.leftovers is not None:
                peer.leftovers.restore()
        shutil.rmtree(scratch, ignore_errors=True)  # our own folder: the trace, the raw file, any partial
    result.config["folder"] = None if own_folder else str(folder)
    return result


def _measure(lm: Any, cfg: RunConfig, stored: RunConfig, auto: RunConfig, trace: Path, raw: Path, scenario: str,
             reps: int, warmup: int, peers: bool, extra_modes: dict[str, ModeFactory], made: list[Any],
             say: Callable[[str], None]) -> BenchResult:
    """:func:`bench` once the model is loaded: the checks, the modes and the interleaved loop
    (``made`` receives the peers, for the caller to restore their leftovers)."""
    dev = lm.info.device
    first = pipeline.run(cfg, lm)
    ids, scen = first.token_ids, first.scenario
    ids_t = torch.tensor([ids], dtype=torch.long, device=model_device(lm.model))  # (1, N), before any timing
    # how much of the captured data differs: the comparison's float64 work is done only where
    # something differs, so (b) and (d) depend on it
    pts = list(first.comparison.points)
    differing = sum(p.diff.n_diff for p in pts) / max(1, sum(p.diff.n_total for p in pts))
    points = pipeline.capture_points(lm, cfg.capture)
    c = cfg.capture
    result = BenchResult(config={"model": cfg.model.name, "length": len(ids), "dtype": cfg.model.dtype, "device": dev,
                                 "scenario": scenario, "granularity": c.granularity, "kv_cache": c.kv_cache,
                                 "block_size": scen.params.get("block_size"), "reps": reps, "warmup": warmup,
                                 "differing_fraction": differing, "n_points": len(points),
                                 "floor": floor.describe(scen, cache_kwarg(lm.model))})
    last: dict[str, Any] = {}
    peer_modes: dict[str, Callable[[], dict[str, int]]] = {}
    if peers:
        made.extend(peer_mod.make_peers(lm, ids, scen, points))
        peer_modes = _peer_modes(made, _counts(first.comparison), result, say)
    del first

    def mode_b() -> None:
        last["b"] = _counts(pipeline.run(cfg, lm).comparison)

    modes: dict[str, Callable[[], Any]] = {"a": floor.plain_forwards(lm.model, ids_t, scen), "b": mode_b}
    for name, run in peer_modes.items():
        modes[name] = lambda run=run, name=name: last.__setitem__(name, run())
    modes["c"] = lambda: pipeline.run(stored, lm)
    modes["c_auto"] = lambda: pipeline.run(auto, lm)
    modes["d"] = lambda: compare_trace(str(trace), device=dev)
    for name, factory in extra_modes.items():
        modes[name] = factory(lm.model, ids_t, scen)
    pipeline.run(stored, lm)  # (d) reads the trace (c) writes: there is one before the first (d)
    result.times = {m: [] for m in list(modes) + ["e_write", "e_read"]}
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    order = list(modes)
    for i in range(warmup + reps):
        say(repetition_label(i, warmup, reps))
        turn = order[i % len(order):] + order[:i % len(order)]  # each mode follows each other one in turn
        t = {m: _timed(modes[m], dev) for m in turn}
        for name in peer_modes:  # every repetition: the peers did the same work as tracer's (b)
            peer_mod.check_counts(name, last[name], last["b"])
        nbytes = trace.stat().st_size
        t["e_write"] = _timed(lambda: _raw_write(raw, nbytes), "cpu")
        t["e_read"] = _timed(lambda: _raw_read(raw), "cpu")
        if i >= warmup:
            for k in result.times:
                result.times[k].append(t[k])
        result.trace_bytes = nbytes
    result.peak_host_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if dev.startswith("cuda"):
        result.peak_device_mb = torch.cuda.max_memory_allocated() / 2**20
    return result


def to_json(result: BenchResult) -> str:
    """:meth:`BenchResult.to_dict` as indented JSON."""
    return json.dumps(result.to_dict(), indent=2)

