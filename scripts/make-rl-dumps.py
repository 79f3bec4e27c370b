#!/usr/bin/env python3
"""Write a SYNTHETIC rollout dump (SGLang) and trainer dump (Megatron-LM, as Miles writes it) of one RL step.

    PYTHONPATH=$PWD python3 scripts/make-rl-dumps.py --out /tmp/rl

No engine and no trainer run here:

1. ``tracer.run(MODEL, scenario="rollout-vs-train", positions="all", granularity="sublayers")`` runs the HF
   model (real weights) as the rollout (run A: a batch of prompts, prefill then one decode step per
   token from the KV cache) and as the trainer (run B: one teacher-forced pass over prompt + response)
   and stores every tensor: the reference trace ``OUT/ref.h5``.
2. Run A is written the way SGLang's dumper (non-intrusive mode ``all``) writes a TP server's rollout of
   the traced sequence: the prompt's prefill step, then one step per generated token, next-token logits
   at every step, ``sglang_parallel_info`` (``OUT/rollout/dump_synthetic``).
3. Run B is written the way the same dumper writes inside a Megatron-LM trainer under Miles (``fwd_only``
   phase): megatron-core module names behind DDP/Float16Module, ``[s, b, ...]`` tensors, grouped
   ``linear_qkv``, TP/SP/CP shards, THD packing (``cu_seqlens_q``), the vocabulary padded,
   ``megatron_parallel_info`` (``OUT/trainer/fwd_only``).

The values are HF's (the hooks' captures), not SGLang's or Megatron's kernels: ``tracer compare`` of the two
dumps must reproduce, point for point, the trace's own rollout-vs-trainer comparison; with ``--perturb`` the
trainer dump carries a planted defect. Print the compare command at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tracer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", required=True, help="folder for ref.h5, rollout/ and trainer/ (must not hold them)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=64, help="prompt tokens N")
    ap.add_argument("--new-tokens", type=int, default=16, help="response tokens T")
    ap.add_argument("--rollouts", type=int, default=4, help="sequences K in the rollout batch")
    ap.add_argument("--rollout-tp", type=int, default=2, help="TP ranks of the SGLang dump")
    ap.add_argument("--trainer-tp", type=int, default=3, help="TP ranks of the Megatron dump (divides the KV heads)")
    ap.add_argument("--trainer-cp", type=int, default=1)
    ap.add_argument("--trainer-sp", action="store_true", help="sequence parallelism in the trainer dump")
    ap.add_argument("--trainer-spec", default="local", choices=("local", "te"))
    ap.add_argument("--perturb", action="append", default=[], help="HF capture NAME=DELTA in the trainer dump (repeatable)")
    ap.add_argument("--reference", default=None, help="an existing rollout-vs-train trace (positions all, sublayers, "
                    "tensors) to write the dumps from, instead of tracing")
    args = ap.parse_args()
    try:
        perturb = {k: float(v) for k, v in (p.split("=", 1) for p in args.perturb)}
    except ValueError:
        print("error: --perturb takes NAME=DELTA, e.g. model.layers.5.mlp.down_proj=0.125", file=sys.stderr)
        return 2
    out = Path(args.out)
    ref = Path(args.reference) if args.reference else out / "ref.h5"
    try:
        if (not args.reference and ref.exists()) or (out / "rollout").exists() or (out / "trainer").exists():
            raise tracer.TracerError(f"{out} already holds ref.h5, rollout/ or trainer/; choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        if not args.reference:
            tracer.run(args.model, scenario="rollout-vs-train", length=args.length, new_tokens=args.new_tokens,
                       rollouts=args.rollouts, positions="all", granularity="sublayers", store="tensors",
                       output=str(ref), progress=False)
        with tracer.read_trace(str(ref)) as r:
            rollout_meta = r.run("A", load_tensors=False).meta.get("rollout") or {}
            w0, w1 = r.run("A", load_tensors=False).window
        t = len(rollout_meta.get("tokens", [[0] * args.new_tokens])[0])
        if w0 != 0:
            raise tracer.TracerError(f"{ref} kept positions {w0}..{w1 - 1}; trace it with positions all")
        n = w1 - (t - 1)  # run A computed 0..N+T-2: the prompt's N, then T-1 decode steps
        rollout = tracer.write_sglang_dump(str(ref), "A", out / "rollout", tp=args.rollout_tp,
                                           steps=[n] + [1] * (t - 1), logits="every-step",
                                           tokenizer_path=f"{args.model} (synthetic dump)")
        trainer = tracer.write_megatron_dump(str(ref), "B", out / "trainer", tp=args.trainer_tp, cp=args.trainer_cp,
                                             sp=args.trainer_sp, spec=args.trainer_spec, tokens="thd",
                                             perturb=perturb or None)
    except tracer.TracerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"reference: {ref} (A: rollout of {t} tokens; B: trainer; the traced sequence: {n} + {t} tokens)")
    print(f"rollout dump (SGLang, TP {args.rollout_tp}, prefill + {t - 1} decode steps): {rollout}")
    print(f"trainer dump (Megatron, TP {args.trainer_tp}, CP {args.trainer_cp}{', SP' if args.trainer_sp else ''}, "
          f"{args.trainer_spec} spec, THD): {trainer}")
    print(f"compare: tracer compare {rollout} {trainer} --reference {ref}:B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
