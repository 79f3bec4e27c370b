"""Where one `tracer run`'s host time goes, phase by phase, against the plain forward calls it makes.

    PYTHONPATH=$PWD python3 scripts/run-phases.py OUT [--model M] [--length N] [--device cuda|cpu] [--reps R]
        [--profile] [--writer-process]

On a GPU whose forward is launch-bound (qwen3-0.6b-shape at N = 1024 on an H200: the GPU busy
about 21 of the plain loop's 70-120 ms) every millisecond of host work a run adds is wall time.
This times, in one process, interleaved after two warm-ups, the plain loop of the scenario's
forward calls (:func:`tracer.loops.floor.plain_forwards`, the bench's floor) and ``tracer run``
with ``--store none``, ``tensors`` and ``auto`` (prefix-cache, ``layers``, ``--no-kv-cache``,
traces in ``/dev/shm`` when it exists): wall and thread CPU time (median and min) and the median of
the per-repetition ratios to the plain loop. Then, 7 runs of each store mode with each phase of the
pipeline timed on the host (no extra synchronisation; nested phases include their children):
``prepare``, ``trace_header``, ``open_writer``, ``execute_plan`` (``forward_chunks``: the forward
calls with the capture), ``hand_over``, ``run_facts``, ``compare_records``, ``store_auto``.
``--profile`` adds cProfile of one plain loop and one run of ``none`` and ``tensors`` (host time per
file, the top functions) and ``torch.profiler`` counts (kernels, launches, copies, synchronisations,
the GPU's busy time, the aten operators' host time). Writes ``OUT/run-phases-N.txt`` and prints it.
Comparison graphs (:mod:`tracer.diff.graphed`): ``TRACER_COMPARE_GRAPHS=off`` to time without.
``--writer-process`` adds ``tensors-p`` and ``auto-p``: the same runs with the trace writer in its
own process (``TRACER_WRITER=process``, :mod:`tracer.store.writer_process`), in the same loop.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tracer import pipeline  # noqa: E402
from tracer.config import RunConfig  # noqa: E402
from tracer.engines import door  # noqa: E402
from tracer.engines.hf import run as hf_run  # noqa: E402
from tracer.load.devices import model_device  # noqa: E402
from tracer.loops import floor  # noqa: E402
from tracer.validate import validate  # noqa: E402

PHASES = [(pipeline, "prepare"), (pipeline, "trace_header"), (pipeline, "open_writer"), (door, "execute_plan"),
          (hf_run, "forward_chunks"), (pipeline, "hand_over"), (pipeline, "run_facts"),
          (pipeline, "compare_records"), (pipeline, "store_auto")]
CUDA_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
              "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for run-phases-N.txt (created)")
    ap.add_argument("--model", default="qwen3-0.6b-shape", help="built-in model or recipe (default: %(default)s)")
    ap.add_argument("--length", type=int, default=1024, help="prompt tokens N (default: %(default)s)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions of each mode (default: %(default)s)")
    ap.add_argument("--profile", action="store_true", help="also cProfile and torch.profiler sections")
    ap.add_argument("--writer-process", action="store_true",
                    help="also time tensors and auto with the trace writer in its own process (TRACER_WRITER=process)"
                         " beside the thread's, in the same loop")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    log = open(out / f"run-phases-{args.length}.txt", "w")

    def say(*a: object) -> None:
        print(*a, file=log, flush=True)
        print(*a, flush=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    base = dict(model=args.model, length=args.length, device=args.device, dtype=args.dtype, kv_cache=False,
                scenario="prefix-cache", granularity="layers")
    cfgs = {"none": validate(RunConfig.from_options(**base, store="none"))}
    for mode in ("tensors", "auto"):
        cfgs[mode] = validate(RunConfig.from_options(**base, store=mode, overwrite=True,
                                                     output=str(folder / f"run-phases-{os.getpid()}-{mode}.h5")))
    lm = pipeline.load(cfgs["none"])
    first = pipeline.run(cfgs["none"], lm)
    ids = torch.tensor([first.token_ids], device=model_device(lm.model))
    def writing(cfg, writer: str):  # the store mode's run with the trace writer on a thread or in its process
        def run():
            os.environ["TRACER_WRITER"] = writer
            try:
                return pipeline.run(cfg, lm)
            finally:
                os.environ.pop("TRACER_WRITER")
        return run

    modes = {"plain": floor.plain_forwards(lm.model, ids, first.scenario), "none": lambda: pipeline.run(cfgs["none"], lm),
             **{m: writing(cfgs[m], "thread") for m in ("tensors", "auto")}}
    if args.writer_process:
        modes.update({f"{m}-p": writing(cfgs[m], "process") for m in ("tensors", "auto")})

    def timed(fn) -> tuple[float, float]:
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        c1 = time.thread_time()
        sync()
        return time.perf_counter() - t0, c1 - c0

    for fn in modes.values():
        fn()
        fn()
    wall = {k: [] for k in modes}
    cpu = {k: [] for k in modes}
    names = list(modes)
    for r in range(args.reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            w, c = timed(modes[k])
            wall[k].append(w)
            cpu[k].append(c)
    say(f"{args.model} N={args.length} {args.device} {args.dtype}, {args.reps} reps; torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}" if cuda else ""))
    for k in names:
        ratio = statistics.median(w / p for w, p in zip(wall[k], wall["plain"]))
        say(f"{k:9} wall median {statistics.median(wall[k]) * 1e3:7.1f} min {min(wall[k]) * 1e3:7.1f} ms   "
            f"CPU median {statistics.median(cpu[k]) * 1e3:7.1f} min {min(cpu[k]) * 1e3:7.1f} ms   ÷ plain {ratio:.3f}")
    spent: dict[str, float] = collections.defaultdict(float)
    originals = []
    for mod, name in PHASES:
        fn = getattr(mod, name)
        originals.append((mod, name, fn))

        def phase(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(mod, name, phase)
    try:
        for k in [m for m in modes if m != "plain"]:
            per: dict[str, list[float]] = collections.defaultdict(list)
            total = []
            for _ in range(7):
                spent.clear()
                total.append(timed(modes[k])[0])
                for p, v in spent.items():
                    per[p].append(v)
            say(f"phases of {k} (host ms, median of 7; nested phases include their children; "
                f"run {statistics.median(total) * 1e3:.1f} ms)")
            for p, v in per.items():
                say(f"   {p:16} {statistics.median(v) * 1e3:8.2f}")
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)
    if args.profile:
        profile(modes, sync, say, cuda)


def profile(modes: dict, sync, say, cuda: bool) -> None:
    """cProfile (host time per file, top functions) and torch.profiler counts of one run of each mode."""
    for k in ("plain", "none", "tensors"):
        prof = cProfile.Profile()
        sync()
        prof.enable()
        modes[k]()
        sync()
        prof.disable()
        st = pstats.Stats(prof)
        by_file: collections.Counter = collections.Counter()
        calls: collections.Counter = collections.Counter()
        for (fn, _line, _func), (_cc, nc, tt, _ct, _callers) in st.stats.items():
            f = fn.split("site-packages/")[-1]
            by_file[f] += tt
            calls[f] += nc
        say(f"== cProfile {k}: {sum(calls.values())} calls, {sum(by_file.values()) * 1e3:.1f} ms (profiled)")
        for f, t in by_file.most_common(20):
            say(f"   {t * 1e3:8.2f} ms {calls[f]:7d} {f}")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        say(s.getvalue()[-6000:])
    if not cuda:
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for k in ("plain", "none", "tensors"):
        sync()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            modes[k]()
            sync()
        events = prof.events()
        count = collections.Counter(e.name for e in events)
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        say(f"== torch.profiler {k}: {len(gpu)} kernels, GPU busy {sum(e.device_time for e in gpu) / 1e3:.1f} ms")
        for name in CUDA_CALLS:
            if count.get(name):
                host = sum(e.cpu_time_total for e in events if e.name == name) / 1e3
                say(f"   {name:24} {count[name]:5d}  host {host:7.2f} ms")
        ops = sorted((x for x in prof.key_averages() if x.key.startswith("aten::")), key=lambda x: -x.self_cpu_time_total)
        for x in ops[:15]:
            say(f"   {x.key:32} n={x.count:5d} self host {x.self_cpu_time_total / 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
