"""The short facts shown above a comparison's table, from a trace header and the two runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tracer.diff.engine import engine_facts
from tracer.dtypes import FLOATS, canonical
from tracer.execute.family import layout_facts
from tracer.execute.records import RunRecord
from tracer.load.contract import attention_facts
from tracer.load.models import model_argument
from tracer.plan.cost import stats_bytes, trace_bytes
from tracer.store.budget import DEFAULT_MAX_TRACE_SIZE
from tracer.store.environment import isa_summary


def sublayers_bytes(model: dict[str, Any], n_tokens: int, store: str | None, kv_cache: bool = True,
                    per_token: int | None = None) -> int | None:
    """About how many bytes a trace of this run at ``--granularity sublayers`` takes, from the model's
    shapes (``model``: the header's model facts) and N (every position: such a run traces the cached
    prefix's pass too): every tensor (:func:`tracer.plan.cost.trace_bytes`) under ``--store tensors``,
    at most the default budget of ``--store auto``, plus the statistics; None where the header lacks
    the shapes, or the run stores nothing (``none``). ``per_token``: the sublayer points' elements
    per token, counted on the model (:func:`tracer.execute.points.point_widths`; a header's
    ``sublayers_width``), instead of the estimate from its shapes (:func:`run_facts` passes it where the
    header has it, so a run and a comparison of its trace state one size; a trace written before
    headers recorded it gets the estimate from the shapes)."""
    shapes = ("n_layers", "hidden_size", "vocab_size", "dtype")
    if store == "none" or any(not model.get(k) for k in shapes):
        return None
    info = SimpleNamespace(**{k: model.get(k) for k in (*shapes, "n_kv_heads", "head_dim")})
    tensors = trace_bytes(info, n_tokens, "sublayers", kv_cache)
    if per_token is not None:  # both runs, every position, in the model's dtype
        tensors = 2 * n_tokens * per_token * _bits(info.dtype) // 8
    tensors = 0 if store == "stats" else min(tensors, DEFAULT_MAX_TRACE_SIZE) if store in (None, "auto") else tensors
    return tensors + stats_bytes(info, "sublayers", kv_cache)


def _bits(dtype: str) -> int:
    return FLOATS[canonical(dtype)].bits


def run_facts(header: dict[str, Any], a: RunRecord, b: RunRecord) -> dict[str, Any]:
    """The short facts shown above the table, from a trace header and the two runs (one builder for a
    run in memory and a trace read back).

    Returns:
        ``dtype``, ``device``, ``attn``: the model's dtype, device and attention implementation;
        ``device_name``: the GPU/CPU name (None when the header has none); ``isa``: the instruction
        set the kernels dispatched to (:func:`tracer.store.environment.isa_summary`); ``model_argument``: how
        a suggested command names the model (:func:`tracer.load.models.model_argument`); ``n_tokens``: N;
        ``plan_a``/``plan_b``: the plans' descriptions; ``gemm_m_a``/``gemm_m_b``: GEMM M per
        forward pass; ``chunks_a``/``chunks_b``: the ``[start, stop)`` chunks of each plan; and,
        where the scenario has them, ``generated_a``/``generated_b``/``first_token_difference``
        (``generate-cache``), ``kv_block_format`` (``kv-quant``), ``sliding_layers`` /
        ``sliding_window`` (a model with sliding-window attention layers, from the header's
        ``numeric_contract``: decoder-layer indices and the window in tokens; with them
        ``layers_path``/``attention_path`` from its family descriptor), runs on engines' contracts
        (:func:`tracer.diff.engine.engine_facts`: ``engine_a``/``engine_b``, ``engine_differences``),
        ``family_inferred`` (True when no family descriptor fits the model: its layer-level points
        were inferred, and a note says so) and ``notes`` (a line each).
    """
    model = header.get("model", {}) if isinstance(header.get("model"), dict) else {}
    facts: dict[str, Any] = {
        "dtype": model.get("dtype"),
        "device": model.get("device"),
        "attn": model.get("attn_implementation"),
        "device_name": header.get("device_name"),
        "isa": isa_summary(header),
        "model_argument": model_argument(model) if model.get("name") else None,
        "n_tokens": len(a.token_ids),
        "plan_a": a.plan.get("description", ""),
        "plan_b": b.plan.get("description", ""),
        "gemm_m_a": a.meta.get("gemm_m") or a.plan.get("gemm_m"),  # what the run did (an engine's steps), else its plan
        "gemm_m_b": b.meta.get("gemm_m") or b.plan.get("gemm_m"),
        "chunks_a": [list(c) for c in a.plan.get("chunks") or ()],
        "chunks_b": [list(c) for c in b.plan.get("chunks") or ()],
        **attention_facts(header.get("numeric_contract") or {}),
        "sublayers_bytes": sublayers_bytes(model, len(a.token_ids), header.get("store"), header.get("kv_cache", True),
                                           per_token=header.get("sublayers_width")),
    }
    if facts.get("sliding_layers"):  # which rows belong to a layer and its attention (for the marks)
        facts.update(layout_facts(header))
    scenario = header.get("scenario") if isinstance(header.get("scenario"), dict) else {}
    notes = []
    family = header.get("family") if isinstance(header.get("family"), dict) else {}
    if family.get("inferred"):  # no descriptor: layer-level points only, and the report says why
        facts["family_inferred"] = True
        notes.append(str(family["inferred"]))
    gen_a, gen_b = a.meta.get("generated"), b.meta.get("generated")
    if gen_a is not None and gen_b is not None:
        first = next((i for i, (x, y) in enumerate(zip(gen_a, gen_b)) if x != y), None)
        facts.update(generated_a=gen_a, generated_b=gen_b, first_token_difference=first)
        notes.append(f"generated tokens: A {gen_a}, B {gen_b}; " + (
            (f"identical for all {len(gen_a)} generated tokens" if len(gen_a) != 1 else
             "identical for the 1 generated token") if first is None else
            f"first different at step {first} (position {a.window[0] + first}); later steps compare different contexts"))
    fmt = (scenario.get("params") or {}).get("kv_block_format")
    if fmt is not None:
        facts["kv_block_format"] = fmt
        notes.append(f"KV format {fmt['name']}: {fmt['element']} elements, block {fmt['block_size'] or '-'}, scale {fmt['scale']}")
    for r in (a, b):  # torch.compile's warnings, kept from stderr (tracer.engines.hf.context.compiler_warnings)
        notes += [f"{r.name}: torch.compile warned: {w}" for w in r.meta.get("compiler_warnings") or ()]
    notes += kv_contract_notes(a, b)
    engines = engine_facts(a.name, a.meta, b.name, b.meta)  # runs on engines: contracts side by side
    notes += engines.pop("notes", [])
    facts.update(engines)
    auto = a.meta.get("store_auto") or {}
    if auto.get("dropped"):  # a stored run of --store auto: the table covers the kept points only
        logits = auto.get("logits") in auto["dropped"]
        notes.append(f"--store auto kept full tensors of {len(auto.get('kept', []))} of "
                     f"{len(auto.get('kept', [])) + len(auto['dropped'])} points; the other {len(auto['dropped'])}"
                     + (" (the logits among them)" if logits else "")
                     + " were compared when the trace was written: 'tracer report TRACE' renders that comparison, "
                     "'tracer show TRACE --json' prints it")
    if notes:
        facts["notes"] = notes
    return facts


def kv_contract_notes(*runs: RunRecord) -> list[str]:
    """One line per run whose KV cache crossed a boundary outside an engine's scheduler
    (``meta["kv_transfer"]`` of role ``moved``: the HF cache handed to another device; ``imported``: an
    engine dump's KV cache): the boundary and the KV contract check's summary, or what is unknown."""
    out = []
    for run in runs:
        t = run.meta.get("kv_transfer")
        if not isinstance(t, dict) or t.get("role") not in ("moved", "imported"):
            continue
        check = t.get("contract") or {}
        out.append(f"run {run.name}: KV cache of {t.get('transferred')} positions handed over; "  # the summary names the boundary
                   + str(check.get("summary") or t.get("unknown") or f"no KV contract checked ({t.get('boundary')})"))
    return out
