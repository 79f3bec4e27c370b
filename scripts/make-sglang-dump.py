#!/usr/bin/env python3
"""Write a SYNTHETIC SGLang dump of SmolLM2-135M for the engine-dump example (no engine runs here).

    PYTHONPATH=$PWD python3 scripts/make-sglang-dump.py --out /tmp/sglang-dump --reference /tmp/hf-ref.h5

1. Runs the HF model (``tracer.run``, real SmolLM2-135M weights, bf16, sublayer capture hooks) on the
   built-in prompt with the prefix-cache scenario: run A = full prefill, run B = cache hit (the
   prefix cached, the suffix computed) - the reference trace ``--reference``.
2. Writes run B the way SGLang's dumper (python/sglang/srt/debug_utils/dumper.py, non-intrusive
   mode "all") would have for a TP-2 server answering that request from its prefix cache: fused
   ``qkv_proj``/``gate_up_proj``, ``(hidden_states, residual)`` layer outputs, norms returning
   ``(normed, residual)``, column-parallel outputs in two shards (rank=0, rank=1 files),
   ``input_ids``/``positions`` of the suffix only, the suffix split into chunked-prefill steps
   (``--chunk``), next-token logits - ``--out/dump_synthetic/step=..___rank=..___...pt``.

The values are HF's (the hooks' captures), not an engine's: comparing the dump with run B must
give bit-identical at every mapped point, and with run A it shows what a cache hit changes.
SmolLM2-135M has 9 attention heads, which a real TP-2 server could not shard by heads; the
synthetic shards split the columns evenly (288 of q's 576) - the importer does the same.
``--perturb NAME=DELTA`` adds DELTA to one HF capture point before writing (a planted defect).
"""

from __future__ import annotations

import argparse
import sys

import tracer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", required=True, help="dumper dir (files go to OUT/dump_synthetic/)")
    ap.add_argument("--reference", required=True, help="HF reference trace to write (runs A and B)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=None, help="prompt tokens (default: the built-in prompt)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=None, help="chunked-prefill step size (tokens)")
    ap.add_argument("--layout", default="sglang-dumper", choices=("sglang-dumper", "passes"))
    ap.add_argument("--perturb", action="append", default=[], help="HF capture NAME=DELTA (repeatable)")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()
    try:
        perturb = {k: float(v) for k, v in (p.split("=", 1) for p in args.perturb)}
    except ValueError:
        print("error: --perturb takes NAME=DELTA, e.g. model.layers.5.mlp=0.125", file=sys.stderr)
        return 2
    try:
        res = tracer.run(args.model, length=args.length, granularity="sublayers", output=args.reference,
                         overwrite=args.overwrite, progress=False)
        folder = tracer.write_sglang_dump(args.reference, "B", args.out, tp=args.tp, chunk=args.chunk,
                                          layout=args.layout, perturb=perturb or None,
                                          tokenizer_path=f"{args.model} (synthetic dump)")
    except tracer.TracerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lo, hi = res.comparison.positions
    print(f"reference: {args.reference} (A: full prefill of {len(res.token_ids)} tokens, B: cache hit, positions {lo}..{hi - 1})")
    print(f"synthetic SGLang dump of run B: {folder} (TP {args.tp}, layout {args.layout})")
    print(f"compare: tracer compare {args.reference}:B {folder}   (and :A for the full prefill)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
