"""Summary first: the headline block, the rows that matter, --all-rows, CSV metadata, progress lines.

Expected values come from the planted tensors themselves (numpy/torch on the raw data), never
from the code under test.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re

import pytest
import torch
import typer
from rich.console import Console

from tests.helpers import cli_session, run_record
from tracer.diff.compare import compare_records
from tracer.progress import ItemProgress, StatusProgress
from tracer.report.render import render
from tracer.report.tables import to_csv
from tracer.report.summary import headline, rows_that_matter


_run = functools.partial(run_record, ids=tuple(range(1, 9)), window=(4, 8))


def _bump(t, idx, ulps=1):
    t = t.clone()
    flat = t.view(-1).view(torch.int16)
    for i in idx:
        flat[i] += ulps
    return t


@pytest.fixture
def chain():
    """8 layers: L0, L1 identical; L2-L4 one element 1 ULP off; L5-L7 ten elements 64 ULPs off;
    the logits of position 1 flipped. Returns (comparison, tensors A, tensors B)."""
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    layers_a = [torch.randn(4, 16, generator=g).to(torch.bfloat16) for _ in range(8)]
    for t in layers_a:  # the bumped elements all at 1.0: 1 ULP is 2**-7 everywhere, 64 ULPs 0.5
        t.view(-1)[5] = 1.0
        t.view(-1)[20:30] = 1.0
    layers_b = [t.clone() for t in layers_a[:2]] + [_bump(t, [5]) for t in layers_a[2:5]] + \
        [_bump(t, range(20, 30), 64) for t in layers_a[5:]]
    logits_a = torch.tensor([[0.0, 1.0, 3.0], [5.0, 1.0, 4.0], [1.0, 2.0, 0.0], [0.0, 0.0, 9.0]], dtype=torch.bfloat16)
    logits_b = logits_a.clone()
    logits_b[1, 2] = 6.0
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(8)), "lm_head"]
    kinds = ["embedding", *["layer"] * 8, "logits"]
    ta, tb = [emb, *layers_a, logits_a], [emb.clone(), *layers_b, logits_b]
    a = _run("A", list(zip(names, kinds, ta)))
    b = _run("B", list(zip(names, kinds, tb)))
    return compare_records(a, b, scenario="prefix-cache", model="planted"), dict(zip(names, ta)), dict(zip(names, tb))


def _run_options(command="run"):
    cmd = typer.main.get_command(__import__("tracer.cli", fromlist=["app"]).app).commands[command]
    return {o for p in cmd.params for o in p.opts}


def test_headline_on_a_diverging_run(chain):
    c, ta, tb = chain
    head = dict(headline(c))  # the last of each label wins; checked below by label
    labels = [k for k, _ in headline(c)]
    assert labels[0] == "verdict" and labels[1] == "origin"
    assert head["origin"].startswith("model.layers.2 (") and "1 element" in head["origin"]
    assert head["first divergent"].startswith("model.layers.2 ")
    first = float((ta["model.layers.2"].double() - tb["model.layers.2"].double()).abs().max())
    last = float((ta["model.layers.7"].double() - tb["model.layers.7"].double()).abs().max())
    assert head["growth"].startswith(f"×{last / first:.3g} from model.layers.2") and "to model.layers.7" in head["growth"]
    n_diff = int((ta["lm_head"].view(torch.int16) != tb["lm_head"].view(torch.int16)).sum())
    flips = int((ta["lm_head"].float().argmax(-1) != tb["lm_head"].float().argmax(-1)).sum())
    assert head["logits"].startswith(f"{100 * n_diff / 12:.3g}% of 12 differ") and f"{flips} argmax flip " in head["logits"]
    assert "first flip at position 5" in head["logits"]  # window starts at 4; row 1 flipped
    nexts = [v for k, v in headline(c) if k == "next"]
    assert any("--granularity sublayers" in s for s in nexts) and any("--mitigation aligned" in s for s in nexts)
    options = _run_options()
    for s in nexts:  # every suggestion names only options `tracer run` has
        for opt in re.findall(r"--[a-z][a-z-]*", s):
            assert opt in options, (opt, s)


def test_headline_on_an_identical_run():
    g = torch.Generator().manual_seed(2)
    t = [torch.randn(4, 8, generator=g) for _ in range(3)]
    kinds = [("model.embed_tokens", "embedding"), ("model.layers.0", "layer"), ("lm_head", "logits")]
    a = _run("A", [(n, k, x) for (n, k), x in zip(kinds, t)])
    b = _run("B", [(n, k, x.clone()) for (n, k), x in zip(kinds, t)])
    c = compare_records(a, b, scenario="prefix-cache", model="planted")
    pairs = headline(c)
    labels = [k for k, _ in pairs]
    assert labels[0] == "verdict" and pairs[0][1].startswith("bit-identical: all 3 capture points")
    assert "origin" not in labels and "growth" not in labels and "first divergent" not in labels
    assert dict(pairs)["logits"].startswith("0% of 32 differ") and "0 argmax flips in 4 positions" in dict(pairs)["logits"]
    nexts = [v for k, v in pairs if k == "next"]
    assert any("tracer sweep" in s and "--lengths" in s for s in nexts) and any("tracer audit" in s for s in nexts)
    assert "--lengths" in _run_options("sweep")
    out = io.StringIO()
    render(c, "table", Console(file=out, width=200, no_color=True))
    assert out.getvalue().startswith("verdict:")


def test_rows_that_matter(chain):
    c, _, _ = chain
    names = [p.name for p in c.points] + ["lm_head (logits)"]
    # by hand from the planted counts: the embedding (first), L2 (origin, 0 -> 1 element), L5 (1 -> 10
    # elements), L7 (last layer), the logits; L0/L1 (0 like the embedding), L3/L4/L6 (unchanged) are cut
    assert [names[i] for i in rows_that_matter(c)] == ["model.embed_tokens", "model.layers.2", "model.layers.5",
                                                       "model.layers.7", "lm_head (logits)"]
    out = io.StringIO()
    render(c, "table", Console(file=out, width=250, no_color=True))
    text = out.getvalue()
    assert text.index("origin:") < text.index("capture point")
    assert "model.layers.3" not in text and "5 of 10 rows" in text and "--all-rows" in text
    out = io.StringIO()
    render(c, "table", Console(file=out, width=250, no_color=True), all_rows=True)
    assert all(f"model.layers.{i}" in out.getvalue() for i in range(8))


def test_csv_rows_carry_run_metadata(chain):
    c, _, _ = chain
    rows = list(csv.DictReader(io.StringIO(to_csv(c))))
    assert len(rows) == 10
    for r in rows:
        assert r["model"] == "planted" and r["scenario"] == "prefix-cache"
        assert (r["positions_start"], r["positions_stop"]) == ("4", "8")
        assert r["verdict"] == "diverges from model.layers.2, 1 argmax flip in 4 positions"
        assert r["first_divergent"] == "model.layers.2"
    assert [r["name"] for r in rows][-1] == "lm_head (logits)"


def test_cli_headline_all_rows_and_csv(tmp_path, cli_env):
    cmd = ["run", "tiny-llama", "--device", "cpu", "--length", "40", "--no-store"]
    procs = cli_session([cmd + ["--format", "json"], cmd, cmd + ["--all-rows"], cmd + ["--format", "csv"]],
                        cli_env, tmp_path)
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
    doc, table, full, csv_text = json.loads(procs[0].stdout), procs[1].stdout, procs[2].stdout, procs[3].stdout
    assert table.startswith(f"verdict:{' ' * 1}") and doc["verdict"] in table.splitlines()[0]
    assert all(f"│ {x['name']} " in full for x in doc["layers"])
    rows = list(csv.DictReader(io.StringIO(csv_text)))
    assert len(rows) == len(doc["layers"]) + 1
    assert {(r["model"], r["positions_start"], r["positions_stop"], r["verdict"]) for r in rows} == \
        {("tiny-llama", str(doc["positions"][0]), str(doc["positions"][1]), doc["verdict"])}


def test_item_progress_lines_without_a_terminal():
    out = io.StringIO()  # not a terminal: one line per item
    with ItemProgress("sweep", 3, mode="auto", stream=out) as bar:
        for n in (20, 24, 40):
            bar.advance(f"N={n}")
    lines = out.getvalue().splitlines()
    assert [re.match(r"sweep: (\d)/3 \(\d+%\) N=(\d+) · elapsed \d+s · ETA \d+s$", x).groups() for x in lines] == \
        [("1", "20"), ("2", "24"), ("3", "40")]
    out = io.StringIO()
    with StatusProgress("bench", stream=out) as status:
        status("repetition 1/4")
        status("repetition 3/4")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("bench: repetition 1/4 · elapsed") and "ETA" not in lines[0] and "ETA" in lines[1]


def test_sweep_progress_lines_when_stderr_is_not_a_terminal(tmp_path, cli_env):
    from tests.helpers import tracer_warm

    proc = tracer_warm(["sweep", "tiny-llama", "--device", "cpu", "--lengths", "20,24", "--output",
                        str(tmp_path / "s.h5")], cli_env, tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("sweep: ") and " running " not in x]
    assert [re.match(r"sweep: (\d)/2 \(\d+%\) N=(\d+) b=16 (diverges|bit-identical)", x).group(1, 2) for x in lines] \
        == [("1", "20"), ("2", "24")]
    running = [x for x in proc.stderr.splitlines() if x.startswith("sweep: ") and " running " in x]
    assert [re.search(r" running N=(\d+) b=16 ", x).group(1) for x in running] == ["20", "24"]  # each point as it starts


def test_audit_skip_reasons_name_only_audit_options():
    from tracer.loops.audit_plan import AUDIT_FLAGS as AUDIT_OPTIONS, skip_hint
    from tracer.plan.build import build

    cmd = typer.main.get_command(__import__("tracer.cli", fromlist=["app"]).app).commands["audit"]
    run_options = __import__("tracer.config", fromlist=["x"]).COMMAND_OPTIONS["audit"]
    assert set(AUDIT_OPTIONS) == {o for p in cmd.params if p.name in run_options and p.name != "model"
                                  for o in (*p.opts, *p.secondary_opts)}
    with pytest.raises(Exception) as e:
        build("prefix-cache", 10)  # 10 tokens: no full 16-token block to cache
    raw = str(e.value)
    assert "--split-at" in raw  # the run-level advice ...
    reason = skip_hint(raw)  # ... becomes advice the audit can follow
    assert reason.startswith(raw.partition("; ")[0]) and "--length" in reason
    assert all(o in AUDIT_OPTIONS for o in re.findall(r"--[a-z][a-z0-9-]*", reason))
    assert skip_hint("no CUDA GPU on this machine") == "no CUDA GPU on this machine"


def test_model_hints(tmp_path, cli_env):
    from tracer.errors import TracerError
    from tracer.load.models import load_model

    with pytest.raises(TracerError) as e:
        load_model("someone/not-cached-anywhere", device="cpu", progress=False)
    assert "hf download someone/not-cached-anywhere" in str(e.value) and "huggingface-cli" not in str(e.value)
    gguf = tmp_path / "model-Q4.gguf"  # a GGUF path is a model now (issue 15); a truncated one is refused in one line
    gguf.write_bytes(b"GGUF")
    with pytest.raises(TracerError) as e:
        load_model(str(gguf), device="cpu", progress=False)
    assert "not a readable GGUF file" in str(e.value) and "truncated or damaged" in str(e.value)


def test_library_run_writes_no_file_unless_asked(tmp_path, monkeypatch, tiny_loaded):
    import tracer

    monkeypatch.chdir(tmp_path)
    res = tracer.run("tiny-llama", loaded=tiny_loaded, length=24, progress=False)
    assert res.trace is None and list(tmp_path.iterdir()) == []
    res = tracer.run("tiny-llama", loaded=tiny_loaded, length=24, progress=False, output=tmp_path / "t.h5")
    assert res.trace == str(tmp_path / "t.h5") and (tmp_path / "t.h5").is_file()


@pytest.fixture(scope="module")
def tiny_loaded():
    from tracer.load.models import load_model

    return load_model("tiny-llama", device="cpu", progress=False)


def test_compare_across_traces_names_every_differing_version(tmp_path, tiny_loaded):
    import h5py

    import tracer
    from tracer.diff.compare import compare_runs
    from tracer.store.integrity import seal, set_text

    for name in ("a.h5", "b.h5"):
        tracer.run("tiny-llama", loaded=tiny_loaded, length=24, progress=False, output=tmp_path / name)
    with h5py.File(tmp_path / "b.h5", "r+") as f:  # as if made elsewhere: other torch and transformers
        header = json.loads(f["header"].attrs["json"])
        old = {k: header[k] for k in ("torch", "transformers", "python")}
        header.update(torch="9.9.9+cu999", transformers="0.0.1")
        set_text(f["header"], "json", json.dumps(header))
        seal(f["header"])  # the edit is deliberate: re-seal the checksum (tracer.store.integrity)
    c = compare_runs((str(tmp_path / "a.h5"), "A"), (str(tmp_path / "b.h5"), "A"))
    assert c.facts["versions_differ"] == [f"torch {old['torch']} (A) vs 9.9.9+cu999 (B)",
                                          f"transformers {old['transformers']} (A) vs 0.0.1 (B)"]
    assert dict(headline(c))["versions"] == "; ".join(c.facts["versions_differ"])


def test_inf_difference_renders(tmp_path):
    from tests.helpers import make_runs

    a, b = make_runs(diverge_at="model.layers.0")
    b.captures["model.layers.1"].tensor[0, 0] = -math.inf  # an overflow in one layer
    c = compare_records(a, b, scenario="s", model="m")
    rows = rows_that_matter(c, limit=3)  # the table's row choice: no math domain error
    assert 0 in rows


def test_positions_past_the_prompt_are_named_decoded_not_of_n():
    from tracer.report.summary import positions_text

    assert positions_text((304, 314), 314) == "positions 304..313 of 314"
    # prefill-decode at N = 130, --new-tokens 4: the prefill's last position (129) gives token 1, and
    # positions 130, 131, 132 are fed tokens 1..3 (3 decode steps) giving tokens 2..4; token 4 is
    # never fed back. Not "of 130", and not "3 decoded" (which reads as one token short).
    assert positions_text((128, 133), 130) == "positions 128..132 (prompt 0..129, 4 generated, 3 decode steps)"
    # --new-tokens 2: one decode step (position 130), singular
    assert positions_text((128, 131), 130) == "positions 128..130 (prompt 0..129, 2 generated, 1 decode step)"
    assert positions_text((0, 8), None) == "positions 0..7"


def test_non_finite_values_are_named_and_their_rows_kept():
    """B turns NaN at layer 3 (1 element), 2 NaN from layer 4 on; A holds +Inf from layer 6 on (B does
    not). The headline names each run's counts and first point; the default rows keep the layers where
    non-finite values appear or their counts change, whatever the row limit."""
    g = torch.Generator().manual_seed(3)
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(10)), "lm_head"]
    kinds = ["embedding", *["layer"] * 10, "logits"]
    ta = [torch.randn(4, 8, generator=g) for _ in names]
    tb = [t.clone() for t in ta]
    for i in range(4, 11):  # layers 3..9 (index 0 is the embedding)
        tb[i].view(-1)[: 1 if i == 4 else 2] = float("nan")
    for i in range(7, 11):  # layers 6..9
        ta[i].view(-1)[10] = math.inf
    c = compare_records(_run("A", list(zip(names, kinds, ta))), _run("B", list(zip(names, kinds, tb))),
                        scenario="s", model="m")
    nan_b = sum(int(t.isnan().sum()) for t in tb)
    inf_a = sum(int(t.isinf().sum()) for t in ta)
    want = (f"A: 0 NaN, {inf_a} Inf in 4 points, first model.layers.6; "
            f"B: {nan_b} NaN, 0 Inf in 7 points, first model.layers.3")
    assert dict(headline(c))["non-finite"] == want
    rows = [p.name for p in c.points] + ["lm_head (logits)"]
    kept = [rows[i] for i in rows_that_matter(c, limit=1)]
    # NaN appears (3), its count changes (4), Inf appears in A (6); 5, 7, 8 hold the same counts as the row before
    assert {"model.layers.3", "model.layers.4", "model.layers.6"} <= set(kept)
    assert not {"model.layers.5", "model.layers.7", "model.layers.8"} & set(kept)
    out = io.StringIO()
    render(c, "table", Console(file=out, width=80, no_color=True))
    assert [ln for ln in out.getvalue().splitlines() if ln.startswith("non-finite:")]
    # every finite comparison says nothing
    clean = compare_records(_run("A", list(zip(names, kinds, ta[:4]))), _run("B", list(zip(names, kinds, ta[:4]))),
                            scenario="s", model="m")
    assert "non-finite" not in dict(headline(clean))


def test_a_difference_that_gets_smaller_reads_as_shrinking():
    """"growth: ×0.625" read as growth for a max |Δ| that got smaller from the first divergent point to
    the last layer; an inf max |Δ| gave "×0". Now: "shrinks to ×0.625", and no ratio of non-finite values."""
    g = torch.Generator().manual_seed(7)
    names = [("model.embed_tokens", "embedding"), ("model.layers.0", "layer"), ("model.layers.1", "layer")]
    ta = [torch.randn(4, 8, generator=g) for _ in names]
    tb = [t.clone() for t in ta]
    tb[1][0, 0] += 0.5  # max |Δ| 0.5 at the first divergent point...
    tb[2][1, 2] += 0.25  # ... 0.25 at the last layer (exact in float32: both are powers of two)
    c = compare_records(_run("A", [(n, k, t) for (n, k), t in zip(names, ta)]),
                        _run("B", [(n, k, t) for (n, k), t in zip(names, tb)]), scenario="prefix-cache", model="m")
    da, db = float((tb[1] - ta[1]).abs().max()), float((tb[2] - ta[2]).abs().max())
    growth = dict(headline(c))["growth"]
    assert growth.startswith(f"shrinks to ×{db / da:.3g} from model.layers.0"), growth
    tb[1][0, 0] = float("inf")
    c = compare_records(_run("A", [(n, k, t) for (n, k), t in zip(names, ta)]),
                        _run("B", [(n, k, t) for (n, k), t in zip(names, tb)]), scenario="prefix-cache", model="m")
    assert dict(headline(c))["growth"].startswith("no ratio (max |Δ| inf → "), dict(headline(c))["growth"]


@pytest.mark.parametrize("generated, words", [([5, 6, 7, 8], "identical for all 4 generated tokens"),
                                              ([5], "identical for the 1 generated token")])
def test_generated_tokens_are_counted_as_tokens(generated, words):
    """generate-cache's note said `identical for all 1 steps`: tokens, and one in the singular."""
    from dataclasses import replace

    from tests.helpers import run_record
    from tracer.diff.facts import run_facts

    a, b = (replace(run_record(n, [("emb", "embedding", torch.zeros(2, 4))]), meta={"generated": list(generated)})
            for n in ("A", "B"))
    notes = run_facts({}, a, b)["notes"]
    assert any(n.endswith(words) for n in notes), notes
    assert not any("steps" in n for n in notes), notes
