"""An audit that survives interruption: every finished check kept, the same output resumed with rows
bit-identical to an uninterrupted audit, other parameters refused, and the plan with each check's
cost shown before it runs; stale partial files of dead writers removed."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tracer
from tracer.errors import TracerError
from tracer.loops.audit import DEFAULT_LENGTH
from tracer.plan.cost import plan_cost, scenario_cost
from tracer.plan.build import build
from tracer.store.trace import TraceReader

LEVELS = "0,2,5"
KW = dict(device="cpu", levels=LEVELS, length=40, progress=False)


@pytest.fixture(scope="module")
def loaded():
    return tracer.load_model("tiny-llama", dtype="bfloat16", device="cpu")


@pytest.fixture(scope="module")
def full(loaded, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "audit.h5"
    return tracer.audit(loaded, output=str(out), **{k: v for k, v in KW.items() if k != "device"}), out


def test_interrupted_audit_resumes_with_identical_rows(loaded, full, tmp_path):
    whole, whole_path = full
    out = tmp_path / "audit.h5"
    seen = []

    def stop_after_three(row):
        seen.append(row)
        if len(seen) == 3:
            raise KeyboardInterrupt

    kw = {k: v for k, v in KW.items() if k != "device"}
    with pytest.raises(KeyboardInterrupt):
        tracer.audit(loaded, output=str(out), on_row=stop_after_three, **kw)
    folder = out.with_name(out.name + ".checks")
    assert not out.exists() and folder.is_dir()
    kept = sorted(p.stem for p in folder.glob("*.json") if p.name != "audit.json")
    assert kept == sorted(r.check.key for r in seen)  # every finished check kept, nothing else
    assert not list(tmp_path.rglob("*.partial-*"))

    ran = []
    resumed = tracer.audit(loaded, output=str(out), on_check=lambda label, i, n: ran.append(label), **kw)
    assert ran[-1] == "done" and len(ran[:-1]) == len(whole.rows) - 3  # only the unfinished checks ran
    assert resumed.rows == whole.rows  # bit-identical rows: counts, max |logit diff| floats, mitigations
    assert not folder.exists() and out.exists()
    with TraceReader(out) as r, TraceReader(whole_path) as w:
        assert r.runs == w.runs and set(r.comparisons()) == set(w.comparisons())
        assert r.header["audit_rows"] == w.header["audit_rows"]
        for name in ("L0-repeat.A", "L5-kv-fp8.B"):  # the kept tensors read back bit for bit
            for cap in r.capture_names(name)[:3]:
                assert r.tensor(name, cap).view(-1).equal(w.tensor(name, cap).view(-1))

    # a complete audit of the same parameters is reused whole: nothing runs
    again = []
    reused = tracer.audit(loaded, output=str(out), on_check=lambda label, i, n: again.append(label), **kw)
    assert again == ["done"] and reused.rows == whole.rows


def test_other_parameters_are_refused_and_overwrite_starts_over(loaded, full, tmp_path):
    _, path = full
    before = path.read_bytes()
    kw = {k: v for k, v in KW.items() if k not in ("device", "length")}
    with pytest.raises(TracerError, match="other parameters.*--overwrite"):
        tracer.audit(loaded, output=str(path), length=41, **kw)
    assert path.read_bytes() == before  # nothing clobbered
    other = tmp_path / "other.h5"
    other.write_bytes(b"not a trace")
    with pytest.raises(TracerError, match="not a complete trace"):
        tracer.audit(loaded, output=str(other), length=40, **kw)
    res = tracer.audit(loaded, output=str(other), length=40, overwrite=True, levels="0", progress=False)
    assert [r.check.key for r in res.rows] == ["L0-repeat"]


def test_cost_of_a_plan():
    n = 96
    miss_hit = scenario_cost(build("prefix-cache", n))  # A: one pass of N; B: prefix P = 80 then the 16-token suffix
    assert (miss_hit.passes, miss_hit.tokens) == (3, 2 * n)
    batch = build("batch", n, batch_size=4, padding="none")
    assert (plan_cost(batch.plan_b).passes, plan_cost(batch.plan_b).tokens) == (1, 4 * n)
    gen = build("generate-cache", n, new_tokens=8)
    a, b = plan_cost(gen.plan_a), plan_cost(gen.plan_b)
    costs = sorted([(a.passes, a.tokens), (b.passes, b.tokens)])
    # with the cache: the prompt, then 8 one-token steps; recomputing: the prompt, then N+1 .. N+8 tokens
    assert costs == sorted([(9, n + 8), (9, n + sum(n + t for t in range(1, 9)))])
    assert "torch.compile" in scenario_cost(build("compile", n)).text()
    assert DEFAULT_LENGTH > 64  # level 3 caches 64-token blocks: the default prompt must be longer


def test_cli_plan_costs_and_results_as_they_come(tmp_path, cli_env):
    out = tmp_path / "a.h5"
    proc = subprocess.run([sys.executable, "-m", "tracer", "audit", "tiny-llama", "--device", "cpu", "--levels", "0,3",
                           "-o", str(out)], env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    err = [line for line in proc.stderr.splitlines() if not line.startswith("load: ")]  # a slow load says so
    assert err[0].startswith(f"audit: 3 of 3 checks run on tiny-llama (cpu, bfloat16), N = {DEFAULT_LENGTH} tokens")
    plan = {line.split()[0]: line for line in err[1:4]}
    assert set(plan) == {"L0-repeat", "L3-block-size", "L3-chunked-prefill"}
    assert plan["L0-repeat"].endswith(f"2 forward passes, {2 * DEFAULT_LENGTH} tokens")
    done = [line for line in err if line.startswith("audit: ") and "/3 (" in line and "running" not in line]
    assert len(done) == 3 and "L0-repeat: holds bitwise" in done[0]
    # the results came before the table (stdout), one per finished check, each before the next one ran
    assert err.index(done[0]) < next(i for i, x in enumerate(err) if "running L3-block-size" in x)
    assert "hold bitwise" in proc.stdout and out.exists() and not out.with_name("a.h5.checks").exists()


def test_stale_partials_of_dead_writers_are_removed(tmp_path):
    from tracer.store.trace import TraceWriter

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"model-prefix-cache-20260101-000000.h5.partial-{int(dead.stdout)}"
    stale.write_bytes(b"x" * 1000)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f"model-audit.h5.partial-{alive.pid}"
        live.write_bytes(b"y")
        with TraceWriter(tmp_path / "new.h5", header={"x": 1}):
            pass
        assert not stale.exists()  # another name than the new trace's: removed all the same
        assert live.exists()  # a running writer's file is kept
    finally:
        alive.kill()
        alive.wait()
    assert (tmp_path / "new.h5").exists()
