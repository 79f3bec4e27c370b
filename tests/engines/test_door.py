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
    def missing(role):
        raise ModuleNotFoundError("No module named 'tracer_no_such_engine_pkg'", name="tracer_no_such_engine_pkg.module")

    monkeypatch.setattr(engines.engine("vllm"), "executor", missing)  # the engine's package, not installed
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


#: the toy engine's folder, ``tracer/engines/toy/__init__.py``: the HF model with eager attention,
#: naming itself (docs/ARCHITECTURE.md, "Where to add X": an engine)
TOY_ENGINE = '''"""A toy engine: the HF model with eager attention, naming itself."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tracer.engines.base import Engine, Executor


class Toy(Engine):
    name = "toy"

    def realise(self, scen: Any) -> Any:
        plans = {k: replace(p, engine=self.name, attn="eager", description=f"in toy (eager attention): {p.description}")
                 for k, p in (("plan_a", scen.plan_a), ("plan_b", scen.plan_b))}
        return replace(scen, **plans, params={**scen.params, "engine": self.name})

    def executor(self, role: str) -> Executor:
        from tracer.engines.hf.run import execute_loaded

        def run(loaded, token_ids, plan, points, window, **options):
            rec, _ = execute_loaded(loaded, token_ids, plan, points, window, **options)
            rec.meta["engine"] = self.facts(loaded, plan)
            return rec, None

        return run

    def facts(self, loaded: Any, plan: Any) -> dict[str, Any]:
        return {"engine": self.name, "version": "0.1", "device": loaded.info.device, "dtype": loaded.info.dtype,
                "attention_backend": "eager"}


ENGINE = Toy()
'''
#: its row in ``ENGINES`` (tracer/engines/table.py)
TOY_ROW = '    EngineRow("toy", "a toy: HF with eager attention", "toy", builds_on="hf"),\n'


def test_a_toy_engine_is_one_folder_and_one_table_row(tmp_path):
    """Done when of the engine folders: a copy of this checkout plus exactly the two documented steps
    (a folder tracer/engines/toy/, a row in the table) runs ``tracer run --engine toy``; the run's
    facts and plans are the toy's own, and its attention is the eager one it asked for."""
    import json
    import shutil

    from tests.helpers import ROOT, cli_env, tracer_cli

    tree = tmp_path / "checkout"
    for part in ("tracer", "hooks", "models"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    (tree / "tracer/engines/toy").mkdir()  # step 1: one new folder
    (tree / "tracer/engines/toy/__init__.py").write_text(TOY_ENGINE)
    table = tree / "tracer/engines/table.py"  # step 2: one row of the table
    text = table.read_text()
    end = "\n)\n\n#: the reference engine's name"
    assert text.count(end) == 1
    table.write_text(text.replace(end, "\n" + TOY_ROW.rstrip("\n") + end))
    changed = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                     and (not (ROOT / p.relative_to(tree)).exists() or (ROOT / p.relative_to(tree)).read_bytes() != p.read_bytes()))
    assert changed == ["tracer/engines/table.py", "tracer/engines/toy/__init__.py"]

    env = {**cli_env(), "PYTHONPATH": str(tree), "TRACER_PROGRESS": "off"}
    out = tracer_cli(["run", "tiny-llama", "--engine", "toy", "--length", "40", "--store", "none", "--format", "json"],
                     env, tree).stdout
    doc = json.loads(out)
    facts = doc["facts"]
    assert facts["engine_a"]["engine"] == facts["engine_b"]["engine"] == "toy"
    assert facts["engine_a"]["attention_backend"] == "eager"
    assert doc["facts"]["plan_a"].startswith("in toy (eager attention)")
    assert doc["layers"] and "verdict" in doc  # both runs compared, layer by layer
