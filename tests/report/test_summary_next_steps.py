"""Headlines that say the answer (issue 25, item 4): `--verdict`'s answer on the first line and in the
closing line; every "next:" suggestion valid for the command that prints it."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
import torch
import typer
from rich.console import Console

from tracer.cli import app
from tracer.diff.verdict import Level, NoiseVerdict
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.report.summary import next_steps
from tracer.store.trace import TraceWriter

CLI = typer.main.get_command(app).commands


def _flags(command: str) -> set[str]:
    return {o for p in CLI[command].params for o in (*p.opts, *p.secondary_opts)}


def check_suggestion(text: str, command: str) -> None:
    """Every backticked command line of ``text``: ``tracer X ...`` uses X's options; a bare option
    (``--verdict``) must be one of ``command``'s; ``report`` (a file, no command) has no bare options."""
    for code in re.findall(r"`([^`]+)`", text):
        words = code.split()
        if words[0] == "tracer":
            assert words[1] in CLI, code
            own = words[1]
        else:
            assert command != "report", f"a report cannot take options: {code!r}"
            own = command
        for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", code):
            assert flag in _flags(own), f"{command} suggests {code!r}, but 'tracer {own}' has no {flag}"


def _comparison(**kw):
    """A stand-in with the fields next_steps reads (a pure function of them): every branch reachable."""
    point = SimpleNamespace(kind="layer", n_diff_prefix=0)
    base = dict(identical=False, model="smollm2-135m", scenario="prefix-cache", positions=(16, 24), origins=[point],
                points=[point], facts={}, noise=None, replay=None, logits=object(), rl=None)
    return SimpleNamespace(**{**base, **kw})


CASES = [
    _comparison(),
    _comparison(identical=True),
    _comparison(origins=[SimpleNamespace(kind="kv_cache", n_diff_prefix=3)]),
    _comparison(scenario="batch", model="model"),
    _comparison(scenario="rollout-vs-train", rl=SimpleNamespace(mitigations=())),
    _comparison(noise=object(), replay=object(), points=[SimpleNamespace(kind="linear", n_diff_prefix=0)]),
]


@pytest.mark.parametrize("command", ["run", "compare", "report"])
def test_every_suggestion_is_valid_for_the_command_that_prints_it(command):
    seen = set()
    for c in CASES:
        for s in next_steps(c, command):
            check_suggestion(s, command)
            seen |= set(re.findall(r"--[a-z][a-z-]*", s))
    # every kind of suggestion was checked: the bare-option ones and the other commands
    assert {"--positions", "--granularity", "--mitigation", "--verdict", "--decode", "--mitigations"} <= seen


def test_compare_names_tracer_run_with_the_model_and_scenario():
    steps = next_steps(_comparison(scenario="batch"), "compare")
    assert any(s.startswith("`tracer run smollm2-135m --scenario batch --granularity sublayers`") for s in steps)
    assert not any(s.startswith("`--") for s in steps)


def test_identical_engine_dumps_get_no_hf_sweep_or_audit_suggestion():
    """Two engine dumps that agree: `tracer sweep MODEL` and `tracer audit MODEL` would run the HF model, not the
    engines that were compared; nothing is suggested (an HF comparison keeps both suggestions)."""
    dumps = _comparison(identical=True, facts={"engine": "SGLang dumper vs Megatron-LM dump"})
    assert next_steps(dumps, "compare") == []
    hf = " ".join(next_steps(_comparison(identical=True), "compare"))
    assert "`tracer sweep smollm2-135m" in hf and "`tracer audit smollm2-135m`" in hf


def _engines(a: str, b: str) -> dict:
    return {"engine_a": {"engine": a, "version": "x"}, "engine_b": {"engine": b, "version": "y"}}


