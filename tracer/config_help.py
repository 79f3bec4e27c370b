"""The words of every run option: its whole help, its one-line brief and its ``--help`` panel.

:data:`HELP` (the whole text: the API's docstrings and ``tracer help TOPIC``), :data:`BRIEF` (one
line of ``tracer run --help`` where the whole help is longer), :data:`PANELS` (which panel lists
each option, in print order) and :data:`SCENARIO_NOTES` (the few words after a scenario's name in
``--scenario``'s help). :data:`tracer.config.OPTIONS` joins them to each option's group, field,
type and flags; this module holds text only and imports nothing of :mod:`tracer.config`.
"""

from __future__ import annotations

from tracer.dtypes import ALIASES, FLOATS
from tracer.engines.table import ENGINES, REFERENCE, default, help_line, selectable, takers
from tracer.plan.hierarchy import ALIGNED_SOURCE
from tracer.plan.scenarios import SCENARIOS

#: a few words after a scenario's name in ``--scenario``'s help (the list itself is :data:`SCENARIOS`)
SCENARIO_NOTES = {
    "prefix-cache": "cache miss vs hit; --split-at N-1 is a decode step",
    "cuda-graph": "eager vs CUDA-graph replay, GPU only",
    "engine": f"{' vs '.join(selectable()[:2])}, --engines",
    "prefill-decode": "a producer's KV cache handed to a consumer that decodes, inside "
                      + ", ".join(r.name for r in ENGINES if r.scenarios and "prefill-decode" in r.scenarios),
    "rollout-vs-train": "RL: a rollout sampling from a KV cache vs the trainer's teacher-forced recompute",
}

