"""Benchmark: tracer's overhead over the model's own forward pass, and its I/O against the disk.

All modes run in one process, interleaved (a, b, c, d, e, a, b, ...), after warm-up, so ratios
are measured side by side on the same machine state. Reported: median and min–max of each mode's
wall time, the ratios the performance targets use, and peak host / device memory.

Modes (one "repetition" of a mode = the scenario's two run plans, A then B):
    a  floor: both plans with no hooks
    b  tracer, online comparison (``--store none``: captures compared on the model's device, no file)
    c  tracer writing the HDF5 trace of every tensor (``--store tensors``)
    c_auto  tracer with the default ``--store auto`` (every point compared on the device; full
       tensors of the logits and the points around the origin within ``--max-trace-size``)
    d  ``compare`` from the stored trace (no model)
    e  raw sequential write and read of the same number of bytes (plain file I/O, same folder)

Peers (:mod:`tracer.loops.peers`), in the same loop, each doing mode b's job the way people do it
without tracer (both plans, the same KV-cache reuse, per-layer differing elements on the
compared window): ``peer_hf`` (HF ``output_hidden_states=True``), ``peer_hooks`` (forward hooks
+ ``.cpu()``) and ``peer_nnsight`` (nnsight ``.save()``, when nnsight is installed). Every
repetition checks each peer's per-layer counts against tracer's, and the bench refuses
(:class:`~tracer.errors.TracerError`) when they differ: timings of different work are useless.
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
from tracer.engines.door import run_bare
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
        peer's time over (a), and (b) over the fastest peer's."""
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
        return r

    def schema_extras(self, doc: dict[str, Any]) -> None:
        """The JSON document of ``tracer bench --json``: the fields, and the derived medians, min, max and ratios."""
        doc["median_s"] = {m: self.median(m) for m in self.times}
        doc["min_s"] = {m: min(v) for m, v in self.times.items()}
        doc["max_s"] = {m: max(v) for m, v in self.times.items()}
        doc["ratios"] = self.ratios()


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


def _peer_modes(lm: Any, ids: list[int], scen: Any, points: list[Any], tracer_counts: dict[str, int],
                result: BenchResult, say: Callable[[str], None]) -> dict[str, Callable[[], dict[str, int]]]:
    """The peers that run here (mode name → callable returning their counts), each checked once
    against tracer's counts; the skipped ones and why go to ``result.peers``.

    Raises:
        TracerError: a peer whose counts differ from tracer's (:func:`tracer.loops.peers.check_counts`).
    """
    modes = {}
    for peer in peer_mod.make_peers(lm, ids, scen, points):
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


def bench(model: str = "smollm2-135m", *, length: int = 1024, dtype: str = "bfloat16",
          device: str | None = None, granularity: str = "layers", block_size: int = 16,
          reps: int = 5, warmup: int = 1, outdir: str | None = None, gguf: str | None = None,
          kv_cache: bool = True, peers: bool = True,
          progress: Callable[[str], None] | None = None) -> BenchResult:
    """Measure modes a–e and the peers for one model/dtype/device/length (see the module docstring).

    ``kv_cache``: capture the per-layer KV-cache points (:func:`tracer.execute.points.discover_points`).
    Mode (d) computes the metrics on the model's device, as ``tracer compare`` does by default.
    ``peers``: also measure the peers (:mod:`tracer.loops.peers`), in the same loop.

    Raises:
        TracerError: bad model/options (as :func:`tracer.api.run`); a peer whose per-layer
            differing counts are not tracer's (in any repetition).
    """
    say = progress or (lambda m: None)
    check_int(reps, "--reps", 1, MAX_REPS)  # 10**30 repetitions ran for ever
    check_int(warmup, "--warmup", 0, MAX_REPS)
    if outdir is not None and Path(outdir).exists() and not Path(outdir).is_dir():
        raise TracerError(f"--outdir {outdir} is a file; give a folder (it is created if missing)")
    if outdir is not None:
        check_output_path(Path(outdir) / "bench.h5", True, "--outdir")  # name length, writable folder
    cfg = validate(RunConfig.from_options(model=model, length=length, dtype=dtype, device=device, gguf=gguf,
                                          block_size=block_size, granularity=granularity, kv_cache=kv_cache,
                                          store="none"))
    lm = pipeline.load(cfg)
    dev = lm.info.device
    own_folder = outdir is None
    folder = Path(outdir or tempfile.mkdtemp(prefix="tracer-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    # files of our own, never a name the user may already have there
    scratch = Path(tempfile.mkdtemp(prefix="tracer-bench-", dir=folder)) if not own_folder else folder
    trace = scratch / "bench-trace.h5"
    raw = scratch / "bench-raw.bin"
    stored = cfg.with_options(store="tensors", output=str(trace), overwrite=True)
    auto = cfg.with_options(store="auto", output=str(scratch / "bench-auto.h5"), overwrite=True)

    try:
        first = pipeline.run(cfg, lm)
        ids, scen = first.token_ids, first.scenario
        # how much of the captured data differs: the comparison's float64 work is done only where
        # something differs, so (b) and (d) depend on it
        pts = list(first.comparison.points)
        differing = sum(p.diff.n_diff for p in pts) / max(1, sum(p.diff.n_total for p in pts))
        points = pipeline.capture_points(lm, cfg.capture)
        result = BenchResult(config={"model": model, "length": length, "dtype": dtype, "device": dev,
                                     "granularity": granularity, "kv_cache": kv_cache, "block_size": block_size,
                                     "reps": reps, "warmup": warmup, "differing_fraction": differing,
                                     "n_points": len(points), "folder": str(folder)})
        peer_modes = _peer_modes(lm, ids, scen, points, _counts(first.comparison), result, say) if peers else {}
        del first
        last: dict[str, Any] = {}

        def mode_b() -> None:
            last["b"] = _counts(pipeline.run(cfg, lm).comparison)

        modes: dict[str, Callable[[], Any]] = {"a": lambda: run_bare(lm, ids, scen), "b": mode_b}
        for name, run in peer_modes.items():
            modes[name] = lambda run=run, name=name: last.__setitem__(name, run())
        modes["c"] = lambda: pipeline.run(stored, lm)
        modes["c_auto"] = lambda: pipeline.run(auto, lm)
        modes["d"] = lambda: compare_trace(str(trace), device=dev)
        result.times = {m: [] for m in list(modes) + ["e_write", "e_read"]}
        if dev.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        for i in range(warmup + reps):
            say(f"repetition {i + 1}/{warmup + reps}" + (" (warm-up)" if i < warmup else ""))
            t = {m: _timed(fn, dev) for m, fn in modes.items()}
            for name in peer_modes:  # every repetition: the peers did the same work as tracer's (b)
                peer_mod.check_counts(name, last[name], last["b"])
            nbytes = trace.stat().st_size
            t["e_write"] = _timed(lambda: _raw_write(raw, nbytes), "cpu")
            t["e_read"] = _timed(lambda: _raw_read(raw), "cpu")
            if i >= warmup:
                for k, v in t.items():
                    result.times[k].append(v)
            result.trace_bytes = nbytes
        result.peak_host_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if dev.startswith("cuda"):
            result.peak_device_mb = torch.cuda.max_memory_allocated() / 2**20
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # our own folder: the trace, the raw file, any partial
    if own_folder:
        result.config["folder"] = None
    return result


def to_json(result: BenchResult) -> str:
    """:meth:`BenchResult.to_dict` as indented JSON."""
    return json.dumps(result.to_dict(), indent=2)