def test_runs_in_vllm_get_suggestions_that_run_vllm_again():
    """`--engine vllm` and `--scenario engine` runs: `--verdict` is refused there (it re-runs the HF
    model), and `tracer sweep/audit MODEL` without `--engine vllm` would run HF, not vLLM."""
    same = _comparison(identical=True, scenario="batch", facts=_engines("vllm", "vllm"))
    steps = " ".join(next_steps(same, "run"))
    assert "`tracer sweep smollm2-135m --scenario batch --engine vllm --lengths " in steps  # its scenario too
    assert "`tracer audit smollm2-135m --engine vllm`" in steps
    for c in (_comparison(scenario="batch", facts=_engines("vllm", "vllm")),
              _comparison(scenario="engine", facts=_engines("hf", "vllm")),
              _comparison(scenario="rollout-vs-train", facts=_engines("vllm", "hf"), rl=SimpleNamespace(mitigations=()))):
        for command in ("run", "compare", "report"):
            steps = next_steps(c, command)
            assert steps and not any("--verdict" in s for s in steps), (c.scenario, command, steps)
            assert not any("--mitigations" in s for s in steps)  # refused with --engine vllm too
            for s in steps:
                check_suggestion(s, command)
    compare = next_steps(_comparison(scenario="batch", facts=_engines("vllm", "vllm")), "compare")
    assert compare[0].startswith("`tracer run smollm2-135m --scenario batch --engine vllm --granularity sublayers`")
    engine = next_steps(_comparison(scenario="engine", facts=_engines("hf", "vllm")), "compare")
    assert engine[0].startswith("`tracer run smollm2-135m --scenario engine --granularity sublayers`")
    # two engines that agree: a sweep or an audit of one engine is not what was compared
    assert next_steps(_comparison(identical=True, scenario="engine", facts=_engines("hf", "vllm")), "run") == []


def test_tracer_compare_prints_only_suggestions_it_accepts(tmp_path, cli_env):
    """End to end: a diverging trace compared on the command line (the bug: compare suggested
    --positions all, --granularity sublayers, --mitigation aligned, --verdict, --decode 16)."""
    g = torch.Generator().manual_seed(0)
    runs = []
    for name in ("A", "B"):
        caps = {}
        for i, cap in enumerate(("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm")):
            x = torch.randn(4, 8, generator=g) if name == "A" else runs[0].captures[cap].tensor.clone()
            if name == "B" and i >= 2:
                x = torch.nextafter(x, torch.full_like(x, 10.0))
            caps[cap] = CaptureRecord(cap, "embedding" if i == 0 else "final_norm" if i == 3 else "layer", x)
        caps["lm_head"] = CaptureRecord("lm_head", "logits", torch.randn(4, 16, generator=torch.Generator().manual_seed(1)))
        runs.append(RunRecord(name, [1, 2, 3, 4, 5, 6], {"description": name}, (2, 6), caps, meta={}))
    with TraceWriter(tmp_path / "t.h5", header={"model": {"name": "tiny-llama"}, "scenario": {"name": "prefix-cache"}}) as w:
        for r in runs:
            w.add_run(r)
    from tests.helpers import tracer_warm

    out = tracer_warm(["compare", str(tmp_path / "t.h5")], cli_env, tmp_path, check=False).stdout
    nexts = [line.partition("next:")[2] for line in out.splitlines() if line.startswith("next:")]
    assert len(nexts) >= 3, out
    for s in nexts:
        check_suggestion(s, "compare")
    assert any("`tracer run " in s and "--verdict" in s for s in nexts)


def _noise(verdict, logits):
    levels = tuple(Level(d, e, x, x, x == 0) for d, e, x in zip(("bfloat16", "float32", "float64"),
                                                                 (2 ** -7, 2 ** -23, 2 ** -52), logits))
    return NoiseVerdict(verdict, "the numbers", "model.layers.29", levels)


