"""vLLM's facts in words: what its scheduler did for a run (``meta["vllm"]``, written by
:func:`tracer.engines.vllm.engine.execute_loaded`). No vLLM import."""

from __future__ import annotations

from typing import Any


def scheduler_note(run: str, meta: dict[str, Any]) -> str | None:
    """What vLLM's scheduler did for a run's traced prompt (None for a run without ``meta["vllm"]``)."""
    v = meta.get("vllm")
    if not isinstance(v, dict):
        return None
    traced = [r for r in v.get("requests", []) if r.get("traced")]
    cached = [r.get("num_cached_tokens", 0) for r in traced]
    steps = v.get("steps", [])
    batched = max((s.get("requests", 1) for s in steps), default=1)
    chunks = v.get("chunks", [])
    return (f"run {run} (vLLM scheduler): {len(v.get('requests', []))} request(s), traced num_cached_tokens {cached}; "
            f"the prompt computed in {len(chunks)} step(s) at positions {chunks}"
            + (f", each step holding up to {batched} request(s)" if batched > 1 else "")
            + f" ({v.get('chunks_as', '?')})")


__all__ = ["scheduler_note"]
