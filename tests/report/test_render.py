"""tracer/report/render.py: one render door over every result type, in every format of one list."""

from __future__ import annotations

import csv
import io
import json

import pytest
from rich.console import Console

import tracer
from tests.helpers import make_runs
from tracer.diff.compare import compare_records
from tracer.errors import TracerError
from tracer.loops.audit import Audit, AuditRow
from tracer.loops.bench import MODES, BenchResult
from tracer.plan.hierarchy import Check
from tracer.report.layout import FORMATS
from tracer.report.render import WRITERS, kind_of, render
from tracer.store.sweepfile import SweepResult, SweepRow


def _results() -> dict[str, object]:
    a, b = make_runs()
    rows = [AuditRow(Check("L0-repeat", 0, "repeat", "repeat"), "passed", last_layer=(0, 64), max_logit_diff=0.0,
                     argmax_flips=0),
            AuditRow(Check("L1-batch", 1, "batch", "batch of 4"), "failed", last_layer=(3, 64), max_logit_diff=0.25,
                     argmax_flips=1, first_divergent="model.layers.1")]
    sweep = [SweepRow(length=n, block_size=16, split_at=16, n_positions=n - 16, first_divergent=1 if n == 18 else -1,
                      n_diff=(0, int(n == 18)), n_total=(8, 8), max_abs_diff=(0.0, 0.5 * (n == 18)),
                      last_layer_fraction=0.125 * (n == 18), logits_max_abs_diff=0.5 * (n == 18), argmax_flips=0)
             for n in (17, 18)]
    config = {"model": "m", "dtype": "bfloat16", "device": "cpu", "length": 32, "granularity": "layers",
              "n_points": 6, "reps": 3, "warmup": 1, "kv_cache": False}
    return {
        "comparison": compare_records(a, b, scenario="s", model="m"),
        "audit": Audit(model="m", facts={"dtype": "bfloat16", "device": "cpu", "n_tokens": 8}, rows=tuple(rows)),
        "sweep": SweepResult(params={"block_sizes": [16], "model": "m", "scenario": "s", "dtype": "bfloat16"},
                             points=["emb", "l0"], kinds=["embedding", "layer"], rows=sweep, complete=True),
        "bench": BenchResult(config=config, times={m: [0.1 * (i + 1), 0.11 * (i + 1)] for i, m in enumerate(MODES)},
                             trace_bytes=1 << 20, peak_host_mb=100.0),
    }


RESULTS = _results()


def test_every_result_kind_has_a_writer_for_every_format():
    assert set(WRITERS) == set(RESULTS)
    assert all(tuple(w) == FORMATS for w in WRITERS.values())


@pytest.mark.parametrize("kind", sorted(RESULTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_result_renders_in_every_format(kind, fmt):
    """Each writer gives its format: JSON that parses to the result's document (the comparison's and
    the audit's read back as the same result), CSV with a header row, markdown with a table, and a
    table printed (nothing returned)."""
    obj = RESULTS[kind]
    assert kind_of(obj) == kind
    out = io.StringIO()
    text = render(obj, fmt, Console(file=out, width=160, no_color=True))
    if fmt == "table":
        assert text is None and out.getvalue().strip()
        return
    assert text and not out.getvalue()
    if fmt == "json":
        doc = json.loads(text)
        if kind in ("comparison", "audit"):
            assert type(obj).from_dict(doc) == obj
    elif fmt == "csv":
        rows = list(csv.reader(io.StringIO(text)))
        assert len(rows) >= 2 and len(rows[0]) >= 2
    else:
        assert "|---|" in text


def test_a_run_result_renders_as_its_comparison(tmp_path):
    """tracer.render(result): the RunResult's comparison, as every command prints it."""
    c = RESULTS["comparison"]
    result = tracer.RunResult(comparison=c, scenario=None, trace=None, token_ids=[1, 2])
    assert tracer.render(result, "markdown") == render(c, "markdown") == result._repr_markdown_()


def test_what_is_not_a_result_is_refused_in_one_line():
    with pytest.raises(TracerError, match="cannot render a dict"):
        render({}, "json")
    with pytest.raises(TracerError, match="unknown format 'tsv'; use one of: table, json, csv, markdown"):
        render(RESULTS["sweep"], "tsv")


def _table(obj: object) -> str:
    out = io.StringIO()
    render(obj, "table", Console(file=out, width=200, color_system=None))
    return " ".join(out.getvalue().split())


def test_a_trace_only_read_is_not_said_written(tmp_path):
    """tracer.compare_trace(PATH) rendered as a table from Python is ``tracer compare``'s table: the
    trace was only read, so its line names the path alone; it said "(3.0 MiB; --no-store writes none)"
    (the run's line, render's default command), as if this call had written it."""
    import dataclasses

    path = tmp_path / "t.h5"
    path.write_bytes(b"\0" * (3 << 20))  # 3 MiB exactly
    c = dataclasses.replace(RESULTS["comparison"], trace=str(path))
    text = _table(c)
    assert f"trace: {path}" in text
    assert "MiB" not in text and "writes none" not in text


def test_a_run_rendered_from_python_names_the_keyword_that_writes_none(tmp_path):
    """tracer.render(tracer.run(...), "table") from Python: the trace line says how to write none as
    Python writes it, store="none" (it said --no-store, a flag of the tracer command, which tracer.run
    does not take), as tracer.audit's plan lines name keywords from Python."""
    path = tmp_path / "t.h5"
    path.write_bytes(b"\0" * 2048)  # 2 KiB exactly
    import dataclasses

    c = dataclasses.replace(RESULTS["comparison"], trace=str(path))
    text = _table(tracer.RunResult(comparison=c, scenario=None, trace=str(path), token_ids=[1, 2]))
    assert f'trace: {path} (2.0 KiB; store="none" writes none)' in text
