"""tracer/plan/build.py: a scenario from a run's options, built once per run."""

from __future__ import annotations

import pytest

import tracer
from tracer.plan import build as build_mod
from tracer.plan.scenarios import SCENARIOS


@pytest.fixture(scope="module")
def lm():
    return tracer.load_model("tiny-llama", dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("options", [{"scenario": "repeat"}, {"scenario": "prefix-cache", "block_size": 8}])
def test_a_run_builds_its_scenario_once(lm, monkeypatch, options):
    """The early check before the model loads (tracer.validate), the positions check and the plan of
    the run share one Scenario: its builder runs once per run (it ran three times)."""
    name = options["scenario"]
    calls = []
    builder = SCENARIOS[name]

    def counted(*args, **kwargs):
        calls.append(args)
        return builder(*args, **kwargs)

    counted.__signature__ = __import__("inspect").signature(builder)  # build() reads the options it takes
    monkeypatch.setitem(SCENARIOS, name, counted)
    monkeypatch.setattr(build_mod, "_BUILT", {})
    r = tracer.run(lm, length=24, store="none", progress=False, **options)
    assert len(calls) == 1 and r.scenario.name == name
    assert build_mod.make_scenario(name, 24, {k: v for k, v in options.items() if k != "scenario"}) is r.scenario
