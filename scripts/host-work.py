"""The host work of one tracer run beyond the plain forward calls it makes, counted and timed.

    PYTHONPATH=$PWD python3 scripts/host-work.py MODEL [--length N] [--device cpu|cuda] [--dtype D] [--reps R] [--json OUT]

On a GPU the forward passes of a small model are launch-bound: the GPU waits for the host, so
every microsecond of host work a tracer run adds to the scenario's forward calls is wall time.
This counts that work for ``tracer run --store none|tensors|auto`` (prefix-cache, ``--no-kv-cache``,
``layers``) against the same forward calls written as a plain loop (this script's own, not
tracer's floor), and times the host's share with the thread's CPU time, which other processes on
the machine do not inflate (the minimum and median of ``--reps``, interleaved):

    hooked calls   module calls that took PyTorch's hook path (a forward hook or pre-hook on the module)
    aten ops       operators dispatched (each costs host time); "kernels": those that are not views
                   (on a GPU, about one kernel launch each)
    syncs          .item()/int()/float() reads, .tolist(), .cpu(), .numpy() and torch.cuda.synchronize()
                   calls: each waits for the GPU when its tensor is there (on the CPU: the same code path)
    py calls       Python function calls (cProfile)
    cpu ms         the thread's CPU time of one run (min, median)
    writer ms      store modes: the CPU time of the trace writer's tasks on its background thread
                   (min, median), which the counts above leave out: it holds the GIL for much of it,
                   so on a launch-bound GPU it delays the launching thread (run B, then the close)
    h5 objects     groups, datasets and attributes of the trace (store modes)

With ``--device cuda`` it also counts the CUDA runtime calls of one run (torch.profiler):
kernel launches, memory copies and synchronisations. ``--gpu-path`` (on the CPU) takes the
decisions tracer takes on a GPU, where they differ by device: captures kept by reference, the
comparison's device-side passes (one pass over small chunks, results kept for one transfer,
every logits row), so the counts are those of a GPU run's code path; its CPU times then include
the device's work and say nothing about a GPU's host. A model without a tokenizer gets token ids
1..N. Prints a table and, with ``--json``, writes the numbers.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tracer import pipeline  # noqa: E402
from tracer.config import RunConfig  # noqa: E402
from tracer.load.hf_cache import cache_kwarg  # noqa: E402
from tracer.validate import validate  # noqa: E402

#: the Tensor methods counted as syncs; .item() is not among them: it dispatches aten::_local_scalar_dense, which
#: _Ops counts (scalar_reads) as it does int() and float(), so wrapping it too counted each .item() twice
SYNC_METHODS = ("tolist", "cpu", "numpy")


class _Ops(TorchDispatchMode):
    """Counts the aten operators dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.kernels = 0
        self.scalar_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.kernels += not func.is_view and func.overloadpacket is not torch.ops.aten._local_scalar_dense
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.scalar_reads += 1
        return func(*args, **(kwargs or {}))


class _Counts:
    """Hooked module calls and sync-type method calls inside the block (patches, counting only)."""

    def __enter__(self) -> "_Counts":
        self.hooked = 0
        self.syncs = collections.Counter()
        module = torch.nn.Module
        self._call = module._call_impl
        counts = self

        def call_impl(mod, *args, **kwargs):
            if mod._forward_hooks or mod._forward_pre_hooks:
                counts.hooked += 1
            return counts._call(mod, *args, **kwargs)

        module._call_impl = call_impl
        module.__call__ = call_impl
        self._methods = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}
        for m, fn in self._methods.items():
            def wrapped(t, *a, _fn=fn, _m=m, **k):
                counts.syncs[_m] += 1
                return _fn(t, *a, **k)
            setattr(torch.Tensor, m, wrapped)
        self._sync = torch.cuda.synchronize

        def synchronize(*a, **k):
            counts.syncs["cuda.synchronize"] += 1
            return self._sync(*a, **k)

        torch.cuda.synchronize = synchronize
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.Module._call_impl = self._call
        torch.nn.Module.__call__ = torch.nn.Module._wrapped_call_impl
        for m, fn in self._methods.items():
            setattr(torch.Tensor, m, fn)
        torch.cuda.synchronize = self._sync


