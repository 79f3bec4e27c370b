"""Hostile inputs found by a breaker session (issue 11/15 work): each gets a one-line TracerError
or a correct answer, never a traceback or a wrong result."""

from __future__ import annotations

import math
import subprocess
import sys

import h5py
import pytest

import tracer
from tracer.errors import TracerError
from tracer.store.budget import parse_size
from test_hostile import make_runs, write


def test_removing_the_checksums_attribute_is_caught(tmp_path):
    path = write(tmp_path / "t.h5", make_runs())
    with h5py.File(path, "r+") as f:
        del f.attrs["checksums"]  # not re-sealed: the root's crc32 still covers it
    with pytest.raises(TracerError, match="'checksums' is missing"):
        tracer.read_trace(str(path)).__enter__()


def test_huge_and_fractional_sizes_are_one_line_errors():
    for text in ("9" * 400, 10**30, "99999999999999999999TiB"):
        with pytest.raises(TracerError, match="more than"):
            parse_size(text)
    with pytest.raises(TracerError, match="under 1 byte"):
        parse_size("0.5")


@pytest.mark.parametrize("ids, message", [([1.9] * 8, "1.9"), ("1" * 8, "got str"), ({1: 1}, "got dict"),
                                          ([True] * 8, "True"), ([None] * 8, "None")])
def test_api_token_ids_must_be_ints(ids, message):
    with pytest.raises(TracerError, match=message):
        tracer.run("tiny-llama", token_ids=ids, store="none", progress=False)


def test_inf_difference_renders(tmp_path):
    from tracer.diff.compare import compare_records
    from tracer.report.summary import rows_that_matter

    a, b = make_runs(diverge_at="model.layers.0")
    b.captures["model.layers.1"].tensor[0, 0] = -math.inf  # an overflow in one layer
    c = compare_records(a, b, scenario="s", model="m")
    rows = rows_that_matter(c, limit=3)  # the table's row choice: no math domain error
    assert 0 in rows


def test_report_onto_the_trace_is_refused(tmp_path, cli_env):
    p = subprocess.run([sys.executable, "-m", "tracer", "run", "tiny-llama", "--length", "40", "-o", "r.html",
                        "--report", "r.html", "--overwrite"], capture_output=True, text=True, env=cli_env, cwd=tmp_path)
    assert p.returncode == 2 and "is the trace's --output too" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r.html").exists()


def test_empty_gguf_option_is_refused():
    with pytest.raises(TracerError, match="--gguf is empty"):
        tracer.load_model("smollm2-135m", gguf="")


def test_gguf_recipe_declares_its_architecture():
    from tracer.load.recipes import recipes

    table = recipes()
    assert table["smollm2-135m"].data["model_type"] == "llama"
    assert table["gemma3-270m"].data["model_type"] == "gemma3_text"
