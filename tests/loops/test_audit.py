"""`tracer audit` end to end through the CLI on tiny-llama, and comparing traces of two files (the
commands by ``tracer.cli.main`` in the suite's warm worker, tests/helpers.tracer_warm, but one run of
the two-file comparison and the refusal of the device scenario, in a process of their own)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import bad_cli, tracer_cli, tracer_warm
from tracer.loops.audit import checks, parse_levels
from tracer.errors import TracerError
from tracer.store.trace import TraceReader


def test_audit_end_to_end(tmp_path, cli_env):
    out = tmp_path / "audit.h5"
    proc = tracer_warm(["audit", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--length", "48",
                   "--levels", "0,1,3,4,5,7", "--format", "json", "-o", str(out)], cli_env, tmp_path)
    doc = json.loads(proc.stdout)
    rows = {r["key"]: r for r in doc["rows"]}
    assert {r["level"] for r in doc["rows"]} == {0, 1, 3, 4, 5, 7}
    s = doc["summary"]
    assert s["total"] == len(doc["rows"]) == s["passed"] + s["failed"] + s["skipped"]
    assert rows["L0-repeat"]["holds_bitwise"] is True and rows["L0-repeat"]["status"] == "passed"
    # level 4 for real: 2 gloo ranks on the CPU (the row names the mode and the backend)
    real = rows["L4-tp-real"]
    assert real["status"] in ("passed", "failed") and real["check"].endswith("torch.distributed (gloo)")
    assert real["last_layer_total"] == 48 * 64 and "simulated" in rows["L4-tp-sim-ring"]["check"]
    if real["status"] == "failed":  # the deterministic collective is tried and reported like other mitigations
        assert isinstance(real["mitigations"]["deterministic"], bool)
    assert rows["L3-block-size"]["status"] == "skipped" and "KV block" in rows["L3-block-size"]["reason"]  # N=48 < 64
    if not torch.cuda.is_available():
        assert rows["L7-device"]["status"] == "skipped" and "no CUDA GPU" in rows["L7-device"]["reason"]
    for key in ("L5-kv-fp8", "L5-kv-mxfp8", "L5-kv-nvfp4"):  # quantizing the KV cache must change something
        assert rows[key]["status"] == "failed" and rows[key]["max_abs_logit_diff"] > 0
        assert "deterministic" in rows[key]["mitigations"]
    for r in doc["rows"]:
        assert r["seed_status"]
        if r["status"] != "skipped":
            assert r["last_layer_total"] > 0 and r["argmax_flips"] is not None
    with TraceReader(out) as reader:
        assert {"L0-repeat.A", "L0-repeat.B", "L5-kv-fp8.A", "L5-kv-fp8+deterministic.B", "L4-tp-real.B"} <= set(reader.runs)
        assert reader.header["audit"]["L5-kv-mxfp8"]["params"]["kv_block_format"]["block_size"] == 32
        assert (reader.header["tensor_parallel"]["backend"], reader.header["tensor_parallel"]["world_size"]) == ("gloo", 2)
        assert reader.header["audit"]["L5-kv-nvfp4"]["params"]["kv_block_format"]["scale"] == "e4m3"
    # a stored audit run pair compares again from the file
    again = json.loads(tracer_warm(["compare", str(out), "L5-kv-fp8.A", "L5-kv-fp8.B", "-f", "json"], cli_env,
                                   tmp_path).stdout)
    assert again["scenario"] == "kv-quant" and again["logits"]["n_diff"] > 0


def test_audit_table_and_markdown(tmp_path, cli_env):
    proc = tracer_warm(["audit", "tiny-llama", "--device", "cpu", "--length", "40", "--levels", "0,2",
                   "--no-store", "--format", "markdown"], cli_env, tmp_path)
    assert "| level |" in proc.stdout and "cache miss vs hit at N-1" in proc.stdout
    assert "largely solved" in proc.stdout
    proc = tracer_warm(["audit", "tiny-llama", "--device", "cpu", "--length", "40", "--levels", "7", "--no-store"],
                  cli_env, tmp_path)
    assert " bitwise, " in proc.stdout  # "N checks: K hold(s) bitwise, ..."
    if not torch.cuda.is_available():
        assert "skipped" in proc.stdout and "no CUDA GPU" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["audit", "tiny-llama", "--levels", "0,9"], "levels are 0-7"),
    (["audit", "tiny-llama", "--levels", "x"], "comma-separated"),
    (["audit", "tiny-llama", "--format", "yaml"], "unknown format"),
    (["run", "tiny-llama", "--scenario", "kv-quant", "--kv-format", "int3"], "kv-format"),
    (["run", "tiny-llama", "--scenario", "tensor-parallel", "--reduce", "butterfly"], "reduce"),
    (["run", "tiny-llama", "--scenario", "batch", "--padding", "middle"], "padding"),
    (["run", "tiny-llama", "--scenario", "block-size", "--block-sizes", "16,x"], "block-sizes"),
    (["run", "tiny-llama", "--scenario", "attention", "--attn-b", "magic"], "attention"),
])
def test_bad_audit_and_scenario_input(tmp_path, cli_env, args, needle):
    bad_cli(args, cli_env, tmp_path, needle, warm=True)


def test_audit_takes_the_scenario_options_of_its_checks():
    """tracer.audit(attn_a=...) / tracer audit --batch-row ... (the options issue 22 gave the audit) were refused
    before anything ran: "option(s) batch_row do not apply to scenario prefix-cache", the default scenario of a
    command that takes none. Now they reach the checks that use them; a bad value is still refused before loading."""
    import tracer as api
    from tracer import config
    from tracer.validate import validate

    res = api.audit("tiny-llama", levels=[1], batch_size=2, batch_row=0, length=24, store=False, progress=False)
    rows = {r.check.key: r for r in res.rows}
    assert set(rows) == {"L1-batch", "L1-batch-padded"} and all(r.status != "skipped" for r in rows.values())
    # the attention options pass the pre-load checks (level 6 itself runs torch.compile: too slow here)
    cfg = config.RunConfig.from_options(allowed=config.COMMAND_OPTIONS["audit"], check_scenario=False,
                                        model="tiny-llama", attn_a="eager", attn_b="sdpa", tp=2)
    assert validate(cfg) is cfg
    with pytest.raises(TracerError, match="unknown attention implementation 'flash'"):
        api.audit("tiny-llama", levels=[6], attn_a="flash", store=False, progress=False)


def test_device_scenario_without_gpu(tmp_path, cli_env):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    bad_cli(["run", "tiny-llama", "--scenario", "device"], cli_env, tmp_path, "--devices")


def test_compare_two_trace_files(tmp_path, cli_env):
    # two processes: one of its own, the suite's warm worker (tests/helpers.tracer_warm)
    for name, command in (("one.h5", tracer_cli), ("two.h5", tracer_warm)):
        command(["run", "tiny-llama", "--scenario", "repeat", "--length", "30", "--device", "cpu", "-o",
                str(tmp_path / name)], cli_env, tmp_path)
    doc = json.loads(tracer_warm(["compare", str(tmp_path / "one.h5"), str(tmp_path / "two.h5:B"), "-f", "json"],
                            cli_env, tmp_path).stdout)
    # a file without :RUN takes the other side's run name
    assert doc["runs"] == [f"{tmp_path / 'one.h5'}:B", f"{tmp_path / 'two.h5'}:B"]
    assert doc["identical"] is True  # same machine, same plan
    bad_cli(["compare", str(tmp_path / "one.h5:Z"), str(tmp_path / "two.h5")], cli_env, tmp_path, "Z", warm=True)


def test_parse_levels_and_checks():
    assert parse_levels(None) == list(range(8)) and parse_levels("2, 0") == [0, 2]
    with pytest.raises(TracerError):
        parse_levels("8")
    keys = [c.key for c in checks(100)]
    assert len(keys) == len(set(keys)) and {c.level for c in checks(100)} == set(range(8))


def test_audit_result_lines_count_flips_in_words():
    """The audit printed `0 argmax flip(s)`: a failed check's line says `no argmax flips`, `1 argmax
    flip` or `3 argmax flips`, and so does the hierarchy table's summary."""
    import io

    from rich.console import Console

    from tracer.loops.audit import Audit, AuditRow, result_line
    from tracer.plan.hierarchy import Check
    from tracer.report.render import render

    check = Check("L1-batch", 1, "batch", "batch of 4")
    rows = [AuditRow(check, "failed", last_layer=(3, 64), max_logit_diff=0.25, argmax_flips=n,
                     first_divergent="model.layers.1") for n in (0, 1, 3)]
    assert [result_line(r).split(", ", 1)[1] for r in rows] == [
        "no argmax flips (batch of 4)", "1 argmax flip (batch of 4)", "3 argmax flips (batch of 4)"]
    console = Console(file=io.StringIO(), width=200, record=True)
    render(Audit(model="m", facts={"dtype": "bfloat16", "device": "cpu", "n_tokens": 8}, rows=tuple(rows[:1])),
           "table", console)
    text = console.export_text()
    assert "from model.layers.1, no argmax flips" in text and "flip(s)" not in text, text


def test_a_level_named_twice_is_refused(tmp_path):
    """`tracer audit -l 0,0` ran one check where two were asked for, and said nothing: a level named
    twice is one line, exit 2, before any model loads, naming the levels to give."""
    from tests.helpers import cli_batch

    with pytest.raises(TracerError, match=r"^--levels '2,0,2' names level 2 more than once .*; give --levels 0,2$"):
        parse_levels("2,0,2")
    (code, err), = cli_batch([["audit", "tiny-llama", "-l", "0,0"]], tmp_path)
    assert code == 2 and err.strip() == ("error: --levels '0,0' names level 0 more than once (each level runs once); "
                                         "give --levels 0"), err


def test_the_audit_table_keeps_the_check_readable_at_80_columns_and_counts_in_words():
    """At 80 columns the check column was 5 characters ("the / same / call / twice", a word a line)
    while the first-divergent column, holding "-", kept 32 for its header; and one check read
    "1 checks: 1 hold bitwise". Now the check's column is 16 wide (or its longest label), so a
    label takes two or three lines at 80 columns, and the counts agree with their nouns."""
    import io
    import re

    from rich.console import Console

    from tracer.loops.audit import Audit, AuditRow
    from tracer.plan.hierarchy import Check
    from tracer.report.render import render

    labels = ["the same call twice", "alone vs one row of a left-padded batch"]
    rows = tuple(AuditRow(Check(f"L{i}-x", i, "x", label), "passed", last_layer=(0, 64), max_logit_diff=0.0,
                          argmax_flips=0, first_divergent="model.layers.3.self_attn.kv_cache")
                 for i, label in enumerate(labels))
    for n in (1, 2):
        out = io.StringIO()
        render(Audit(model="m", facts={"dtype": "bfloat16", "device": "cpu", "n_tokens": 8}, rows=rows[:n]), "table",
               Console(file=out, width=80, force_terminal=True, color_system=None))
        text = out.getvalue()
        assert max(len(line) for line in text.splitlines()) <= 80
        cells: list[list[str]] = []  # per row, the check cell's lines
        for line in (x for x in text.splitlines() if x.startswith("│")):
            level, check = line.split("│")[1].strip(), line.split("│")[2].strip()
            if level:
                cells.append([])
            if check:
                cells[-1].append(check)
        assert [" ".join(c) for c in cells] == labels[:n]  # whole words, in order
        assert all(len(c) <= 3 for c in cells), cells  # was a word a line
        summary = re.findall(r"^\d+ checks?: .*$", text, re.M)
        expected = "1 check: 1 holds bitwise" if n == 1 else "2 checks: 2 hold bitwise"
        assert summary and all(s.startswith(expected) for s in summary), summary


def test_the_audit_table_prints_a_skip_reason_s_brackets():
    """A skipped check's reason "pip install -e '.[vllm]'" read "-e '.'" in the table: rich took
    "[vllm]" for a style tag and dropped it. The cells are plain text now."""
    import io

    from rich.console import Console

    from tracer.loops.audit import Audit, AuditRow
    from tracer.plan.hierarchy import Check
    from tracer.report.render import render

    reason = "vLLM is not installed: pip install -e '.[vllm]'"
    row = AuditRow(Check("L6-engine", 6, "x", "HF vs vLLM"), "skipped", reason=reason)
    out = io.StringIO()
    render(Audit(model="m", facts={"dtype": "bfloat16", "device": "cpu", "n_tokens": 8}, rows=(row,)), "table",
           Console(file=out, width=200, force_terminal=True, color_system=None))
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    assert rows and all("'.[vllm]'" in line for line in rows), out.getvalue()
