"""vLLM's facts in words: what its scheduler did for a run (``meta["scheduler"]``, a
:class:`~tracer.execute.records.SchedulerFacts` written by :func:`tracer.engines.vllm.engine.execute_loaded`).
No vLLM import."""

from __future__ import annotations

from typing import Any

from tracer.execute.records import SchedulerFacts


def _count(n: int, noun: str) -> str:
    """``1 step``, ``4 steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _spans(chunks: list[list[int]]) -> str:
    """``0..129`` / ``0..31, 32..63``: ``[start, stop)`` spans as the positions they hold."""
    return ", ".join(f"{a}..{b - 1}" if b - a > 1 else str(a) for a, b in chunks)


def scheduler_note(run: str, meta: dict[str, Any]) -> str | None:
    """What vLLM's scheduler did for a run's traced prompt (None for a run without ``meta["scheduler"]``):
    its requests, the steps that computed the prompt (positions below the prompt's length) and the
    decode steps after them, and what a KV hand-over did."""
    v = meta.get("scheduler")
    if not isinstance(v, dict):
        return None
    v = SchedulerFacts.from_dict(v)
    cached = [r.num_cached_tokens for r in v.requests if r.traced]
    n = next((r.tokens for r in v.requests if r.traced and r.tokens), None)
    batched = max((s.requests for s in v.steps), default=1)
    chunks = [list(c) for c in v.chunks]
    prompt = [c for c in chunks if n is None or c[0] < n]
    decode = len(chunks) - len(prompt)
    return (f"run {run} (vLLM scheduler): {_count(len(v.requests), 'request')}, traced num_cached_tokens {cached}; "
            f"the prompt computed in {_count(len(prompt), 'step')} at positions {_spans(prompt)}"
            + (f", then {_count(decode, 'decode step')}" if decode else "")
            + (f", each step holding up to {_count(batched, 'request')}" if batched > 1 else "")
            + f" ({v.chunks_as or '?'})" + (f"; {BATCH_INVARIANT_NOTE}" if _batch_invariant(meta) else "")
            + _transfer_note(meta) + "".join(f"; {n}" for n in v.notes if n.startswith("TP ")))


def _transfer_note(meta: dict[str, Any]) -> str:
    """What a KV hand-over did (``meta["kv_transfer"]``, :func:`tracer.engines.vllm.transfer.execute_transfer`):
    the boundary named once, then the contract check's verdict."""
    t = meta.get("kv_transfer")
    if not isinstance(t, dict):
        return ""
    if t.get("role") == "miss":
        return "; the consumer alone: nothing handed over (a KV cache miss)"
    check = t.get("contract") or {}
    diffs = check.get("differences") or []
    verdict = ("KV contract: producer and consumer agree on every field" if check and not diffs else
               f"KV contract: {_count(len(diffs), 'difference')}, first {_diff_line(diffs[0])}" if diffs else
               "no KV contract checked")
    moved = int(t.get("transferred") or 0)
    return (f"; KV cache handed over: {moved} tokens (positions 0..{moved - 1}, compared at the kv_cache points "
            f"as transferred against run A's own) loaded from {t.get('files')} files ({t.get('boundary')}); {verdict}")


def _diff_line(d: dict[str, Any]) -> str:
    """One contract difference of a check's document (:class:`~tracer.load.kv_contract.KVDifference`)."""
    return f"{d.get('label')}: producer {d.get('producer')}, consumer {d.get('consumer')}"


def _m(gemm_m: Any) -> Any:
    """The first forward pass's GEMM M of a run's ``gemm_m`` (one value or one per pass), or ``?``."""
    if isinstance(gemm_m, (list, tuple)):
        return gemm_m[0] if gemm_m else "?"
    return "?" if gemm_m is None else gemm_m


def control_note(facts: dict[str, Any], first_divergent: str | None, transfer: dict[str, Any] | None,
                 kv_prefix: dict[str, int | None]) -> str | None:
    """Why ``prefill-decode``'s control (no ``--producer`` difference) is not bit-identical, in one line;
    None when it is, or for another run.

    Run A computes the positions after the handed-over prefix inside its whole prefill (GEMM M = N),
    run B on the loaded cache as a GEMM of M = N - moved: another M for the same rows, the cache
    hit's mechanism (as in ``prefix-cache``), not a transfer fault. The handed-over cache itself is
    compared separately: the kv_cache points at the positions before the window.

    Args:
        facts: the comparison's facts: ``gemm_m_a``, ``gemm_m_b`` (GEMM M per forward pass), ``n_tokens``.
        first_divergent: the comparison's first divergent point (None: bit-identical: no note).
        transfer: run B's ``meta["kv_transfer"]`` (``role``, ``transferred``, ``producer``,
            ``kv_compared``, ``kv_not_compared``).
        kv_prefix: kv_cache point name -> its differing elements at the handed-over positions
            (``n_diff_prefix``; None: not compared there).
    """
    t = transfer if isinstance(transfer, dict) else {}
    if first_divergent is None or t.get("role") != "load" or t.get("producer"):
        return None
    moved, n = int(t.get("transferred") or 0), int(facts.get("n_tokens") or 0)
    head = (f"the control is not bit-identical (first {first_divergent}): run A computes positions {moved}..{n - 1} "
            f"inside its prefill GEMM of M = {_m(facts.get('gemm_m_a'))}, run B (the KV cache handed over) as a GEMM of "
            f"M = {_m(facts.get('gemm_m_b'))}: another GEMM M for the same rows, the cache hit's mechanism, not the "
            "transfer; ")
    where = f"the handed-over KV cache itself (positions 0..{moved - 1})"
    compared = {k: v for k, v in kv_prefix.items() if v is not None}
    if t.get("kv_compared") is False or not compared:
        why = t.get("kv_not_compared") or "no kv_cache point compared the positions before the window"
        return head + f"{where} was not compared on this path: {why}"
    bad = [k for k, v in compared.items() if v]
    if not bad:
        return head + f"{where} was compared separately at {len(compared)} kv_cache points: bit-identical to run A's own"
    return head + (f"but {where} differs from run A's own at {len(bad)} of {len(compared)} kv_cache points, first "
                   f"{bad[0]}: that is the transfer, look there first")


#: what vLLM's batch-invariant mode changes beyond its own runs (a run's engine facts say it was on)
BATCH_INVARIANT_NOTE = ("vLLM's batch-invariant mode was on in this process: on a GPU, torch's mm, softmax, log_softmax, "
                        "mean and bmm ran vLLM's batch-invariant kernels for every run after it started, an HF run's "
                        "included")


def _batch_invariant(meta: dict[str, Any]) -> bool:
    engine = meta.get("engine")
    return isinstance(engine, dict) and bool(engine.get("batch_invariant"))


__all__ = ["scheduler_note", "control_note", "BATCH_INVARIANT_NOTE"]