def sync_count(counts: _Counts, ops: _Ops) -> int:
    """The syncs of one block: the calls of :data:`SYNC_METHODS` and ``torch.cuda.synchronize``, and the
    scalar reads (``.item()``, ``int()``, ``float()``: one ``aten::_local_scalar_dense`` each)."""
    return sum(counts.syncs.values()) + ops.scalar_reads


def _h5_objects(path: Path) -> dict[str, int] | None:
    import h5py

    if not path.exists():
        return None
    out = {"groups": 0, "datasets": 0, "attributes": 0}
    with h5py.File(path, "r") as f:
        out["attributes"] += len(f.attrs)

        def visit(name, obj):
            out["attributes"] += len(obj.attrs)
            out["groups" if isinstance(obj, h5py.Group) else "datasets"] += 1

        f.visititems(visit)
    return out


def _cuda_calls(fn) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = collections.Counter(e.name for e in prof.events())
    pick = {"launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"),
            "memcpy": ("cudaMemcpyAsync", "cudaMemcpy"),
            "syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")}
    return {k: sum(names.get(n, 0) for n in v) for k, v in pick.items()}


class _WriterTime:
    """The CPU time of the trace writer's tasks in this process (what
    :class:`~tracer.store.trace_file.TraceFile` does to the partial file, or with ``TRACER_WRITER=process``
    what :class:`~tracer.store.writer_process.RemoteTraceFile` does to send it: set-up, run, meta and
    comparison writes, on whichever thread runs them), summed while installed."""

    TASKS = ("create", "write_run", "set_meta", "remove_run", "write_comparison")

    def __init__(self) -> None:
        from tracer.store.trace_file import TraceFile
        from tracer.store.writer_process import RemoteTraceFile

        self.s = 0.0
        for cls in (TraceFile, RemoteTraceFile):
            for name in self.TASKS:
                fn = getattr(cls, name)

                def timed(*a, _fn=fn, **k):
                    t0 = time.thread_time()
                    try:
                        return _fn(*a, **k)
                    finally:
                        self.s += time.thread_time() - t0

                setattr(cls, name, timed)


