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
            + f" ({v.chunks_as or '?'})")


__all__ = ["scheduler_note"]
