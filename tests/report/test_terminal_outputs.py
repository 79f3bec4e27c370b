"""Issue 24 item 9: outputs are checked before the work starts; a write failure after the run still
prints the run's result, then one line; strings reaching matplotlib are shown as given (no mathtext)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracer.errors import TracerError


def _tracer(args, cli_env, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "tracer", *args], capture_output=True, text=True, env=cli_env, cwd=cwd,
                          timeout=300, **kw)


def test_report_in_procfs_is_refused_before_the_model_loads(tmp_path, cli_env):
    """/proc/self/x.html gave exit 3 after the run (the report is written last)."""
    p = _tracer(["run", "tiny-llama", "--length", "24", "--report", "/proc/self/x.html"], cli_env, tmp_path)
    assert p.returncode == 2 and "kernel pseudo-filesystem" in p.stderr, p.stderr
    assert "load" not in p.stderr.split("error:")[0], p.stderr  # nothing was loaded before the refusal
    assert len(p.stderr.strip().splitlines()) == 1


def test_figure_report_and_outdir_paths_are_checked_by_the_same_gate(monkeypatch):
    """audit/sweep --report, sweep --plot and bench --outdir: refused before anything loads (the
    model loader is replaced by one that fails the test)."""
    from tracer import pipeline
    from tracer.loops.bench import bench
    from tracer.report.html import check_report_path
    from tracer.report.plot import check_figure_path

    monkeypatch.setattr(pipeline, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    for check, path in ((check_report_path, "/proc/self/x.html"), (check_figure_path, "/proc/self/x.png")):
        with pytest.raises(TracerError, match="kernel pseudo-filesystem"):
            check(path)
    with pytest.raises(TracerError, match="kernel pseudo-filesystem"):
        bench("tiny-llama", outdir="/proc/self/bench")


def test_plot_output_in_procfs_is_refused_before_reading(tmp_path):
    import tracer
    from tracer.execute.records import CaptureRecord, RunRecord
    from tracer.store.trace import TraceWriter

    cap = CaptureRecord(name="model.layers.0", kind="layer", tensor=torch.zeros(2, 4), op="X")
    with TraceWriter(tmp_path / "t.h5", header={}) as w:
        for name in "AB":
            w.add_run(RunRecord(name=name, token_ids=[1, 2], plan={}, window=(0, 2), captures={cap.name: cap}, meta={}))
    with pytest.raises(TracerError, match="kernel pseudo-filesystem"):
        tracer.plot_file(str(tmp_path / "t.h5"), output="/proc/self/x.png")


def test_a_report_write_failure_after_the_run_still_prints_the_result(tmp_path, cli_env):
    """A full disk while writing --report: the table comes first, then one line, exit 2 (it was exit 3
    and the table was never printed, because the report was written first)."""
    limit = 4096  # ulimit -f: the report (tens of kB) cannot be written; the run writes nothing else

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = _tracer(["run", "tiny-llama", "--length", "24", "--store", "none", "--report", "r.html"], cli_env, tmp_path,
                preexec_fn=small_files)
    assert p.returncode == 2, p.stderr
    assert "verdict:" in p.stdout  # the result, printed before the failing write
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot write r.html: the file size limit was reached (ulimit -f)"), p.stderr
    assert list(tmp_path.iterdir()) == []  # the partial report was removed


def test_dollar_signs_in_names_are_drawn_as_text(tmp_path):
    """A model folder named m$\\foo$: matplotlib parsed the title as mathtext and failed after the run."""
    from tracer.diff.compare import compare_pairs
    from tracer.report.figures.amplification import amplification_figure
    from tracer.report.plot import save_figure

    a = torch.randn(4, 8)
    b = a.clone()
    b[1, 2] += 1
    pairs = [(r"model.layers.0$\foo$", "layer", "X", a, b, [], []), ("lm_head", "logits", "L", a, b, [], [])]
    c = compare_pairs(iter(pairs), scenario="prefix-cache", model=r"m$\foo$", positions=(0, 4))
    fig = amplification_figure(c)
    texts = [t.get_text() for ax in fig.axes for t in (ax.title, *ax.get_xticklabels())] + [fig._suptitle.get_text()]
    assert any(r"m$\foo$" in t for t in texts) and any(r"layers.0$\foo$" in t for t in texts)
    save_figure(fig, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
