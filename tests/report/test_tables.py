"""The report's metric columns against independent numpy computations."""

from __future__ import annotations

import csv
import functools
import io
import json
import re

import numpy as np
import pytest
import torch

from tests.helpers import run_record
from tracer.diff.compare import compare_records
from tracer.errors import TracerError
from tracer.diff.batch import count_outside_tolerance, tensor_diff
from tracer.diff.metrics import ulp_of
from tracer.report.render import render
from tracer.report.tables import check_columns, rows, to_csv, to_markdown


def _bf16_spacing(x: np.ndarray) -> np.ndarray:
    """Spacing of bfloat16 at |x|: float32's spacing times 2**16 (bf16 keeps 7 of float32's 23
    mantissa bits, same exponent range, so normals and subnormals scale alike)."""
    return np.spacing(np.abs(x).astype(np.float32)).astype(np.float64) * 2.0**16


def test_ulp_of_matches_numpy_spacing():
    xs = np.array([0.0, 1.0, 1.5, 2.0, 3.0, 1e-5, -1e-5, 1e-38, 1e-40, 6.0e-39, 1e38], dtype=np.float32)
    got32 = ulp_of(torch.from_numpy(xs), torch.float32).numpy()
    assert np.array_equal(got32, np.spacing(np.abs(xs)).astype(np.float64))
    got64 = ulp_of(torch.from_numpy(xs.astype(np.float64)), torch.float64).numpy()
    assert np.array_equal(got64, np.spacing(np.abs(xs.astype(np.float64))))
    bf = torch.from_numpy(xs).to(torch.bfloat16)
    got16 = ulp_of(bf, torch.bfloat16).numpy()
    assert np.array_equal(got16, _bf16_spacing(bf.float().numpy()))