#: each option's whole help: the API's docstrings, ``tracer help TOPIC`` and, where no :data:`BRIEF`
#: is given, its line of ``--help``
HELP = {
    "model": "built-in model (see 'tracer models'), a GGUF file (path/to/model.gguf), HF model id in the local cache, "
             "or local directory",
    "dtype": f"model dtype: {', '.join(FLOATS)} (also {', '.join(ALIASES)})",
    "device": "where the model runs: cpu, cuda, cuda:N (default: cuda if available, else cpu)",
    "attn": "attention implementation: sdpa or eager",
    "gguf": "GGUF file for a GGUF recipe (smollm2-135m, gemma3-270m; default: the recipe's package copy, or "
            "$TRACER_SMOLLM2_GGUF / $TRACER_GEMMA3_GGUF)",
    "device_map": "spread the model over GPUs (or GPU+CPU) with accelerate: auto, balanced, sequential, or a JSON "
                  "object {\"model.layers.0\": \"cuda:0\", ...}; excludes --device",
    "max_memory": "with --device-map auto: per-device budget, e.g. 0=20GiB,cpu=64GiB",
    "prompt": "prompt text (default: a built-in prompt of a few hundred tokens)",
    "prompt_file": "read the prompt text from a file",
    "token_ids": "the prompt as token ids: a list of ints (on the command line 1,2,3)",
    "token_ids_file": "JSON array of token ids (as bug reports give them); the only prompt a model without a "
                      "tokenizer takes, and a GGUF's tokenizer is then not converted",
    "chat": "apply the tokenizer's chat template to the prompt",
    "length": "use exactly N tokens: the prompt truncated, or repeated to reach N",
    "scenario": "scenario: " + ", ".join(name + (f" ({SCENARIO_NOTES[name]})" if name in SCENARIO_NOTES else "")
                                         for name in SCENARIOS)
                + "; from Python also a Scenario or f(n_tokens) -> Scenario",
    "block_size": "KV cache block size in tokens; the cached prefix is the largest multiple below N (default "
                  + ", ".join(f"{r.defaults['block_size']}" + ("" if r.name == REFERENCE else f" with --engine {r.name}")
                              for r in ENGINES if "block_size" in r.defaults) + ")",
    "split_at": "cached prefix length P (1..N-1), overriding block_size",
    "mitigation": f"aligned (prefix-cache: the cache-miss run also splits at P, {ALIGNED_SOURCE}) or deterministic "
                  "(torch deterministic algorithms, TF32 off)",
    "engine": help_line(),
    "engines": f"engine: run A's and run B's engine, e.g. {','.join(selectable()[:2])} (default); NAME:BACKEND names "
               f"an engine's attention backend ({', '.join(takers('attention_backend'))}), e.g. "
               f"{next(iter(takers('attention_backend')), 'NAME')}:TRITON_ATTN, so that two backends can be compared",
    "attention_backend": f"{'/'.join(takers('attention_backend'))}: the engine's attention backend by name, e.g. "
                         "TRITON_ATTN, FLEX_ATTENTION, FLASH_ATTN, FLASHINFER, CPU_ATTN (default: the engine's own "
                         "choice); recorded in the numeric contract",
    "batch_invariant": f"{'/'.join(takers('batch_invariant'))}: the engine's batch-invariant mode (set before the "
                       "engine starts; CUDA, ROCm, XPU); once on, on for the whole process",
    "granularity": "layers (residual stream) or sublayers (norms, attention, MLP, every Linear)",
    "positions": "window: compare the positions both runs computed last (P..N-1); all: every position 0..N-1 "
                 "(locates a divergence born in the cached-prefix pass)",
    "kv_cache": "capture each layer's KV cache over all N positions (origin analysis of cached-prefix divergence); "
                "--no-kv-cache for long prompts, where it is most of the bytes",
    "kernels": "record which kernels each capture point ran in each run (torch.profiler): kernels column, origin "
               "class, JSON kernels_a/kernels_b",
    "cuda_graphs": "run both plans as CUDA-graph replays, the capture copies recorded into the graphs (CUDA GPU only)",
    "op_replay": "replay each origin op in float64 on the CPU from the captured inputs: each run's error in ULPs "
                 "against the exact result (with --granularity sublayers)",
    "store": "auto (full tensors around the origin and the logits within --max-trace-size; statistics of all), "
             "tensors (every captured tensor), stats (comparison only) or none (no file)",
    "max_trace_size": "with --store auto: bytes of full tensors the trace may hold, e.g. 300MB, 2GiB (default 256MiB; "
                      "tracer audit: per check, default 1MiB)",
    "output": "trace file (default: a new file in traces/ named after the model, scenario and time)",
    "overwrite": "replace an existing output file",
    "compression": "HDF5 compression of stored tensors: none, lzf, gzip",
    "atol": "absolute tolerance: count elements with |a-b| > atol + rtol*|a| per capture point",
    "rtol": "relative tolerance (see atol)",
    "fail_on": "when the comparison fails (exit 1; from Python: result.check()): any (a bitwise difference), "
               "flip (an argmax flip), tolerance (outside --atol/--rtol); default: report only",
    "decode": "greedy-decode T tokens from each run's KV cache; report the first that differs (0 = off)",
    "verdict": "re-run at float32 (and float64 on CPU): rounding noise, defect suspected or inconclusive",
    "batch_size": "batch: rows in the batch, the prompt included (default 4)",
    "padding": "batch: none, left or right",
    "batch_row": "batch, rollout-vs-train: row of the traced prompt (default batch_size // 2, rollouts // 2)",
    "new_tokens": "generate-cache, prefill-decode: greedy tokens to generate (default 8); rollout-vs-train: response "
                  "tokens (default 16)",
    "producer": "prefill-decode: the one setting in which the producer differs from the consumer, KEY=VALUE: "
                "block_size, max_num_batched_tokens (its chunked-prefill budget), dtype, kv_cache_dtype, "
                "attention_backend (default: none, the control; a value equal to the consumer's is refused: that "
                "is the control)",
    "block_sizes": f"block-size: two KV block sizes b1,b2 (default {','.join(map(str, default(None, 'block_sizes')))})",
    "chunk_size": "chunked-prefill: tokens per chunk (default 32)",
    "tp": "tensor-parallel: shards k of the row-parallel layers, or an engine's TP ranks (default 2)",
    "reduce": "tensor-parallel: all-reduce order ring or tree (default ring)",
    "reduce_dtype": "tensor-parallel: add partials in the activation dtype or float32",
    "kv_format": "kv-quant: fp8-e4m3, mxfp8 or nvfp4 (default fp8-e4m3)",
    "attn_a": "attention: run A's implementation (default eager)",
    "attn_b": "attention: run B's implementation (default sdpa; flash_attention_2 where installed)",
    "devices": "device/disaggregated: X,Y (default cpu,cuda)",
    "tp_mode": "tensor-parallel: simulated (one process, default) or distributed (run B on --tp processes with "
               "torch.distributed: gloo on the CPU, NCCL on GPUs)",
    "tp_partials": "tensor-parallel, distributed: also store every rank's row-parallel partials",
    "tp_vocab_parallel": "tensor-parallel, distributed: shard the embedding and LM head by vocabulary",
    "rollouts": "rollout-vs-train: K sequences per RL step, the traced prompt among them (default 4)",
    "sample": "rollout-vs-train: sample the response (seeded) instead of greedy decoding",
    "temperature": "rollout-vs-train, with --sample: sampling temperature; logprobs are log_softmax(logits / T) (default 1)",
    "seed": "rollout-vs-train, with --sample: seed of the sampling generator (default 0)",
    "train_batching": "rollout-vs-train: the trainer's layout, padded (right-padded rows) or packed (one row, "
                      "position ids restarting per sequence) (default padded)",
    "train_attn": "rollout-vs-train: the trainer's attention implementation: eager, sdpa, flash_attention_2 "
                  "(default: as loaded)",
    "lm_head_fp32": "rollout-vs-train: the trainer computes its LM head in float32",
    "train_dtype": "rollout-vs-train: the trainer's dtype, float32 or float64 (default: the model's)",
    "is_cap": "rollout-vs-train: TIS cap C; the share of tokens with ratio > C is reported as clipped (default 2)",
    "mask_threshold": "rollout-vs-train: MIS/IcePop threshold b; tokens with ratio outside [1/b, b] count as "
                      "masked (default 2)",
    "mitigations": "rollout-vs-train: re-run with each knob changed (same attention, fp32 LM head, no padding, "
                   "batch of one, deterministic) and report the |dlogp| each leaves",
}


