"""How long a mistyped command takes to say what is wrong (under 2 s on a quiet 2-core machine).

Two lists, each case run as a whole process (``python -m tracer ...``) in a scratch folder:

- :data:`CASES`: mistakes of ``tracer run`` found before torch or transformers is imported
  (``tests/load/test_preflight.py`` checks each for exit code 2, a one-line error and no
  torch/transformers import);
- :data:`MISTAKES`: a newcomer's first hour, 22 mistakes across the commands (``run``, ``plot``,
  ``compare``, ``sweep``, ``audit``, ``report``), each refused before any model or trace body loads;
  the ones about the prompt's length (``--split-at``, ``--block-size`` against N of a text prompt)
  load the tokenizer alone (:func:`tracer.prompt_checks.check_prompt_length`), the rest need nothing.
  ``tests/load/test_preflight.py`` checks each for exit 2, one line, the model loader never called
  and no trace read (tiny-llama standing in for the default model, whose GGUF cache may not exist).

    python benchmarks/input_errors.py [--reps 5] [--only cases|mistakes]

Prints per case the median and max wall time, the exit code and the first line of stderr. The
times are measured here, never in a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (arguments of ``tracer run``, what the error is about); run in a folder holding exists.txt and bad.json
CASES: list[tuple[list[str], str]] = [
    (["smollm2-135"], "did you mean smollm2-135m"),
    (["no/such/model.gguf"], "does not exist"),
    (["org/not-cached-model"], "not in the local"),
    (["--prompt-file", "nope.txt"], "cannot read --prompt-file"),
    (["--token-ids-file", "nope.json"], "--token-ids-file"),
    (["--token-ids-file", "bad.json"], "--token-ids-file"),
    (["--prompt", "hi", "--prompt-file", "exists.txt"], "only one of"),
    (["--granularity", "sublayer"], "did you mean sublayers"),
    (["--device", "cuda"], "CUDA was requested"),
    (["--device", "tpu"], "unknown device"),
    (["--dtype", "bf17"], "unknown dtype"),
    (["--attn", "flash"], "unknown attention"),
    (["--scenario", "prefix-cach"], "did you mean prefix-cache"),
    (["--mitigation", "align"], "mitigation"),
    (["--store", "fast"], "unknown --store"),
    (["--format", "yaml"], "unknown format"),
    (["--columns", "diff,nope"], "unknown column"),
    (["--fail-on", "everything"], "unknown --fail-on"),
    (["--positions", "some"], "unknown --positions"),
    (["--length", "1"], "--length"),
    (["--scenario", "repeat", "--tp", "2"], "does not apply to scenario repeat"),
    (["--output", "exists.txt"], "exists"),
    (["--report", "exists.txt"], "exists"),
    (["--block-size", "0"], "--block-size"),
    (["--compression", "zip"], "--compression"),
    (["--max-trace-size", "lots"], "--max-trace-size"),
    (["--gguf", "nope.gguf"], "--gguf"),
    (["--decode", "-1"], "--decode"),
    (["--max-memory", "0=1GiB"], "--max-memory applies only with --device-map"),
    (["--device-map", "bogus"], "--device-map"),
    (["--scenario", "device", "--devices", "cpu,tpu"], "tpu"),
    (["--scenario", "kv-quant", "--kv-format", "fp3"], "unknown --kv-format"),
    (["--scenario", "tensor-parallel", "--tp-mode", "dist"], "unknown --tp-mode"),
    (["--scenario", "tensor-parallel", "--reduce", "sideways"], "unknown --reduce"),
    (["--scenario", "tensor-parallel", "--tp-mode", "distributed", "--verdict"], "--verdict"),
    (["--scenario", "batch", "--padding", "middle"], "unknown --padding"),
    (["--scenario", "repeat", "--mitigation", "aligned"], "prefix-cache only"),
    (["--prompt-file", "empty.txt"], "the prompt is empty"),
    (["--prompt", ""], "the prompt is empty"),
    (["--token-ids", "5,-1"], "token id -1 is negative"),
    (["--token-ids", "1,2,x"], "--token-ids '1,2,x' is not a list of integers"),
    (["--chat", "--token-ids", "1,2,3"], "--chat applies to text prompts"),
    (["--scenario", "rollout-vs-train", "--decode", "3"], "--decode does not apply to rollout-vs-train"),
    (["--scenario", "rollout-vs-train", "--train-dtype", "float16"], "not wider than the model's bfloat16"),
    (["--scenario", "rollout-vs-train", "--train-dtype", "int8"], "unknown dtype"),
]


#: a newcomer's first hour: 22 mistakes across the commands, ``(tracer arguments, what the error is about)``;
#: run in :func:`scratch` (``T.h5``: a small trace). The default model's prompt is 314 tokens.
MISTAKES: list[tuple[list[str], str]] = [
    (["run", "smollm2-135"], "did you mean smollm2-135m"),
    (["run", "--split-at", "4000"], "--split-at 4000 is outside"),  # the tokenizer gives N
    (["run", "--prompt", "hello world", "--split-at", "40"], "--split-at 40 is outside"),  # the tokenizer gives N
    (["run", "--prompt", "hello world", "--block-size", "16"], "more than one KV block"),  # the tokenizer gives N
    (["run", "--granularity", "sublayer"], "did you mean sublayers"),
    (["run", "--scenario", "prefix-cach"], "did you mean prefix-cache"),
    (["run", "--device", "cuda"], "CUDA was requested"),
    (["run", "--dtype", "bf17"], "unknown dtype"),
    (["run", "--prompt-file", "nope.txt"], "cannot read --prompt-file"),
    (["run", "--length", "1"], "--length"),
    (["run", "--output", "exists.txt"], "exists"),
    (["run", "--engine", "vllm", "--block-size", "16"], "vllm"),  # vLLM's CPU attention: a multiple of 32
    (["run", "--format", "yaml"], "unknown format"),
    (["run", "--frobnicate"], "No such option: --frobnicate"),
    (["run", "--mitigation", "align"], "unknown mitigation"),
    (["plot", "T.h5", "--kind", "nope"], "unknown plot kind"),
    (["plot", "T.h5", "-o", "figure.txt"], "must end in .png"),
    (["compare", "T.h5", "--format", "yaml"], "unknown format"),
    (["sweep", "--lengths", "10:5"], "--lengths"),
    (["audit", "--levels", "9"], "levels are 0-7"),
    (["audit", "--format", "yaml"], "yaml"),
    (["report", "T.h5", "-o", "r.txt"], "must end in .html"),
]


def scratch() -> Path:
    """A folder with the files the cases name: ``exists.txt``, an ``empty.txt``, a malformed
    ``bad.json`` and ``T.h5``, a small trace of two runs (written here, no model)."""
    d = Path(tempfile.mkdtemp(prefix="tracer-input-errors-"))
    (d / "exists.txt").write_text("hello\n")
    (d / "empty.txt").write_text("")
    (d / "bad.json").write_text("[1, 2")
    write_small_trace(d / "T.h5")
    return d


def write_small_trace(path: Path) -> None:
    """Two runs of 4 capture points over 6 tokens (random values, B off by one ULP from layer 1 on)."""
    import torch

    from tracer.execute.records import CaptureRecord, RunRecord
    from tracer.store.trace import TraceWriter

    g = torch.Generator().manual_seed(0)
    kinds = {"model.embed_tokens": "embedding", "model.layers.0": "layer", "model.layers.1": "layer",
             "model.norm": "final_norm", "lm_head": "logits"}
    a = {n: torch.randn(4, 16 if k == "logits" else 8, generator=g) for n, k in kinds.items()}
    b = {n: torch.nextafter(x, x + 1) if i >= 2 else x.clone() for i, (n, x) in enumerate(a.items())}
    with TraceWriter(path, header={"model": {"name": "tiny-llama"}, "scenario": {"name": "prefix-cache"}}) as w:
        for name, caps in (("A", a), ("B", b)):
            w.add_run(RunRecord(name, [1, 2, 3, 4, 5, 6], {"description": name}, (2, 6),
                                {n: CaptureRecord(n, kinds[n], x) for n, x in caps.items()}, meta={}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=("cases", "mistakes"), default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACER_PROGRESS": "off"}
    folder = scratch()
    runs = [] if args.only == "mistakes" else [(["run", *argv], about) for argv, about in CASES]
    runs += [] if args.only == "cases" else MISTAKES
    print(f"{'median s':>9}  {'max s':>6}  rc  tracer ...  ->  error")
    for argv, _ in runs:
        times, proc = [], None
        for _ in range(args.reps):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "tracer", *argv], cwd=folder, env=env,
                                  capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
        first = next((x for x in proc.stderr.splitlines() if x.strip()), "")[:100]
        print(f"{statistics.median(times):9.2f}  {max(times):6.2f}  {proc.returncode:2d}  {' '.join(argv)}  ->  {first}")


if __name__ == "__main__":
    main()