def gpu_path() -> None:
    """Take, on the CPU, the decisions tracer takes on a GPU (see the module docstring)."""
    from tracer.diff import batch, logits, metrics, positions
    from tracer.execute import capture

    metrics.CHUNK_ELEMENTS = logits.CUDA_CHUNK_ELEMENTS  # a GPU's chunks: the batch's and the logits' rows
    positions.CHUNK_ELEMENTS = positions.CUDA_CHUNK_ELEMENTS

    try:  # the comparison's device decisions, set where its passes look them up
        from tracer.diff import passes
    except ImportError:  # an older tree: the batch's own module ran the passes
        passes = batch
    if hasattr(passes, "_dense"):
        passes._dense = lambda device, elements: elements <= passes.DENSE_ELEMENTS
    passes._defer = lambda device: True
    init = capture.Capture.__init__

    def by_reference(self, *a, **k):
        init(self, *a, **k)
        if self.reference is None:
            self.reference = True

    capture.Capture.__init__ = by_reference
    acc = logits.LogitsAccumulator.__init__
    logits.LogitsAccumulator.__init__ = lambda self, vocab, dense=None: acc(self, vocab, dense=True if dense is None else dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    ap.add_argument("--gpu-path", action="store_true")
    args = ap.parse_args()
    if args.gpu_path:
        gpu_path()
    torch.set_num_threads(1) if args.device == "cpu" else None
    folder = Path(tempfile.mkdtemp(prefix="host-work-"))
    base = dict(model=args.model, length=args.length, device=args.device, dtype=args.dtype, kv_cache=False)
    first = validate(RunConfig.from_options(**base, store="none"))
    lm = pipeline.load(first)
    if lm.tokenizer is None:
        base["token_ids"] = [1 + i % 200 for i in range(args.length)]
    cfgs = {s: validate(RunConfig.from_options(**base, store=s, overwrite=True,
                                               output=None if s == "none" else str(folder / f"{s}.h5")))
            for s in ("none", "tensors", "auto")}
    prep = pipeline.prepare(cfgs["none"], lm)
    scen, model = prep.scenario, lm.model
    ids = torch.tensor([prep.token_ids], device=next(model.parameters()).device)
    arg = cache_kwarg(model)  # the installed transformers' name (a deprecation wrapper hides it from co_varnames)

    def plain() -> None:  # this script's own loop: the scenario's forward calls, nothing else
        with torch.inference_mode():
            for plan in (scen.plan_a, scen.plan_b):
                cache = None
                for s, e in plan.chunks:
                    kw = {} if cache is None else {arg: cache}
                    out = model(input_ids=ids[:, s:e], use_cache=True, **kw)
                    cache = getattr(out, arg)

    def finish() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    modes = {"plain": plain, **{f"store {s}": (lambda c=c: pipeline.run(c, lm)) for s, c in cfgs.items()}}
    for fn in modes.values():  # warm-up
        fn()
        fn()
    rows = {}
    for name, fn in modes.items():
        with _Ops() as ops, _Counts() as counts:
            fn()
            finish()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        finish()
        prof.disable()
        rows[name] = {"hooked calls": counts.hooked, "aten ops": ops.n, "kernels": ops.kernels,
                      "syncs": sync_count(counts, ops),
                      "sync calls": dict(counts.syncs, scalar_reads=ops.scalar_reads),
                      "py calls": pstats.Stats(prof).total_calls}
        if args.device.startswith("cuda"):
            rows[name]["cuda"] = _cuda_calls(lambda fn=fn: fn())
        if name != "plain":
            rows[name]["h5 objects"] = _h5_objects(folder / f"{name.split()[1]}.h5")
    times = {name: [] for name in modes}
    writer, written = _WriterTime(), {name: [] for name in modes}
    for _ in range(args.reps):
        for name, fn in modes.items():
            finish()
            writer.s = 0.0
            t0 = time.thread_time()
            fn()
            finish()
            times[name].append(time.thread_time() - t0)
            written[name].append(writer.s)  # the writer's thread has finished: the run closed the trace
    for name, v in times.items():
        rows[name]["cpu ms"] = [round(min(v) * 1e3, 2), round(statistics.median(v) * 1e3, 2)]
        if name.startswith("store ") and name != "store none":
            w = written[name]
            rows[name]["writer ms"] = [round(min(w) * 1e3, 2), round(statistics.median(w) * 1e3, 2)]
    print(f"{args.model} N={args.length} {args.dtype} {args.device}{' (the GPU code path)' if args.gpu_path else ''} "
          f"prefix-cache --no-kv-cache, torch {torch.__version__}")
    keys = ["hooked calls", "aten ops", "kernels", "syncs", "py calls", "cpu ms"]
    print(f"{'':14}" + "".join(f"{k:>16}" for k in keys + ["writer ms"]) + "   h5 objects")
    for name, r in rows.items():
        extra = [r[k] - rows["plain"][k] for k in keys[:5]]
        cells = [f"{r[k]} (+{x})" if name != "plain" else str(r[k]) for k, x in zip(keys[:5], extra)]
        cells.append(f"{r['cpu ms'][0]}/{r['cpu ms'][1]}")
        cells.append(f"{r['writer ms'][0]}/{r['writer ms'][1]}" if "writer ms" in r else "")
        h5 = r.get("h5 objects")
        print(f"{name:14}" + "".join(f"{c:>16}" for c in cells) + (f"   {h5}" if h5 else ""))
        if "cuda" in r:
            print(f"{'':14}CUDA runtime calls: {r['cuda']}")
    for name, r in rows.items():
        print(f"{name}: sync calls {r['sync calls']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "length": args.length, "dtype": args.dtype,
                                               "device": args.device, "torch": torch.__version__, "modes": rows},
                                              indent=2))


if __name__ == "__main__":
    main()