#: the panels of ``tracer run --help``, in print order, each with the options it lists (every option is in
#: one; the long help of a panel's options: ``tracer help TOPIC``, TOPIC its key here)
PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "run": ("What to run", ("model", "scenario", "prompt", "prompt_file", "length", "dtype", "device", "granularity",
                            "positions")),
    "output": ("Output", ("output", "overwrite")),  # and the command line's own: --format, --report, ... (tracer.cli_parser.RENDER)
    "scenario": ("Scenario options", ("block_size", "split_at", "mitigation", "batch_size", "padding", "batch_row",
                                      "new_tokens", "block_sizes", "chunk_size", "kv_format", "attn_a", "attn_b",
                                      "devices", "producer")),
    "checks": ("Checks", ("decode", "verdict", "op_replay", "fail_on", "atol", "rtol")),
    "capture": ("Capture", ("kv_cache", "kernels", "cuda_graphs")),
    "storage": ("Storage", ("store", "max_trace_size", "compression")),
    "model": ("Model loading", ("attn", "gguf", "device_map", "max_memory", "chat", "token_ids", "token_ids_file")),
    "engines": ("Engines", ("engine", "engines", "attention_backend", "batch_invariant")),
    "rl": ("RL: rollout-vs-train", ("rollouts", "sample", "temperature", "seed", "train_batching", "train_attn",
                                    "lm_head_fp32", "train_dtype", "is_cap", "mask_threshold", "mitigations")),
    "tp": ("Tensor parallel", ("tp", "reduce", "reduce_dtype", "tp_mode", "tp_partials", "tp_vocab_parallel")),
}

