"""vLLM's facts in words: what its scheduler did for a run (``meta["scheduler"]``, a
:class:`~tracer.execute.records.SchedulerFacts` written by :func:`tracer.engines.vllm.engine.execute_loaded`).
No vLLM import."""

from __future__ import annotations

from typing import Any

from tracer.execute.records import SchedulerFacts


def scheduler_note(run: str, meta: dict[str, Any]) -> str | None:
    """What vLLM's scheduler did for a run's traced prompt (None for a run without ``meta["scheduler"]``)."""
    v = meta.get("scheduler")
    if not isinstance(v, dict):
        return None
    v = SchedulerFacts.from_dict(v)
    cached = [r.num_cached_tokens for r in v.requests if r.traced]
    batched = max((s.requests for s in v.steps), default=1)
    chunks = [list(c) for c in v.chunks]
    return (f"run {run} (vLLM scheduler): {len(v.requests)} request(s), traced num_cached_tokens {cached}; "
            f"the prompt computed in {len(chunks)} step(s) at positions {chunks}"
            + (f", each step holding up to {batched} request(s)" if batched > 1 else "")
            + f" ({v.chunks_as or '?'})" + (f"; {BATCH_INVARIANT_NOTE}" if _batch_invariant(meta) else "")
            + _transfer_note(meta) + "".join(f"; {n}" for n in v.notes if n.startswith("TP ")))


def _transfer_note(meta: dict[str, Any]) -> str:
    """What a KV hand-over did (``meta["kv_transfer"]``, :func:`tracer.engines.vllm.transfer.execute_transfer`)."""
    t = meta.get("kv_transfer")
    if not isinstance(t, dict):
        return ""
    if t.get("role") == "miss":
        return "; the consumer alone: nothing handed over (a KV cache miss)"
    check = t.get("contract") or {}
    return (f"; KV cache handed over: {t.get('transferred')} tokens loaded from {t.get('files')} files "
            f"({t.get('boundary')}); {check.get('summary', 'no KV contract checked')}")


#: what vLLM's batch-invariant mode changes beyond its own runs (a run's engine facts say it was on)
BATCH_INVARIANT_NOTE = ("vLLM's batch-invariant mode was on in this process: on a GPU, torch's mm, softmax, log_softmax, "
                        "mean and bmm ran vLLM's batch-invariant kernels for every run after it started, an HF run's "
                        "included")


def _batch_invariant(meta: dict[str, Any]) -> bool:
    engine = meta.get("engine")
    return isinstance(engine, dict) and bool(engine.get("batch_invariant"))


__all__ = ["scheduler_note", "BATCH_INVARIANT_NOTE"]
