"""The amplification table at 80, 120 and 200 columns: every kept number whole, columns dropped by
priority (histogram and kernels first), long names shortened from the left, at most 15 rows.

Expected cells come from the planted tensors (torch on the raw data), never from the code under test.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console

from tracer.diff.compare import compare_records
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.report.layout import NAME_FLOOR, fit_columns, name_cell, piped_width, shorten_left, table_width
from tracer.report.render import render

WINDOW = (4, 8)  # 4 compared positions
WIDTH = 25_000   # features per position: totals of 100,000 elements
N_LAYERS = 12
KERNELS_A = {"ops": [{"name": "aten::addmm", "count": 1}], "device": []}
KERNELS_B = {"ops": [{"name": "aten::mm", "count": 2}, {"name": "aten::add", "count": 2}], "device": []}


def _bump(t: torch.Tensor, n: int, ulps: int) -> torch.Tensor:
    """``t`` with its first ``n`` elements moved ``ulps`` bf16 ULPs up (they hold 1.0: 1 ULP = 2**-7)."""
    t = t.clone()
    flat = t.view(-1).view(torch.int16)
    flat[:n] += ulps
    return t


def _planted(kernels: bool = False, layers: int = N_LAYERS):
    """Per layer ``i`` an ``o_proj`` (long name) and the layer output; from layer 3 on, ``10 * 2**(i-3)``
    elements differ by ``i - 1`` ULPs (capped at the tensor size); the logits flip at one position.
    Returns the comparison and, per row name, the expected (n_diff, n_total, max |Δ|, max ULP)."""
    g = torch.Generator().manual_seed(0)
    names, kinds, ta, tb, expect = [], [], [], [], {}

    def add(name, kind, a, b):
        names.append(name), kinds.append(kind), ta.append(a), tb.append(b)
        differ = a.view(torch.int16) != b.view(torch.int16)
        mad = float((a.double() - b.double()).abs().max())
        # ULPs of the larger magnitude, for the planted 1.0 + k * 2**-7 values: |Δ| / 2**-7
        expect[name] = (int(differ.sum()), a.numel(), mad, round(mad / 2 ** -7))

    emb = torch.ones(4, WIDTH, dtype=torch.bfloat16)
    add("model.embed_tokens", "embedding", emb, emb.clone())
    for i in range(layers):
        base = torch.ones(4, WIDTH, dtype=torch.bfloat16)
        n = 0 if i < 3 else min(10 * 2 ** (i - 3), base.numel())
        for name, kind in ((f"model.layers.{i}.self_attn.o_proj", "linear"), (f"model.layers.{i}", "layer")):
            add(name, kind, base, _bump(base, n, i - 1) if n else base.clone())
    add("model.norm", "final_norm", torch.ones(4, WIDTH, dtype=torch.bfloat16), torch.ones(4, WIDTH, dtype=torch.bfloat16))
    logits_a = torch.randn(4, 50_000, generator=g).to(torch.bfloat16)
    logits_b = logits_a.clone()
    logits_b[2, 7] = logits_a[2].max() + 1  # position 6: argmax flips
    names.append("lm_head"), kinds.append("logits"), ta.append(logits_a), tb.append(logits_b)

    def run(name, tensors, kern):
        calls = [{"positions": [0, 8], "in": [[1, 8, 64]], "out": [[1, 8, 64]], **({"kernels": kern} if kernels else {})}]
        caps = {n: CaptureRecord(name=n, kind=k, tensor=t, calls=list(calls), op="X")
                for n, k, t in zip(names, kinds, tensors)}
        return RunRecord(name=name, token_ids=list(range(1, 9)), plan={"chunks": [[0, 8]]}, window=WINDOW, captures=caps)

    c = compare_records(run("A", ta, KERNELS_A), run("B", tb, KERNELS_B), scenario="prefix-cache", model="planted")
    flips = int((logits_a.float().argmax(-1) != logits_b.float().argmax(-1)).sum())
    differ = int((logits_a.view(torch.int16) != logits_b.view(torch.int16)).sum())
    mad = float((logits_a.double() - logits_b.double()).abs().max())
    return c, expect, (differ, logits_a.numel(), mad, flips)


def _render(c, width, **kw) -> str:
    out = io.StringIO()
    render(c, "table", Console(file=out, width=width, no_color=True, highlight=False), **kw)
    return out.getvalue()


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]


def _names(shown: str, name: str) -> bool:
    """The name cell shows ``name``: whole, shortened from the left (``…`` + a suffix of 20+ characters),
    or with the middle elided to keep the layer index beside a marker (``…layers.3…o_proj``)."""
    if shown == name or (shown.startswith("…") and len(shown) > 20 and name.endswith(shown[1:])):
        return True
    head, _, tail = shown[1:].partition("…")
    return shown.startswith("…") and bool(tail) and f".{head}." in f".{name}" and name.endswith("." + tail)


def _g(x: float) -> str:  # three significant digits, as printed for values in [1e-3, 1e4)
    return "0" if x == 0 else f"{x:.3g}"


@pytest.fixture(scope="module")
def planted():
    return _planted()


@pytest.mark.parametrize("width", [80, 120, 200])
def test_every_kept_number_is_whole(planted, width):
    c, expect, (l_diff, l_total, l_mad, l_flips) = planted
    text = _render(c, width, all_rows=True)
    lines = _table_lines(text)
    assert lines and all(len(line) <= width for line in lines), max(len(x) for x in lines)
    body = [line for line in lines if line.startswith("│")]
    for name, (n_diff, n_total, mad, ulp) in expect.items():
        cells = f"{n_diff:,} / {n_total:,}"
        rows = [line for line in body if _names(line.split("│")[1].strip().split("  ◀")[0], name)]
        assert len(rows) == 1, (name, width)
        for cell in (cells, _g(mad), str(ulp)):
            assert f" {cell} " in rows[0], (name, cell, rows[0])
    logits = [line for line in body if "lm_head (logits)" in line]
    assert len(logits) == 1 and f" {l_diff:,} / {l_total:,} " in logits[0] and f" {_g(l_mad)} " in logits[0]
    assert logits[0].rstrip(" │").endswith(f" {l_flips}")  # flips: the last column, at every width
    for line in body:  # no cell cut short with an ellipsis except names shortened from the left
        cells = [x.strip() for x in line.split("│")[2:-1]]
        assert not any("…" in x for x in cells), line


def test_priority_histogram_first_then_growth_and_rel(planted):
    c, _, _ = planted
    wide, mid, narrow = (_render(c, w, all_rows=True) for w in (200, 120, 80))
    assert "ULP histogram" in wide and "left out to fit" not in wide
    if "histogram" not in "\n".join(_table_lines(mid)):  # whatever is left out is named, the histogram first
        assert "left out to fit 120 columns: ULP histogram" in mid
    assert "rel err" in "\n".join(_table_lines(mid))  # kept at 120
    head80 = "\n".join(_table_lines(narrow))
    assert "histogram" not in head80 and "left out to fit 80 columns: ULP histogram" in narrow
    for kept in ("capture point", "differing / total", "flips"):
        assert kept in head80 or kept.split()[0] in head80
    # a full histogram cell, from the planted bumps: layer 11 moves 10 * 2**8 elements by 10 ULPs
    assert f" 9-16:{10 * 2 ** 8} " in wide


def test_origin_marker_is_never_cut_and_names_shorten_from_the_left():
    assert shorten_left("model.layers.3.self_attn.kv_cache", 28) == "…layers.3.self_attn.kv_cache"
    assert shorten_left("model.layers.3", 28) == "model.layers.3"
    # the marker stays beside a name shortened at dots that keeps its layer index
    assert name_cell("model.layers.3.self_attn.kv_cache", "  ◀ origin", 30) == "…layers.3…kv_cache  ◀ origin"
    assert name_cell("model.layers.3", "  ◀ origin", 30) == "model.layers.3  ◀ origin"
    # ... and goes to a line of its own where beside it the index would be lost
    cell = name_cell("model.layers.2.post_attention_layernorm", "  ◀ origin", 34)
    assert cell.splitlines() == ["…layers.2.post_attention_layernorm", "◀ origin"]
    assert name_cell("model.layers.3.self_attn.kv_cache", "  ◀ origin", 22).splitlines()[1] == "◀ origin"
    c, _, _ = _planted(layers=4)
    for width in (80, 120):
        text = _render(c, width, all_rows=True)
        assert "◀ origin" in text and "◀ origi\n" not in text


def test_a_dtype_note_never_takes_the_names_place():
    """At 80 columns the name cell showed "…h5:B bfloat16; ULP* in bfloat16]": the dtype note, appended
    to the name, was what survived the shortening. The name keeps its first line (shortened at a
    dot); a note follows on lines of its own, whole words, within the column."""
    note = " [in float32; run.h5:A is float32, run.h5:B bfloat16; ULP* in bfloat16]"
    cell = name_cell("model.layers.3.self_attn.kv_cache", "  ◀ origin", 35, note).splitlines()
    assert cell[0] == "…layers.3…kv_cache  ◀ origin" or cell[0].startswith("…layers.3.self_attn.kv_cache")
    assert all(len(line) <= 35 for line in cell)
    assert " ".join(cell[1:]).replace("◀ origin ", "") == note.strip()


def test_kernels_get_a_section_when_there_is_no_room():
    c, _, _ = _planted(kernels=True, layers=4)
    narrow = _render(c, 80, all_rows=True)
    assert "kernels (A vs B)" not in "\n".join(_table_lines(narrow))
    assert "kernels (A vs B), not enough width for a column:" in narrow
    section = narrow.split("kernels (A vs B), not enough width for a column:")[1]
    line = next(x for x in section.splitlines() if x.startswith("  model.layers.3.self_attn.o_proj: "))
    text = line.split(": ", 1)[1]
    assert "addmm" in text and "mm" in text.split(" vs ")[1]  # both runs' ops, as planted
    wide = _render(c, 400, all_rows=True)
    assert "kernels (A vs B)" in "\n".join(_table_lines(wide)) and "not enough width" not in wide
    row = next(x for x in _table_lines(wide) if "model.layers.3.self_attn.o_proj" in x)
    assert f" {text} " in row  # the section holds the same, whole text the column would


def test_at_most_fifteen_rows_by_default():
    c, _, _ = _planted(layers=40)  # 82 points of which 40 decoder layers
    text = _render(c, 120)
    body = [line for line in _table_lines(text) if line.startswith("│") and line.split("│")[1].strip()]
    assert len(body) <= 15
    m = re.search(r"(\d+) of (\d+) rows", text)
    assert m and int(m.group(1)) == len(body) <= 15 and int(m.group(2)) == 40 * 2 + 3


def test_points_not_compared_for_one_reason_are_one_row_by_default():
    """rollout-vs-train's trainer keeps no KV cache: each layer's kv_cache point is skipped (one reason). By
    default they are one row naming their pattern and count, within the 15 rows; --all-rows lists each."""
    from dataclasses import replace

    from tracer.diff.result import SkipRecord
    from tracer.execute.kinds import PointKind

    c, _, _ = _planted(layers=4)
    kv = [SkipRecord(f"model.layers.{i}.self_attn.kv_cache", PointKind.KV_CACHE, "no KV cache in run B (it keeps none)",
                     fails=False) for i in range(30)]
    missing = [SkipRecord("model.layers.2.mlp", PointKind.LAYER, "missing in run B")]  # another reason: its own row
    c = replace(c, skipped=tuple(kv + missing))
    text = _render(c, 120)
    body = [line for line in _table_lines(text) if line.startswith("│") and line.split("│")[1].strip()]
    kv_rows = [line for line in body if "kv_cache" in line]
    assert len(kv_rows) == 1 and "model.layers.*.self_attn.kv_cache ×30" in kv_rows[0]
    assert "(--all-rows lists each)" in text and "no KV cache in run B" in text
    assert sum("model.layers.2.mlp " in line for line in body) == 1 and "missing in run B" in text
    every = _render(c, 120, all_rows=True)
    assert all(f"model.layers.{i}.self_attn.kv_cache " in every for i in range(30)) and "×30" not in every


def test_fit_columns_keeps_the_core_and_drops_in_order():
    headers = {"point": "capture point", "diff": "differing / total", "max_abs": "max abs diff",
               "ulp": "max ULP*", "hist": "ULP histogram", "rel": "rel err", "flips": "flips"}
    cells = {"point": ["model.layers.12.self_attn.kv_cache"], "diff": ["401,460 / 491,520"], "max_abs": ["0.0312"],
             "ulp": ["503"], "hist": ["1:120764 2:70156 3-4:81252 5-8:58913 9-16:31259 >16:39116"],
             "rel": ["0.0149"], "flips": ["0"]}
    cols = tuple(headers)
    fit = fit_columns(cols, headers, cells, 200)
    assert fit.columns == cols and not fit.dropped and fit.width <= 200
    fit = fit_columns(cols, headers, cells, 80)
    assert fit.dropped[0] == "hist" and set(fit.columns) >= {"point", "diff", "max_abs", "ulp", "flips"}
    assert fit.width <= 80 and fit.width == table_width(list(fit.widths))
    widths = dict(zip(fit.columns, fit.widths))
    assert widths["diff"] >= len("401,460 / 491,520") and widths["max_abs"] >= len("0.0312")
    fit = fit_columns(cols, headers, cells, 20)  # too narrow even for the core: shown anyway, nothing cut
    assert set(fit.columns) == {"point", "diff", "max_abs", "ulp", "flips"} and fit.width > 20


def test_piped_width():
    assert piped_width({}) == 80 and piped_width({"COLUMNS": "90"}) == 90 and piped_width({"COLUMNS": "x"}) == 80


def test_a_new_format_is_refused_everywhere_until_every_result_has_a_writer(monkeypatch):
    """One list of formats for every result (the render door, tracer/report/render.py): a format
    added to FORMATS alone (the report-format row of docs/ARCHITECTURE.md) has no writer for any
    result kind, and every result kind has a writer for every listed format; `tracer audit -f` and
    `tracer run -f` check the same list before anything runs."""
    import pytest

    from tracer.errors import TracerError
    from tracer.report import layout
    from tracer.report.render import WRITERS
    from tracer.report.terminal import check_table

    assert all(set(writers) == set(layout.FORMATS) for writers in WRITERS.values()), WRITERS
    assert set(WRITERS) == {"comparison", "audit", "sweep", "bench"}
    with pytest.raises(TracerError, match="unknown format 'tsv'; use one of: table, json, csv, markdown"):
        check_table("tsv", audit=True)
    with pytest.raises(TracerError, match="unknown format 'tsv'; use one of: table, json, csv, markdown"):
        check_table("tsv")


def test_table_options_with_another_format_are_refused(tmp_path):
    """`tracer compare T --format json --wide` (or csv with --columns, markdown with --all-rows) printed
    exactly what the format prints without them: the option was dropped without a word."""
    from tests.helpers import cli_batch

    (tmp_path / "t.h5").write_bytes(b"")  # the options are checked before the trace is read
    cases = [["compare", "t.h5", "--format", "json", "--wide"], ["compare", "t.h5", "-f", "csv", "--columns", "diff"],
             ["run", "tiny-llama", "--format", "markdown", "--all-rows"], ["run", "tiny-llama", "-f", "json", "--wide"]]
    for args, (code, err) in zip(cases, cli_batch(cases, tmp_path)):
        flag, fmt = args[-1] if args[-1].startswith("--") else args[-2], args[3]
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {flag} ") and f"--format {fmt}" in err, \
            (args, code, err)


def test_kept_columns_fit_80_with_a_narrower_name():
    """`tracer run --positions all` at 80 columns: the logits' "5,293,056 / 15,433,728" made the kept columns
    81 wide with the name at NAME_MIN, and rich squeezed the table back to 80 by folding "flips" into
    "flip"/"s". The name narrows instead (shortened from the left); every other column keeps its width."""
    headers = {"point": "capture point", "diff": "differing / total", "max_abs": "max abs diff",
               "ulp": "max ULP*", "hist": "ULP histogram", "rel": "rel err", "flips": "flips"}
    cells = {"point": ["model.layers.12.self_attn.kv_cache"], "diff": ["5,293,056 / 15,433,728"],
             "max_abs": ["0.0312"], "ulp": ["503"], "hist": ["1:12 >16:391"], "rel": ["0.0149"], "flips": ["2"]}
    fit = fit_columns(tuple(headers), headers, cells, 80)
    widths = dict(zip(fit.columns, fit.widths))
    assert fit.width == 80 == table_width(list(fit.widths))
    assert widths["flips"] >= len("flips") and widths["diff"] >= len("5,293,056 / 15,433,728")
    assert NAME_FLOOR <= widths["point"] < 28
    # shortened from the left at a dot, never inside a word ("…ayers.3" was) and never to a bare index:
    # "…3.self_attn.kv_cache" could be layer 13 or 23; the index kept by eliding the middle where a
    # suffix would lose it (a newcomer at 80 columns saw six rows all named "…self_attn.kv_cache")
    assert shorten_left("model.layers.3.self_attn.kv_cache", 27) == "…layers.3…kv_cache"
    assert shorten_left("model.layers.12.self_attn.kv_cache", 28) == "…layers.12…kv_cache"
    assert shorten_left("model.layers.12.self_attn.kv_cache", 29) == "…layers.12.self_attn.kv_cache"
    assert shorten_left("model.layers.2.post_attention_layernorm", 30) == "…post_attention_layernorm"
    assert shorten_left("model.layers.*.self_attn.kv_cache ×30", 28) == "…self_attn.kv_cache ×30"


def test_a_table_wider_than_the_terminal_is_printed_whole(planted):
    """Narrower than the kept columns can go: the table is printed wider than the console (the terminal
    wraps it), never squeezed by rich: every row is as wide as the fitted table, the header "flips" and
    every number whole."""
    c, expect, (l_diff, l_total, _, l_flips) = planted
    text = _render(c, 40, all_rows=True)
    lines = [line for line in _table_lines(text) if line]
    assert len({len(line) for line in lines}) == 1 and len(lines[0]) > 40
    assert any(" flips " in line for line in lines if line.startswith("┃"))
    logits = [line for line in lines if "lm_head" in line]
    assert len(logits) == 1 and f" {l_diff:,} / {l_total:,} " in logits[0] and logits[0].rstrip(" │").endswith(f" {l_flips}")
    for name, (n_diff, n_total, _, _) in expect.items():
        assert any(f" {n_diff:,} / {n_total:,} " in line for line in lines), name


def test_headline_lines_hang_under_their_label_in_a_narrow_terminal(planted):
    """In an 80-column terminal a long headline line (origin: 300+ characters on real runs) breaks
    between words with its further lines indented under the text, not at column 0; piped to 80
    columns the same lines (plain); piped to a stderr console, one line per fact. The words are the
    same every way."""
    from tracer.report.summary import headline

    c, _, _ = planted
    import re

    out = io.StringIO()
    render(c, "table", Console(file=out, width=80, force_terminal=True, no_color=True, highlight=False), all_rows=True)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue()).split("\n\n")[0]  # bold stays on in a terminal
    piped = _render(c, 80, all_rows=True).split("\n\n")[0]
    head = headline(c, "run")
    indent = max(len(k) for k, _ in head) + 2
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert piped.splitlines() == text.splitlines()
    err = io.StringIO()
    render(c, "table", Console(file=err, width=80, stderr=True, no_color=True, highlight=False), all_rows=True)
    one = err.getvalue().split("\n\n")[0]
    assert len(one.splitlines()) == len(head)
    assert text.split() == one.split()  # only the line breaks differ
    for line in text.splitlines():
        assert line[:indent].strip() == "" or line.split(":")[0] in dict(head), line


def test_flips_give_way_before_a_name_loses_its_layer_index():
    """`tracer run --granularity sublayers` at 80 columns (a newcomer's report): the name column at 32
    showed "…post_attention_layernorm", no layer; the flips column ("-" on every layer row; the logits
    line says the flips) gives way instead, and the name keeps "layers.2". Where narrowing keeps every
    index (the middle elided), flips stays."""
    headers = {"point": "capture point", "diff": "differing / total", "max_abs": "max abs diff",
               "ulp": "max ULP*", "flips": "flips"}
    name = "model.layers.2.post_attention_layernorm"
    cells = {"point": ["model.embed_tokens", name, "…layers.3.self_attn.kv_cache"],
             "diff": ["0 / 576", "14 / 576", "45,752 / 49,152"], "max_abs": ["0", "9.77e-04", "0.281"],
             "ulp": ["0", "18", "455"], "flips": ["-", "-", "0"]}
    fit = fit_columns(tuple(headers), headers, cells, 80, name_min=34, spare=("flips",))
    widths = dict(zip(fit.columns, fit.widths))
    assert fit.dropped == ("flips",) and fit.width <= 80
    assert shorten_left(name, widths["point"]).endswith("layers.2.post_attention_layernorm")
    # the same table where narrowing keeps every layer index: the name narrows, flips stays
    cells["point"][1] = "model.layers.12.self_attn.kv_cache"
    fit = fit_columns(tuple(headers), headers, cells, 80, name_min=34, spare=("flips",))
    widths = dict(zip(fit.columns, fit.widths))
    assert "flips" in fit.columns and fit.width <= 80
    assert shorten_left("model.layers.12.self_attn.kv_cache", widths["point"]).startswith("…layers.12")