@pytest.mark.parametrize("verdict, logits, words", [
    ("rounding noise", (0.25, 1.2e-6, 3e-15), "rounding noise (the error shrinks with ε: logits max|Δ| bfloat16 0.25 → "
                                              "float32 1.2e-06 → float64 3e-15)"),
    ("defect suspected", (0.25, 0.24, 0.2), "defect suspected (the error does not shrink with ε: logits max|Δ| "
                                            "bfloat16 0.25 → float32 0.24 → float64 0.2)"),
])
def test_verdict_says_the_answer_first_and_last(verdict, logits, words):
    from dataclasses import replace

    from tracer.diff.compare import compare_records
    from tracer.report.render import render

    g = torch.Generator().manual_seed(3)
    ta = [torch.randn(4, 8, generator=g) for _ in range(3)]
    tb = [ta[0].clone(), torch.nextafter(ta[1], torch.full_like(ta[1], 9.0)), ta[2].clone()]
    names = [("model.embed_tokens", "embedding"), ("model.layers.0", "layer"), ("lm_head", "logits")]
    run = lambda n, ts: RunRecord(n, list(range(8)), {"chunks": [[0, 8]]}, (4, 8),  # noqa: E731
                                  {nm: CaptureRecord(nm, k, t) for (nm, k), t in zip(names, ts)})
    c = replace(compare_records(run("A", ta), run("B", tb), scenario="prefix-cache", model="m"),
                noise=_noise(verdict, logits))
    out = io.StringIO()
    render(c, "table", Console(file=out, width=2000, no_color=True))  # wide: each line whole
    lines = out.getvalue().splitlines()
    verdicts = [x.partition("verdict:")[2].strip() for x in lines if x.startswith("verdict:")]
    assert lines[0].startswith("verdict:") and len(verdicts) == 2  # the headline's first line and the closing one
    assert verdicts == [f"{words}; {c.verdict()}"] * 2


# --- every suggestion, pasted as printed, resolves: a GGUF by path, a folder and a recipe ---------------------

PASTE_IDS = ",".join(str((11 * i + 5) % 300) for i in range(40))


@pytest.fixture(scope="module")
def three_models(tmp_path_factory):
    """The same tiny Qwen3 as a GGUF file (its stem names no model) and as a folder, and the tiny-llama recipe."""
    pytest.importorskip("gguf")
    from tests.load.test_gguf import tiny_qwen3, write_gguf

    d = tmp_path_factory.mktemp("paste")
    model = tiny_qwen3()
    write_gguf(model, d / "tiny-qwen3.Q8_0.gguf")
    model.save_pretrained(d / "a folder")  # a space: the suggestion must quote it
    return {"gguf": str(d / "tiny-qwen3.Q8_0.gguf"), "folder": str(d / "a folder"), "recipe": "tiny-llama"}


def _pasted(argv: list[str], suggestion: str) -> list[list[str]]:
    """The command lines a user gets by pasting each backticked part of ``suggestion``: a whole
    ``tracer X ...`` as it is, a bare option appended to the command that printed it (``argv``)."""
    import shlex

    out = []
    for code in re.findall(r"`([^`]+)`", suggestion):
        words = shlex.split(code)
        out.append(words[1:] if words[0] == "tracer" else [*argv, *words])
    return out


def test_every_suggestion_pasted_as_printed_resolves(three_models, tmp_path, monkeypatch):
    """Each "next:" suggestion of a run (identical and diverging) on a GGUF by path, a folder and a recipe,
    and of `tracer compare` on its trace, pasted as printed, parses and passes every check up to the
    model load (in the checking process a model load raises, so nothing runs)."""
    import tracer
    from tests.helpers import cli_batch

    monkeypatch.setenv("TRACER_CACHE_DIR", str(tmp_path / "cache"))
    pasted, stems = [], []
    for kind, model in three_models.items():
        for scenario in ("repeat", "kv-quant"):  # an identical run (sweep, audit) and a diverging one (options)
            argv = ["run", model, "--device", "cpu", "--dtype", "float32", "--token-ids", PASTE_IDS,
                    "--scenario", scenario]
            res = tracer.run(model, device="cpu", dtype="float32", token_ids=[int(x) for x in PASTE_IDS.split(",")],
                             scenario=scenario, store="none", progress=False)
            c = res.comparison
            assert c.identical is (scenario == "repeat"), (kind, scenario)
            for command in ("run", "compare"):
                for s in next_steps(c, command):
                    pasted += _pasted(argv, s)
                    stems += re.findall(r"`tracer \w+ (\S+)", s)
    assert {w[0] for w in pasted} == {"run", "sweep", "audit"}  # options of a run, and whole commands
    # a GGUF by path is named by its path (its stem names no model), a folder by its path, quoted
    assert "tiny-qwen3.Q8_0" not in stems and three_models["gguf"] in stems and "tiny-llama" in stems
    assert any(three_models["folder"] in " ".join(w) for w in pasted)
    for args, (code, err) in zip(pasted, cli_batch(pasted, tmp_path, timeout=600)):
        # past the parser and every check: the next step would have loaded the model
        assert code == 3 and "a model was loaded" in err, (args, code, err)


