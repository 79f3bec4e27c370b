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
    from tests.helpers import tracer_warm

    proc = tracer_warm(["audit", "tiny-llama", "--device", "cpu", "--levels", "0,3", "-o", str(out)], cli_env, tmp_path,
                       check=False)
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
    assert " bitwise, " in proc.stdout and out.exists() and not out.with_name("a.h5.checks").exists()


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


# --- a kept row is believed only when its part trace bears it out; one writer per folder ---------------------

SMALL = dict(levels="0,1", length=40, progress=False)


@pytest.fixture(scope="module")
def small(loaded, tmp_path_factory):
    """The rows of an uninterrupted audit of levels 0 and 1, and a folder kept after its first check."""
    d = tmp_path_factory.mktemp("small")
    whole = tracer.audit(loaded, output=str(d / "whole.h5"), **SMALL)

    def stop_after_one(row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tracer.audit(loaded, output=str(d / "cut.h5"), on_row=stop_after_one, **SMALL)
    folder = d / "cut.h5.checks"
    assert sorted(p.name for p in folder.iterdir()) == ["L0-repeat.h5", "L0-repeat.json", "audit.json"]
    return whole, folder


def _copy(folder, tmp_path):
    import shutil

    out = tmp_path / "audit.h5"
    shutil.copytree(folder, tmp_path / "audit.h5.checks")
    return out, tmp_path / "audit.h5.checks"


def _resume(loaded, out):
    ran, lines = [], []
    import io
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        res = tracer.audit(loaded, output=str(out), on_check=lambda label, i, n: ran.append(label),
                           **{**SMALL, "progress": "lines"})
    lines = err.getvalue().splitlines()
    return res, ran, lines


def test_a_row_without_its_part_is_run_again(loaded, small, tmp_path):
    """A row written by hand (status passed, no part trace beside it) is not believed: the check runs."""
    import json

    whole, template = small
    out, folder = _copy(template, tmp_path)
    forged = {**json.loads((folder / "L0-repeat.json").read_text()), "key": "L1-batch-padded", "status": "passed"}
    (folder / "L1-batch-padded.json").write_text(json.dumps(forged))
    res, ran, lines = _resume(loaded, out)
    assert res.rows == whole.rows
    label = next(r.check.label for r in whole.rows if r.check.key == "L1-batch-padded")
    assert label in ran and "L0-repeat" not in " ".join(ran)  # the sealed row is reused, the forged one is not
    plan = next(x for x in lines if x.strip().startswith("L1-batch-padded "))
    assert "runs again: an earlier row is not believed" in plan and "L1-batch-padded.h5 is missing" in plan


def test_a_row_sealed_to_another_checks_part_is_run_again(loaded, small, tmp_path):
    """A part trace copied under another check's name, with that check's row sealed to it: the part
    holds no comparison of the check, so the row is not believed."""
    import json
    import shutil

    from tracer.files import sha256_file

    whole, template = small
    out, folder = _copy(template, tmp_path)
    shutil.copy(folder / "L0-repeat.h5", folder / "L1-batch.h5")
    real = next(r for r in whole.rows if r.check.key == "L1-batch")
    from tracer.loops.audit import row_record

    seal = json.loads((folder / "L0-repeat.json").read_text())
    (folder / "L1-batch.json").write_text(json.dumps({**row_record(real), "key": "L1-batch", "fingerprint": seal["fingerprint"],
                                                      "part_sha256": sha256_file(folder / "L1-batch.h5")}))
    res, ran, lines = _resume(loaded, out)
    assert res.rows == whole.rows and real.check.label in ran
    assert "holds no comparison of it" in next(x for x in lines if x.strip().startswith("L1-batch "))


def test_a_row_edited_after_it_was_sealed_is_run_again(loaded, small, tmp_path):
    """The part is the one the row was sealed with, but the row now says something its comparison does not."""
    import json

    whole, template = small
    out, folder = _copy(template, tmp_path)
    row = json.loads((folder / "L0-repeat.json").read_text())
    assert row["status"] == "passed"
    (folder / "L0-repeat.json").write_text(json.dumps({**row, "status": "failed", "first_divergent": "model.layers.0"}))
    res, ran, lines = _resume(loaded, out)
    assert res.rows == whole.rows and "the same call twice" in ran
    assert "does not say what its part trace's comparison says" in next(x for x in lines if x.strip().startswith("L0-repeat "))


def test_fifos_in_the_checks_folder_never_block(loaded, small, tmp_path, cli_env):
    """A FIFO named like a row is not read (its check runs again); a FIFO as the folder's header is one line, exit 2."""
    import os

    whole, template = small
    out, folder = _copy(template, tmp_path)
    (folder / "L0-repeat.json").unlink()
    os.mkfifo(folder / "L0-repeat.json")
    res, ran, lines = _resume(loaded, out)
    assert res.rows == whole.rows and "the same call twice" in ran
    assert "FIFO" in next(x for x in lines if x.strip().startswith("L0-repeat "))

    out, folder = _copy(template, tmp_path / "second")
    (folder / "audit.json").unlink()
    os.mkfifo(folder / "audit.json")
    with pytest.raises(TracerError, match=r"is not the folder of an unfinished audit .*FIFO"):
        tracer.audit(loaded, output=str(out), **SMALL)


def test_a_second_writer_of_one_output_is_refused_before_its_model_loads(loaded, tmp_path):
    """While one audit holds OUT.h5.checks, another `tracer audit -o OUT.h5` is refused in one line
    before any model loads (in the same process: a load raises); once the claim is given up it runs."""
    from tests.helpers import cli_batch
    from tracer.loops.audit_store import FolderClaim

    out = tmp_path / "same.h5"
    claim = FolderClaim(out)
    try:
        [(code, err)] = cli_batch([["audit", "tiny-llama", "--device", "cpu", "--levels", "0", "-o", str(out)]], tmp_path)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: another tracer audit is writing {out}"), err
        with pytest.raises(TracerError, match="another tracer audit is writing"):
            tracer.audit(loaded, output=str(out), levels="0", length=40, progress=False)
        assert list(out.with_name("same.h5.checks").iterdir()) == []  # the refused one wrote nothing
    finally:
        claim.release()
    res = tracer.audit(loaded, output=str(out), levels="0", length=40, progress=False)
    assert [r.status for r in res.rows] == ["passed"] and out.exists()


# --- an audit that fits: small parts, disk use and a TP degree in the plan ---------------------------------

def _llama(heads: int, kv_heads: int, hidden: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=hidden, intermediate_size=2 * hidden,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=64)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_real_tp_runs_at_a_degree_the_model_shards_to_or_is_skipped_in_the_plan():
    """SmolLM2's 9 heads refused TP-2 only once the check ran; now the plan picks the smallest degree
    that divides the heads, the KV heads and the sharded dimensions, or skips the check with the reason."""
    from tracer.loops.audit_plan import fit_check

    real = next(c for c in tracer.loops.audit.checks() if c.key == "L4-tp-real")
    assert fit_check(real, _llama(4, 2, 32)) == (real, None)  # TP-2 divides: the check as it is
    three, why = fit_check(real, _llama(9, 3, 36))  # SmolLM2's heads: 9 and 3
    assert why is None and three.options["tp"] == 3 and "real TP-3 " in three.label
    same, why = fit_check(real, _llama(11, 11, 44))  # no degree from 2 to 8 divides 11
    assert same is real and "does not divide the 11 attention heads" in why and "up to 8" in why


def test_default_parts_keep_the_origins_neighbourhood_and_the_plan_states_the_disk_bound(loaded, tmp_path):
    """Without --max-trace-size a check keeps 1 MiB of full tensors (both runs) and every point's
    statistics; the plan's disk line bounds what is written; --max-trace-size raises it (full tensors on request)."""
    import contextlib
    import io
    import re

    from tracer.config import RunConfig
    from tracer.loops.audit import CHECK_BUDGET, check_budget
    from tracer.store.budget import parse_size

    assert check_budget(RunConfig.from_options(model="m", store="auto")) == CHECK_BUDGET == 1 << 20
    assert check_budget(RunConfig.from_options(model="m", store="auto", max_trace_size="2GiB")) == 2 << 30
    assert check_budget(RunConfig.from_options(model="m", store="tensors")) is None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        tracer.audit(loaded, output=str(tmp_path / "a.h5"), levels="0,5", length=40, progress="lines",
                     max_trace_size="64KiB")
    line = next(x for x in err.getvalue().splitlines() if x.startswith("audit: disk: at most "))
    bound = parse_size(re.match(r"audit: disk: at most ([\d.]+) (\w+)", line).expand(r"\1\2"))
    assert (tmp_path / "a.h5").stat().st_size <= bound, line
    with TraceReader(tmp_path / "a.h5") as r:
        auto = r.run("L5-kv-fp8.A", load_tensors=False).meta["store_auto"]
        assert auto["budget"] == 64 << 10 and auto["dropped"] and auto["kept_bytes"] <= 64 << 10
        assert set(r.comparisons()) >= {"L0-repeat", "L5-kv-fp8"}  # every check's statistics, whatever was dropped