def test_max_ulp_mag_across_zero_and_subnormals():
    a = torch.tensor([-1e-5, 1.0, 2**-130, 0.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([1e-5, 1.0, -(2**-130), 0.0, 1.0078125], dtype=torch.bfloat16)
    d = tensor_diff(a, b)
    a64, b64 = a.double().numpy(), b.double().numpy()
    want = np.abs(a64 - b64) / _bf16_spacing(np.maximum(np.abs(a64), np.abs(b64)))
    assert d.max_ulp_mag == pytest.approx(float(want.max()))
    # -1e-5 vs +1e-5: |a-b| = 2|a| = 2 * 168 ulps of the magnitude, whatever the bit-line distance
    assert want[0] == pytest.approx(2 * abs(a64[0]) / _bf16_spacing(np.array([a64[0]]))[0])
    assert d.max_ulp > 20000  # the integer line distance crosses every pattern near zero


def test_count_outside_tolerance_matches_numpy():
    g = np.random.default_rng(0)
    a = g.standard_normal(1000).astype(np.float32)
    b = a + g.standard_normal(1000).astype(np.float32) * 1e-3
    b[7] = np.nan
    for atol, rtol in ((0.0, 0.0), (1e-3, 0.0), (0.0, 1e-2), (5e-4, 5e-3)):
        want = int(np.sum(~(np.abs(a.astype(np.float64) - b) <= atol + rtol * np.abs(a.astype(np.float64)))))
        assert count_outside_tolerance(torch.from_numpy(a), torch.from_numpy(b), atol, rtol) == want


_rec = functools.partial(run_record, ids=tuple(range(6)), window=(2, 6))


def _pair():
    g = torch.Generator().manual_seed(1)
    t = {n: torch.randn(4, 16, generator=g).to(torch.bfloat16) for n in ("emb", "l0", "l1", "norm")}
    logits = torch.randn(4, 32, generator=g).to(torch.bfloat16)
    ta = [("emb", "embedding", t["emb"]), ("m.layers.0", "layer", t["l0"]), ("m.layers.1", "layer", t["l1"]),
          ("norm", "final_norm", t["norm"]), ("head", "logits", logits)]
    tb = []
    for n, k, x in ta:
        y = x.clone()
        if n == "m.layers.0":
            y[1, 2] = -y[1, 2]
        if n in ("m.layers.1", "norm", "head"):
            y = (y.float() + torch.randn(y.shape, generator=g) * 0.05).to(torch.bfloat16)
        if n == "m.layers.1":
            y[0, 0] = float("nan")
        tb.append((n, k, y))
    return _rec("A", ta), _rec("B", tb)


def _np_metrics(a: torch.Tensor, b: torch.Tensor) -> dict:
    x, y = a.double().numpy().ravel(), b.double().numpy().ravel()
    fin = np.isfinite(x) & np.isfinite(y)
    xf, yf = x[fin], y[fin]
    dd = xf - yf
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(x - y) / np.abs(x)
    eq = a.view(torch.int16).numpy().ravel() == b.view(torch.int16).numpy().ravel()
    return {
        "rel_error": np.linalg.norm(dd) / np.linalg.norm(xf),
        "cosine": float(xf @ yf / (np.linalg.norm(xf) * np.linalg.norm(yf))),
        "sqnr_db": 10 * np.log10(np.sum(xf**2) / np.sum(dd**2)),
        "frac_rel_lt_1e3": float(np.mean(eq | (rel < 1e-3))),
        "frac_rel_lt_5e3": float(np.mean(eq | (rel < 5e-3))),
        "max_abs_diff": float(np.max(np.where(eq, 0, np.nan_to_num(np.abs(x - y), nan=np.inf)))),
        "n_nan_b": int(np.isnan(y).sum()),
    }


def test_report_rows_against_numpy():
    a, b = _pair()
    c = compare_records(a, b, scenario="s", model="m", atol=0.01, rtol=0.0)
    r = {row["name"]: row for row in rows(c)}
    for name in ("m.layers.0", "m.layers.1", "norm"):
        want = _np_metrics(a.captures[name].tensor, b.captures[name].tensor)
        for key, w in want.items():
            assert r[name][key] == pytest.approx(w, rel=1e-9), (name, key)
    # the sign flip of one element in layer 0: cosine/SQNR from numpy above; histogram: one element > 16
    assert r["m.layers.0"]["ulp_gt16"] == 1 and r["m.layers.0"]["ulp_0"] == 63
    # growth: layer 1's max abs diff over layer 0's (same point, previous layer); inf with a NaN
    assert r["m.layers.1"]["growth"] == float("inf") and r["m.layers.0"]["growth"] is None
    # tolerance counts against numpy
    for name in ("m.layers.1", "norm"):
        x, y = a.captures[name].tensor.double().numpy(), b.captures[name].tensor.double().numpy()
        assert r[name]["n_outside_tol"] == int(np.sum(~(np.abs(x - y) <= 0.01)))
    # logits: KL(A||B) per position, top-5 overlap, rank of A's top token in B, against numpy
    la, lb = a.captures["head"].tensor.double().numpy(), b.captures["head"].tensor.double().numpy()
    pa = np.exp(la - la.max(1, keepdims=True))
    pa /= pa.sum(1, keepdims=True)
    pb = np.exp(lb - lb.max(1, keepdims=True))
    pb /= pb.sum(1, keepdims=True)
    kl = np.sum(pa * (np.log(pa) - np.log(pb)), axis=1)
    assert c.logits.kl_mean == pytest.approx(kl.mean(), rel=1e-9) and c.logits.kl_max == pytest.approx(kl.max(), rel=1e-9)
    top5 = np.mean([len(set(np.argsort(-la[i])[:5]) & set(np.argsort(-lb[i])[:5])) / 5 for i in range(4)])
    assert c.logits.top5_overlap == pytest.approx(top5)
    ranks = [int(np.sum(lb[i] > lb[i, np.argmax(la[i])])) for i in range(4)]
    assert c.logits.rank_of_a_top_in_b_max == max(ranks)


def test_every_format_carries_every_metric():
    a, b = _pair()
    c = compare_records(a, b, scenario="s", model="m")
    doc = json.loads(json.dumps(c.to_dict(), default=str))
    keys = {"max_ulp", "max_ulp_mag", "ulp_hist", "rel_error", "cosine", "sqnr_db", "frac_rel_lt_1e3",
            "frac_rel_lt_5e3", "n_nan_a", "n_nan_b", "n_inf_a", "n_inf_b", "growth", "origin"}
    assert keys <= set(doc["layers"][0])
    header = next(csv.reader(io.StringIO(to_csv(c))))
    assert {"max_ulp_mag", "ulp_gt16", "sqnr_db", "cosine", "frac_rel_lt_5e3", "growth", "origin"} <= set(header)
    md = to_markdown(c)
    assert "SQNR dB" in md and "<5‰" in md and "origin" in md


def test_columns_option():
    assert check_columns(None) == ("point", "diff", "max_abs", "ulp", "hist", "rel", "growth", "flips")
    assert check_columns("sqnr,cos") == ("point", "sqnr", "cos")
    assert len(check_columns(None, wide=True)) > 10
    with pytest.raises(TracerError, match="unknown column 'bogus'"):
        check_columns("diff,bogus")


def test_table_marks_origin_rows():
    from rich.console import Console

    a, b = _pair()
    c = compare_records(a, b, scenario="s", model="m")
    con = Console(width=200, record=True, no_color=True)
    render(c, "table", con)
    out = con.export_text()
    assert "origin:" in out  # the headline block names the origin above the table
    assert "m.layers.0  ◀ origin" in out
    assert out.index("origin:") < out.index("capture point")


def test_an_identical_comparison_names_no_origin_in_its_caption():
    """Bit-identical runs: the rows kept are the first point, the last layer, the final norm and the
    logits; the caption said "the origin, rows where the differing count changes", which do not exist."""
    import io

    from rich.console import Console

    from tests.helpers import make_runs
    from tracer.diff.compare import compare_records
    from tracer.report.render import render

    a, b = make_runs(diverge_at=None)
    c = compare_records(a, b, scenario="s", model="m")
    assert c.identical
    out = io.StringIO()
    render(c, "table", Console(file=out, width=120, height=12, no_color=True))
    caption = [line for line in out.getvalue().splitlines() if " rows: " in line]
    assert caption and "origin" not in caption[0] and caption[0].endswith("(--all-rows prints all)"), out.getvalue()


def test_flip_lines_show_the_decoded_tokens_and_a_tie():
    """An argmax flip was shown as two token ids: the table's flip line and the logits line name the
    decoded text too (quoted, escaped, shortened), and a run whose top two logits tie says so."""
    from dataclasses import replace

    from tracer.diff.logits import with_token_texts

    logits_a = torch.tensor([[0.0, 2.0, 1.0, 0.5], [3.0, 0.0, 3.0, 1.0]], dtype=torch.float32)  # row 1: a tie, 0 wins
    logits_b = torch.tensor([[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 3.0, 1.0]], dtype=torch.float32)
    emb = torch.zeros(2, 8)
    rec = functools.partial(run_record, ids=(7, 8, 9, 10), window=(2, 4))
    c = compare_records(rec("A", [("emb", "embedding", emb), ("head", "logits", logits_a)]),
                        rec("B", [("emb", "embedding", emb), ("head", "logits", logits_b)]), scenario="repeat", model="m")
    words = {0: "\n\n", 1: " the", 2: "x" * 40, 3: "[/bold]"}
    c = replace(c, logits=with_token_texts(c.logits, lambda t: words[t]))
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    render(c, "table", console)
    text = console.export_text()
    lines = [" ".join(x.split()) for x in text.splitlines()]
    assert "position 2: top-1 token 1 ' the' in A, 2 'xxxxxxxxxxxxxxx…' in B (top-2 margin 1 in A, 1 in B)" in lines, text
    tie = next(x for x in lines if x.startswith("position 3:"))
    assert tie.startswith("position 3: top-1 token 0 '\\n\\n' in A, 2 'xxxxxxxxxxxxxxx…' in B (top-2 margin 0 in A, 1 in B; "
                          "top two a tie in A"), tie
    assert "first flip at position 2 (token 1 ' the' in A, 2 'xxxxxxxxxxxxxxx…' in B)" in " ".join(lines)


def _alternating_runs(n_layers: int):
    """Runs A/B: an embedding, ``n_layers`` layers whose differing count alternates 1, 8, 1, 8, ...
    (each a ×8 change from the row before: every layer is a row that matters) and logits."""
    g = torch.Generator().manual_seed(0)
    tensors = [("model.embed_tokens", "embedding", torch.randn(2, 64, generator=g))]
    tensors += [(f"model.layers.{i}", "layer", torch.randn(2, 64, generator=g)) for i in range(n_layers)]
    tensors.append(("lm_head", "logits", torch.randn(2, 16, generator=g)))
    b = []
    for i, (name, kind, t) in enumerate(tensors):
        t = t.clone()
        if kind == "layer":
            t.view(-1)[:1 if (i - 1) % 2 == 0 else 8] += 1.0
        b.append((name, kind, t))
    return run_record("A", tensors), run_record("B", b)


def _shown(c, console) -> tuple[list[str], str]:
    out = console.file
    render(c, "table", console)
    text = out.getvalue()
    return [ln for ln in text.splitlines() if "model.layers." in ln and "│" in ln], text


def test_the_table_keeps_its_rows_in_a_short_terminal():
    """A pseudo-terminal of 24 rows showed 8 rows, dropping layers whose differing count changed ×8
    that the caption says are kept; piped, the same comparison showed them all."""
    from rich.console import Console

    c = compare_records(*_alternating_runs(10), scenario="s", model="m")
    short, text = _shown(c, Console(file=io.StringIO(), width=80, height=24, force_terminal=True, no_color=True))
    tall, _ = _shown(c, Console(file=io.StringIO(), width=80, height=200, no_color=True))
    assert len(short) == len(tall) == 10, text  # every layer changes ×8: all 10 are rows that matter
    assert all(len(re.sub(r"\x1b\[[0-9;]*m", "", ln)) <= 80 for ln in text.splitlines())


def test_the_caption_counts_the_rows_that_matter_it_leaves_out():
    """More rows that matter than the table holds: the caption says how many it left out."""
    from rich.console import Console

    from tracer.report.tables import MAX_ROWS

    n_layers = 20  # rows that matter: the embedding, 20 layers, the logits
    c = compare_records(*_alternating_runs(n_layers), scenario="s", model="m")
    _, text = _shown(c, Console(file=io.StringIO(), width=80, height=200, no_color=True))
    flat = " ".join(text.split())
    assert f"{n_layers + 2 - MAX_ROWS} more such rows" in flat, text
