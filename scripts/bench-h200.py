"""The fair bench on a GPU: tracer against its floor and its peers, with an independent plain loop as a cross-check.

    python3 scripts/bench-h200.py --prepare          # here, where pip reaches PyPI: nnsight 0.8.1 and the
                                                     # wheels it needs besides the image's, into .whl/ (git-ignored)
    python3 scripts/bench-h200.py OUT                # on the GPU machine (Python 3.12, torch 2.11, transformers 5.17)
    python3 scripts/bench-h200.py OUT --device cpu --model tiny-llama --lengths 64 --reps 2   # a check on the CPU

The launch-bound targets alone (N = 1024 and 4096, 21 repetitions each, where the README's table
used 15; the GPU tests and the host work included), from the checkout with ``.whl`` (``--prepare``)
carried to the GPU machine; expected well under 8 minutes (the default run, N = 32768 included,
takes about 5)::

    python3 scripts/bench-h200.py $OUT/bench --lengths "1024 4096" --reps "21 21"

On the GPU it first installs ``.whl/*.whl`` into ``/tmp/site`` (when ``.whl`` is there) and puts
that folder first on the import path. Then, for each ``--lengths`` N (default 1024, 4096 and
32768), one ``tracer bench`` (:func:`tracer.loops.bench.bench`): ``--model`` (default
``qwen3-0.6b-shape``, random init with Qwen3-0.6B's shapes), bf16, prefix-cache, ``layers``,
``--no-kv-cache``, the peers, traces in ``/dev/shm`` when it exists, interleaved, the order
rotating every repetition. In the same loop it times a plain loop of the same forward calls
written here, independently of the bench's floor (:func:`plain_loop`): the issue's
"floor within 5 % of a plain loop of the same forwards". On CUDA it also runs the GPU tests of
the code the bench measures (before the bench: a failure stops nothing) and counts the host work
of one run (``scripts/host-work.py`` at the first N).

The trace writer of (c) is a background thread unless ``TRACER_WRITER=process`` (the writer
process, :mod:`tracer.store.writer_process`); the versions line of ``tables.txt`` names it. To
set the two side by side, run the script twice in one lease, into two OUT folders::

    python3 scripts/bench-h200.py $OUT/thread --lengths "1024 4096" --reps "15 15" --no-tests
    TRACER_WRITER=process python3 scripts/bench-h200.py $OUT/process --lengths "1024 4096" --reps "15 15" --no-tests

Writes to OUT (four files): ``bench.json`` (every bench's JSON, the versions, the command),
``tables.txt`` (the summary table with the targets, then each bench's own table), ``host-work.json``
and ``log.txt`` (progress, the tests' output). Finishes in about 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/site")
#: nnsight 0.8.1 and what it needs beyond the GPU image's packages (docs of the image: KINDS.md)
PINS = ("nnsight==0.8.1", "greenlet==3.5.6", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
        "typing-inspection==0.4.5", "typing-extensions==4.16.0", "websocket-client==1.9.2", "zstandard==0.25.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
#: the GPU tests of what the bench measures (captures by reference, the one-pass comparison, CUDA graphs)
TESTS = ("tests/test_pipeline_fast_path.py", "tests/loops/test_floor.py")


def prepare() -> None:
    """Download :data:`PINS` for CPython 3.12 on x86-64 Linux into ``.whl/``."""
    WHEELS.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *(x for p in PLATFORMS for x in ("--platform", p)), "-d", str(WHEELS), *PINS]
    subprocess.run(cmd, check=True)
    names = sorted(p.name for p in WHEELS.glob("*.whl"))
    size = sum(p.stat().st_size for p in WHEELS.glob("*.whl")) / 2**20
    print(f"{len(names)} wheels, {size:.1f} MiB in {WHEELS}:\n  " + "\n  ".join(names))


def install() -> str:
    """Install ``.whl/*.whl`` into /tmp/site (once) and put it first on the import path; what happened, in words."""
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    if not wheels:
        return "no .whl folder: the peers use what is installed"
    if sys.version_info[:2] != (3, 12):
        return f"the wheels in .whl are for CPython 3.12, this is {platform.python_version()}: the peers use what is installed"
    if not (SITE / "nnsight").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    sys.path.insert(0, str(SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return f"installed {len(wheels)} wheels into {SITE}"


def plain_loop(model, ids, scen):
    """The prefix-cache scenario's forward calls as a user writes them, independently of tracer's
    floor: ``m(ids)``; then ``o = m(ids[:, :P])`` and ``m(ids[:, P:], <cache>=o.<cache>)``."""
    import inspect

    import torch

    arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    p = scen.window[0]

    def run() -> None:
        with torch.inference_mode():
            model(input_ids=ids)
            out = model(input_ids=ids[:, :p])
            model(input_ids=ids[:, p:], **{arg: getattr(out, arg)})

    return run


def versions(device: str) -> dict:
    import torch
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
         "cores": os.cpu_count(), "trace_writer": os.environ.get("TRACER_WRITER", "") or "thread"}
    try:
        import nnsight

        v["nnsight"] = nnsight.__version__
    except ImportError:
        v["nnsight"] = None
    if device.startswith("cuda"):
        v["gpu"] = torch.cuda.get_device_name(0)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        v["driver"] = smi.stdout.strip() or None
    return v


def _mark(x: float, target: float) -> str:
    return f"{x:.3f} {'✓' if x <= target else '✗'}"


def summary(results: list[dict]) -> str:
    """The summary table: one row per N, the ratios to (a) of the same run (medians), with the targets."""
    head = ("N", "reps", "(a) ms", "plain ms", "(a)÷plain", "(b) none", "HF hidden", "hooks", "nnsight",
            "(b)÷fastest", "(c) tensors", "(c) auto")
    rows = [head]
    for d in results:
        r, m = d["ratios"], d["median_s"]
        peers = [r.get(f"peer_{k}_over_a") for k in ("hf", "hooks", "nnsight")]
        fastest = min((x for x in peers if x is not None), default=None)
        rows.append((str(d["config"]["length"]), str(d["config"]["reps"]), f"{m['a'] * 1e3:.1f}",
                     f"{m['plain'] * 1e3:.1f}" if "plain" in m else "",
                     f"{r['a_over_plain']:.3f}" if "a_over_plain" in r else "",
                     _mark(r["b_over_a"], min(1.05, fastest + 0.02) if fastest else 1.05),
                     *(f"{x:.3f}" if x is not None else "skipped" for x in peers),
                     f"{r['b_over_fastest_peer']:.3f}" if "b_over_fastest_peer" in r else "",
                     _mark(r["c_over_a"], 1.15), _mark(r["c_auto_over_a"], 1.15)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for d in results:  # the same ratios paired by repetition (tracer.loops.bench.BenchResult.paired_ratios)
        p = d.get("paired_ratios", {})
        cells = [f"{k} {p[v]:.3f}" for k, v in (("(a)÷plain", "a_over_plain"), ("(b)", "b_over_a"),
                 ("HF", "peer_hf_over_a"), ("hooks", "peer_hooks_over_a"), ("nnsight", "peer_nnsight_over_a"),
                 ("(c) tensors", "c_over_a"), ("(c) auto", "c_auto_over_a")) if v in p]
        if cells:
            lines.append(f"N = {d['config']['length']}, median of the per-repetition ratios: " + ", ".join(cells))
    notes = ["targets: (b) ≤ 1.05 × (a) and ≤ the fastest peer's ratio + 0.02; (c) ≤ 1.15 × (a); (a) within 5 % of "
             "the plain loop; N = 32768 no worse than 1.03 (b) / 1.07 (c)"]
    return "\n".join(lines + notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--prepare", action="store_true", help="download the wheels into .whl/ (here, with PyPI)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="1024 4096 32768")
    ap.add_argument("--reps", default="15 15 5", help="repetitions per length (one number: all)")
    ap.add_argument("--tests", action=argparse.BooleanOptionalAction, default=None,
                    help="run the GPU tests first (default: on CUDA)")
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    if not args.out:
        ap.error("give OUT (a folder) or --prepare")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a", buffering=1)

    def say(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log.write(line + "\n")

    say(install())
    sys.path.insert(0, str(ROOT))
    cuda = args.device.startswith("cuda")
    if args.tests if args.tests is not None else cuda:
        say(f"GPU tests: {' '.join(TESTS)}")
        t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                           cwd=ROOT, capture_output=True, text=True, timeout=240)
        log.write(t.stdout[-6000:] + t.stderr[-2000:])
        say(f"tests: exit {t.returncode}: {t.stdout.strip().splitlines()[-1] if t.stdout.strip() else ''}")
    from rich.console import Console

    from tracer.loops.bench import bench
    from tracer.report.bench import table

    lengths = [int(x) for x in args.lengths.split()]
    reps = [int(x) for x in args.reps.split()]
    reps = reps * len(lengths) if len(reps) == 1 else reps
    if len(reps) < len(lengths):  # zip would skip the last lengths without a word
        ap.error(f"--reps gives {len(reps)} counts for {len(lengths)} lengths; give one count, or one per length")
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    doc = {"command": " ".join(sys.argv), "versions": versions(args.device), "benches": []}
    tables = []
    for n, r in zip(lengths, reps):
        say(f"bench N={n}, {r} reps")
        t0 = time.time()
        res = bench(args.model, length=n, dtype=args.dtype, device=args.device, kv_cache=False, reps=r, warmup=1,
                    outdir=str(scratch / f"tracer-bench-{os.getpid()}") if scratch else None,
                    extra_modes={"plain": plain_loop}, progress=lambda m, n=n: say(f"N={n}: {m}"))
        d = res.to_dict()
        doc["benches"].append(d)
        (out / "bench.json").write_text(json.dumps(doc, indent=2))
        console = Console(width=170, record=True, file=open(os.devnull, "w"))
        console.print(table(res))
        tables.append(console.export_text())
        say(f"N={n} done in {time.time() - t0:.0f} s: (a) {d['median_s']['a'] * 1e3:.1f} ms, "
            f"(b)/(a) {d['ratios']['b_over_a']:.3f}, (a)/plain {d['ratios'].get('a_over_plain', float('nan')):.3f}")
        head = f"{doc['versions']}\n{doc['command']}\n\n"
        (out / "tables.txt").write_text(head + summary(doc["benches"]) + "\n\n" + "\n".join(tables))
    say("host work of one run")
    h = subprocess.run([sys.executable, str(ROOT / "scripts" / "host-work.py"), args.model, "--length", str(lengths[0]),
                        "--device", args.device, "--dtype", args.dtype, "--reps", "5",
                        "--json", str(out / "host-work.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    log.write(h.stdout + h.stderr[-3000:])
    say(f"host work: exit {h.returncode}")
    say("done")


if __name__ == "__main__":
    main()
