"""Benchmark: tracer's overhead over the model's own forward pass, and its I/O against the disk.

All modes run in one process, interleaved (a, b, c, d, e, a, b, ...), after warm-up, so ratios
are measured side by side on the same machine state. Reported: median and min–max of each mode's
wall time, the ratios the performance targets use, and peak host / device memory.

Modes (one "repetition" of a mode = the scenario's two run plans, A then B):
    a  floor: both plans with no hooks
    b  tracer, online comparison (``--store none``: captures compared on the model's device, no file)
    c  tracer writing the HDF5 trace (b + store)
    d  ``compare`` from the stored trace (no model)
    e  raw sequential write and read of the same number of bytes (plain file I/O, same folder)
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

MODES = ("a", "b", "c", "d", "e_write", "e_read")


@dataclass
class BenchResult:
    """Timings (seconds) per mode and derived ratios; see the module docstring."""

    config: dict[str, Any]
    times: dict[str, list[float]] = field(default_factory=dict)
    trace_bytes: int = 0
    peak_host_mb: float = 0.0
    peak_device_mb: float | None = None

    def median(self, mode: str) -> float:
        return statistics.median(self.times[mode])

    def ratios(self) -> dict[str, float]:
        """(b)/(a), (c)/(a), trace write and compare-read throughput relative to raw disk I/O."""
        a = self.median("a")
        r = {"b_over_a": self.median("b") / a, "c_over_a": self.median("c") / a}
        # bytes/s of (c) over its whole time (the forward passes included: a lower bound on the
        # store's own throughput; (c) - (b) is too noisy to divide by on short runs)
        write_s = self.median("c")
        raw_w = self.trace_bytes / self.median("e_write")
        raw_r = self.trace_bytes / self.median("e_read")
        r["c_write_bw_over_raw"] = (self.trace_bytes / write_s) / raw_w
        r["d_read_bw_over_raw"] = (self.trace_bytes / self.median("d")) / raw_r
        return r

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["median_s"] = {m: self.median(m) for m in self.times}
        d["min_s"] = {m: min(v) for m, v in self.times.items()}
        d["max_s"] = {m: max(v) for m, v in self.times.items()}
        d["ratios"] = self.ratios()
        return d


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


def bench(model: str = "smollm2-135m", *, length: int = 1024, dtype: str = "bfloat16",
          device: str | None = None, granularity: str = "layers", block_size: int = 16,
          reps: int = 5, warmup: int = 1, outdir: str | None = None, gguf: str | None = None,
          kv_cache: bool = True, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Measure modes a–e for one model/dtype/device/length (see the module docstring).

    ``kv_cache``: capture the per-layer KV-cache points (:func:`tracer.execute.capture.discover_points`).
    Mode (d) computes the metrics on the model's device, as ``tracer compare`` does by default.

    Raises:
        TracerError: bad model/options (as :func:`tracer.api.run`).
    """
    from tracer import pipeline
    from tracer.config import RunConfig, validate
    from tracer.diff.core import compare_trace
    from tracer.errors import TracerError

    say = progress or (lambda m: None)
    if outdir is not None and Path(outdir).exists() and not Path(outdir).is_dir():
        raise TracerError(f"--outdir {outdir} is a file; give a folder (it is created if missing)")
    if outdir is not None:
        from tracer.store.integrity import check_output_path

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

    first = pipeline.run(cfg, lm)
    ids, scen = first.token_ids, first.scenario
    # how much of the captured data differs: the comparison's float64 work is done only where
    # something differs, so (b) and (d) depend on it
    pts = list(first.comparison.points)
    differing = sum(p.diff.n_diff for p in pts) / max(1, sum(p.diff.n_total for p in pts))
    del first

    def mode_a() -> None:
        pipeline.run_bare(lm, ids, scen)

    def mode_b() -> None:
        pipeline.run(cfg, lm)

    def mode_c() -> None:
        pipeline.run(stored, lm)

    def mode_d() -> None:
        compare_trace(str(trace), device=dev)

    result = BenchResult(config={"model": model, "length": length, "dtype": dtype, "device": dev,
                                 "granularity": granularity, "kv_cache": kv_cache, "block_size": block_size,
                                 "reps": reps, "warmup": warmup, "differing_fraction": differing,
                                 "n_points": len(pipeline.capture_points(lm, cfg.capture)),
                                 "folder": str(folder)},
                         times={m: [] for m in MODES})
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + reps):
        say(f"repetition {i + 1}/{warmup + reps}" + (" (warm-up)" if i < warmup else ""))
        t = {
            "a": _timed(mode_a, dev),
            "b": _timed(mode_b, dev),
            "c": _timed(mode_c, dev),
            "d": _timed(mode_d, dev),
        }
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
    for p in (trace, raw):
        p.unlink(missing_ok=True)
    scratch.rmdir()
    if own_folder:
        result.config["folder"] = None
    return result


def table(result: BenchResult):
    """A rich Table of medians, min–max and the target ratios."""
    from rich.table import Table

    c = result.config
    kv = "" if c.get("kv_cache", True) else ", no KV cache"
    t = Table(title=f"tracer bench · {c['model']} · {c['dtype']} · {c['device']} · N={c['length']} · "
                    f"{c['granularity']} ({c['n_points']} points{kv}) · {c['reps']} reps",
              title_justify="left")
    t.add_column("mode")
    t.add_column("median s", justify="right")
    t.add_column("min–max s", justify="right")
    names = {"a": "(a) floor: two plans, no hooks", "b": "(b) tracer, online compare (no file)",
             "c": "(c) tracer + HDF5 trace", "d": "(d) compare from trace",
             "e_write": "(e) raw write, same bytes", "e_read": "(e) raw read, same bytes"}
    for m in MODES:
        v = result.times[m]
        t.add_row(names[m], f"{statistics.median(v):.4f}", f"{min(v):.4f}–{max(v):.4f}")
    r = result.ratios()
    t.add_section()
    t.add_row("(b)/(a)", f"{r['b_over_a']:.3f}", "target ≤ 1.10")
    t.add_row("(c)/(a)", f"{r['c_over_a']:.3f}", "target ≤ 1.5 where the disk is not the bound")
    t.add_row("(c) write bytes/s ÷ (e) write", f"{r['c_write_bw_over_raw']:.3f}",
              "target ≥ 0.7 (bytes over all of (c), forward included: a lower bound)")
    t.add_row("(d) read bytes/s ÷ (e) read", f"{r['d_read_bw_over_raw']:.3f}", "target ≥ 0.7 ((e) reads the file just written)")
    t.add_row("trace size", f"{result.trace_bytes / 2**20:.2f} MiB", "")
    if "differing_fraction" in c:
        t.add_row("captured elements that differ", f"{c['differing_fraction']:.1%}", "float64 work scales with it")
    t.add_row("peak host memory", f"{result.peak_host_mb:.0f} MiB", "")
    if result.peak_device_mb is not None:
        t.add_row("peak device memory", f"{result.peak_device_mb:.0f} MiB", "")
    return t


def to_json(result: BenchResult) -> str:
    return json.dumps(result.to_dict(), indent=2)
