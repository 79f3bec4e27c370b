"""How long a mistyped ``tracer run`` takes to say what is wrong (issue 25, item 5: under 2 s).

Not among the cases, because they need the tokenized prompt (so the tokenizer, and with it the
model): a ``--split-at``/``--block-size`` beyond a text prompt's length, a non-empty text that
tokenizes to nothing, token ids beyond the vocabulary; with ``--length N`` the first is caught early.

    python benchmarks/input_errors.py [--reps 5]

Runs every case of :data:`CASES` as a whole process (``python -m tracer run ...``) in a scratch
folder, ``--reps`` times, and prints per case the median wall time, the exit code and the first
line of stderr. ``tests/load/test_preflight.py`` checks the same cases for exit code 2, a one-line
error and no torch/transformers import; the times are measured here, not in a test.
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


def scratch() -> Path:
    """A folder with the files the cases name: ``exists.txt``, an ``empty.txt`` and a malformed ``bad.json``."""
    d = Path(tempfile.mkdtemp(prefix="tracer-input-errors-"))
    (d / "exists.txt").write_text("hello\n")
    (d / "empty.txt").write_text("")
    (d / "bad.json").write_text("[1, 2")
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACER_PROGRESS": "off"}
    folder = scratch()
    print(f"{'median s':>9}  {'max s':>6}  rc  tracer run ...  ->  error")
    for argv, _ in CASES:
        times, proc = [], None
        for _ in range(args.reps):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "tracer", "run", *argv], cwd=folder, env=env,
                                  capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
        first = next((x for x in proc.stderr.splitlines() if x.strip()), "")[:100]
        print(f"{statistics.median(times):9.2f}  {max(times):6.2f}  {proc.returncode:2d}  {' '.join(argv)}  ->  {first}")


if __name__ == "__main__":
    main()