#: one line of ``--help`` for options whose whole help (:data:`HELP`) is longer than one
BRIEF = {
    "model": "recipe (tracer models), .gguf file, HF id or folder",
    "dtype": ", ".join(f"{name} ({', '.join(a for a, n in ALIASES.items() if n == name)})" if name in ALIASES.values()
                      else name for name in FLOATS),
    "device": "cpu, cuda, cuda:N (default: cuda if there)",
    "gguf": "GGUF file for a GGUF recipe",
    "device_map": "auto, balanced, sequential or JSON (accelerate)",
    "max_memory": "per-device budget, e.g. 0=20GiB,cpu=64GiB",
    "prompt": "prompt text (default: a built-in prompt)",
    "token_ids": "the prompt as token ids, e.g. 1,2,3",
    "token_ids_file": "JSON array of token ids",
    "length": "use exactly N tokens (truncate or repeat)",
    "scenario": "which two runs: prefix-cache (default), batch, ... (tracer help scenarios)",
    "block_size": "KV cache block size (default 16)",
    "split_at": "cached prefix length P, overriding --block-size",
    "mitigation": "aligned or deterministic",
    "engine": f"who runs both: {' or '.join(selectable())} (default {REFERENCE}; tracer help engines)",
    "engines": f"engine: run A's and B's, e.g. {','.join(selectable()[:2])}; NAME:BACKEND",
    "attention_backend": f"{'/'.join(takers('attention_backend'))}: attention backend, e.g. TRITON_ATTN",
    "batch_invariant": f"{'/'.join(takers('batch_invariant'))}: batch-invariant mode (GPUs)",
    "granularity": "layers (default) or sublayers (every op)",
    "positions": "window (default: P..N-1) or all",
    "kv_cache": "capture each layer's KV cache (default on)",
    "kernels": "record the kernels each point ran",
    "cuda_graphs": "run both plans as CUDA-graph replays",
    "op_replay": "replay each origin op in float64 (ULPs)",
    "store": "auto (default), tensors, stats or none",
    "max_trace_size": "--store auto's budget, e.g. 300MB (default 256MiB)",
    "output": "trace file (default: a new file in traces/)",
    "compression": "none (default), lzf or gzip",
    "atol": "absolute tolerance (with --fail-on tolerance)",
    "rtol": "relative tolerance (see --atol)",
    "fail_on": "exit 1 on: any, flip or tolerance",
    "decode": "greedy-decode T tokens from each run",
    "verdict": "re-run at float32/64: rounding noise or defect?",
    "batch_size": "batch: rows in the batch (default 4)",
    "padding": "batch: none, left or right",
    "batch_row": "batch, RL: the traced prompt's row",
    "new_tokens": "generate-cache, prefill-decode (8), rollout-vs-train (16): tokens",
    "producer": "prefill-decode: the producer's one difference, KEY=VALUE (keys: tracer help scenario)",
    "block_sizes": "block-size: two KV block sizes (default 16,64)",
    "chunk_size": "chunked-prefill: tokens per chunk (default 32)",
    "tp": "shards of the row-parallel layers; an engine's TP ranks (default 2)",
    "reduce": "all-reduce order: ring (default) or tree",
    "reduce_dtype": "add partials in the activation dtype or float32",
    "kv_format": "kv-quant: fp8-e4m3 (default), mxfp8, nvfp4",
    "attn_a": "attention: run A's implementation (default eager)",
    "attn_b": "attention: run B's implementation (default sdpa)",
    "devices": "device/disaggregated: X,Y (default cpu,cuda)",
    "tp_mode": "simulated (default) or distributed",
    "tp_partials": "distributed: store every rank's partials",
    "tp_vocab_parallel": "distributed: shard embedding and LM head",
    "rollouts": "K sequences per RL step (default 4)",
    "sample": "sample the response instead of greedy",
    "temperature": "with --sample: temperature (default 1)",
    "seed": "with --sample: seed (default 0)",
    "train_batching": "trainer layout: padded (default) or packed",
    "train_attn": "trainer attention: eager, sdpa, flash_attention_2",
    "lm_head_fp32": "trainer LM head in float32",
    "train_dtype": "trainer dtype: float32 or float64",
    "is_cap": "TIS cap C (default 2)",
    "mask_threshold": "MIS/IcePop threshold b (default 2)",
    "mitigations": "re-run with each knob changed; |Δlogp| each leaves",
}