def test_an_origin_born_in_the_cached_prefix_gets_one_command_that_names_the_op():
    """The default run's origin is a KV cache written in the cached-prefix pass: `--granularity sublayers`
    alone compares that pass at the KV cache only (its op is not traced), so the one suggestion that names
    the op is both options together; a sublayers run of the window is told to add `--positions all`."""
    kv = SimpleNamespace(kind="kv_cache", n_diff_prefix=155)
    layers = next_steps(_comparison(origins=[kv], points=[kv]), "run")
    assert layers[0].startswith("`--positions all --granularity sublayers`: the divergence is born in the cached-prefix")
    assert not any(s.startswith("`--granularity sublayers`") or s.startswith("`--positions all`:") for s in layers)
    subs = next_steps(_comparison(origins=[kv], points=[kv, SimpleNamespace(kind="linear", n_diff_prefix=0)]), "run")
    assert subs[0].startswith("`--positions all`: the divergence is born in the cached-prefix pass")
    compare = next_steps(_comparison(origins=[kv], points=[kv]), "compare")
    assert compare[0].startswith("`tracer run smollm2-135m --positions all --granularity sublayers`")


def test_a_sublayers_suggestion_states_the_trace_it_will_write(tmp_path):
    """`next: --granularity sublayers` did not say what it costs (the default prompt's trace: 257 MiB):
    the suggestion states the most such a trace takes, counted on the model's own sublayer points
    (every position of both runs), and such a run then writes no more than that (with HDF5's own bytes
    and the per-position statistics on top: a factor of 1.6 at most)."""
    import os

    import tracer

    kw = dict(dtype="bfloat16", device="cpu", length=48, progress=False)
    layers = tracer.run("tiny-llama", output=str(tmp_path / "l.h5"), **kw)
    est = layers.comparison.facts["sublayers_bytes"]
    tracer.run("tiny-llama", output=str(tmp_path / "s.h5"), granularity="sublayers", **kw)
    written = os.path.getsize(tmp_path / "s.h5")
    assert written <= 1.6 * est and est < 8 << 20, (est, written)
    steps = next_steps(_comparison(facts={"sublayers_bytes": 5 << 20}), "run")
    assert any(s.startswith("`--granularity sublayers`: names the op") and s.endswith("; its trace takes up to about 5 MiB")
               for s in steps), steps
    steps = next_steps(_comparison(origins=[SimpleNamespace(kind="kv_cache", n_diff_prefix=3)],
                                   facts={"sublayers_bytes": 3 << 30}), "run")
    assert steps[0].startswith("`--positions all --granularity sublayers`") and "about 3 GiB" in steps[0], steps


def test_a_run_and_a_compare_of_its_trace_state_one_sublayers_size(tmp_path):
    """`tracer run` counted the sublayers trace's size on the model's own points, `tracer compare
    TRACE` on a generic formula from the header's shapes (258 vs 221 MiB for smollm2-135m): the header
    now records the model's sublayers width, and both print one number. That number is checked
    against a real ``--granularity sublayers --positions all --store tensors`` trace of the same model
    and prompt: the file's bytes on disk within 10 % of it (the estimate says "about" and claims no
    tolerance: it counts the tensors and the per-point statistics, the file holds both plus HDF5's
    own bytes), and the tensors alone (every dataset's ``nbytes``, h5py) no more than it: at N = 128
    the statistics, stored outside the datasets, are about a tenth of the trace."""
    import os

    import h5py

    import tracer
    from tracer.diff.compare import compare_trace

    kw = dict(dtype="bfloat16", device="cpu", length=128, progress=False)
    run = tracer.run("tiny-llama", output=str(tmp_path / "l.h5"), store="tensors", **kw)
    est = run.comparison.facts["sublayers_bytes"]
    assert est and compare_trace(str(tmp_path / "l.h5")).facts["sublayers_bytes"] == est
    tracer.run("tiny-llama", output=str(tmp_path / "s.h5"), store="tensors", granularity="sublayers",
               positions="all", **kw)
    sizes: list[int] = []
    with h5py.File(tmp_path / "s.h5", "r") as f:
        f.visititems(lambda _, o: sizes.append(o.nbytes) if isinstance(o, h5py.Dataset) else None)
    on_disk = os.path.getsize(tmp_path / "s.h5")
    assert abs(est - on_disk) <= 0.10 * on_disk and sum(sizes) <= est, (est, on_disk, sum(sizes))


