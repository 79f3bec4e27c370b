"""The engine seam (:mod:`tracer.engines.door`): one place picks the executor of a run plan."""

from __future__ import annotations

import pytest

from tracer.errors import TracerError
from tracer.engines import door as engines
from tracer.plan.scenarios import RunPlan, TPSpec


def test_plain_plans_run_on_hf_and_never_pass_through_tp_dist():
    plan = RunPlan("A", ((0, 8),))
    assert engines.executor_name(plan) == "hf"
    fn = engines.executor(plan)
    assert fn.__module__ == "tracer.engines.hf.run"


def test_distributed_tp_plans_go_to_tp_dist():
    plan = RunPlan("B", ((0, 8),), tp=TPSpec(2, mode="distributed"))
    assert engines.executor_name(plan) == "tp-distributed"
    assert engines.executor(plan).__module__ == "tracer.engines.tp.dist"


def test_unknown_engine_is_one_line_error_listing_the_known_ones():
    plan = RunPlan("A", ((0, 8),), engine="sglang")
    with pytest.raises(TracerError, match=r"unknown engine 'sglang'; use one of: hf, vllm"):
        engines.executor_name(plan)


def test_missing_engine_package_names_it(monkeypatch):
    monkeypatch.setitem(engines.EXECUTORS, "vllm", ("tracer_no_such_engine_pkg.module", "execute_loaded"))
    plan = RunPlan("A", ((0, 8),), engine="vllm")
    with pytest.raises(TracerError, match=r"needs the package 'tracer_no_such_engine_pkg'"):
        engines.executor(plan)


def test_vllm_plans_go_to_the_vllm_executor_or_name_the_missing_package():
    import importlib.util

    plan = RunPlan("A", ((0, 8),), engine="vllm")
    assert engines.executor_name(plan) == "vllm"
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(TracerError, match=r"engine 'vllm' needs the package 'vllm', which is not installed"):
            engines.executor(plan)
    else:
        assert engines.executor(plan).__module__ == "tracer.engines.vllm.engine"
