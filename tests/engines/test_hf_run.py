"""The HF engine's deterministic mode leaves the process as it found it."""

from __future__ import annotations


def test_deterministic_mode_restores_the_numeric_contract():
    """A deterministic mitigation used to leave torch's fp32 precisions at "ieee" (from "none"): a
    later audit in the same process read another numeric contract in its header and refused to
    resume its own trace ("matmul_fp32_precision differ")."""
    from tracer.engines.hf.run import deterministic_mode
    from tracer.store.environment import collect_environment

    before = collect_environment("cpu")
    with deterministic_mode():
        inside = collect_environment("cpu")
    after = collect_environment("cpu")
    assert inside["deterministic_algorithms"] is True  # it did change something
    assert {k: (v, after[k]) for k, v in before.items() if after[k] != v} == {}