def test_two_machines_running_one_plan_get_no_aligned_suggestion():
    """A CPU's trace and a GPU's of one prefix-cache plan: aligning the split (--mitigation aligned)
    changes nothing between them; two plans of one trace (a cache hit and a miss) still get it."""
    plan = "prefill [0, 16) then [16, 24) against the cache"
    machines = _comparison(facts={"versions_differ": ["torch 2.9.0+cpu (A) vs 2.9.0+cu130 (B)"],
                                  "plan_a": plan, "plan_b": plan})
    hit_miss = _comparison(facts={"plan_a": plan, "plan_b": "prefill [0, 24) in one pass"})
    assert not any("--mitigation aligned" in s for s in next_steps(machines, "compare"))
    assert any("--mitigation aligned" in s for s in next_steps(hit_miss, "compare"))


def test_an_identical_run_suggests_a_sweep_of_minutes_in_its_scenario():
    """The sweep suggested after bit-identical runs was `--lengths 17:512` (hours on a CPU) and, after
    --scenario generate-cache, a sweep of prefix-cache: it keeps the scenario and a few lengths."""
    from tracer.loops.sweep import parse_int_list

    steps = next_steps(_comparison(identical=True, scenario="generate-cache"), "run")
    code = next(m for s in steps for m in re.findall(r"`([^`]+)`", s) if m.startswith("tracer sweep"))
    words = code.split()
    assert words[words.index("--scenario") + 1] == "generate-cache", code
    lengths = parse_int_list(words[words.index("--lengths") + 1])
    assert len(lengths) <= 20 and max(lengths) <= 256 and min(lengths) >= 17, code


def test_a_suggested_command_is_not_broken_inside_its_backticks():
    """At 80 columns the sweep command wrapped inside its backticks; it fits a line of its own."""
    from tracer.report.console import fit

    code = "`tracer sweep smollm2-135m --scenario generate-cache --lengths 17:129:8`"
    text = f"other prompt lengths can diverge where this one does not: {code} maps 15 of them"
    console = Console(file=io.StringIO(), width=80, force_terminal=True)
    lines = fit(text, console, 7, label="next:").plain.splitlines()
    assert any(code in line for line in lines), lines
    assert all(len(line) <= 80 for line in lines)


def test_a_comparison_with_an_aligned_side_gets_no_aligned_suggestion():
    """A default trace against an aligned one (`tracer compare DEFAULT.h5 ALIGNED.h5`): one side already
    ran --mitigation aligned, so it is not suggested; neither side aligned: suggested."""
    aligned = "cache miss, aligned: 304 + 10 tokens (split at the block boundary)"
    plain = "cache miss: all 314 tokens in one pass"
    for a, b in ((plain, aligned), (aligned, plain)):
        c = _comparison(facts={"versions_differ": [], "plan_a": a, "plan_b": b})
        assert not any("--mitigation aligned" in s for s in next_steps(c, "compare")), (a, b)
    c = _comparison(facts={"plan_a": plain, "plan_b": "cache hit: 304 cached tokens, then the 10-token suffix"})
    assert any("--mitigation aligned" in s for s in next_steps(c, "compare"))


def test_a_vllm_run_that_ran_aligned_gets_no_aligned_suggestion():
    """`tracer run M --engine vllm --mitigation aligned`: vLLM describes its own plans (the miss chunked
    at P by the scheduler's budget); that run already aligned the split, so `--mitigation aligned` is
    not suggested again. The same run without the mitigation still gets it."""
    from tracer.engines.vllm.realise import realise
    from tracer.plan.scenarios import prefix_cache

    engine = {"engine": "vllm"}
    for mitigation, suggested in ((None, True), ("aligned", False)):
        scen = realise(prefix_cache(64, split_at=32, mitigation=mitigation))
        c = _comparison(facts={"plan_a": scen.plan_a.description, "plan_b": scen.plan_b.description,
                               "engine_a": engine, "engine_b": engine})
        steps = next_steps(c)
        assert any("--mitigation aligned" in s for s in steps) == suggested, (mitigation, scen.plan_a.description)
