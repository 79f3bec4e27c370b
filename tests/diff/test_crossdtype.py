"""Issue 24 item 1: two runs that hold a capture point in different dtypes are compared honestly:
values in the wider dtype, ULPs in the coarser, representability reported; never refused, never
silently cast. Expected numbers come from plain numpy/math on the same values (not from tracer)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import tracer
from tracer.diff.compare import compare_pairs
from tracer.diff.compare_dump import compare_dump
from tracer.load.models import load_model
from tracer.engines.dumps.sglang_writer import write_sglang_dump

N, P = 24, 20


def _bf16_ulp(x: float) -> float:
    """bf16 spacing at |x| (7 explicit mantissa bits; subnormal spacing 2**-133), by math.frexp."""
    ax = abs(x)
    if ax == 0:
        return 2.0 ** -133
    _m, e = math.frexp(ax)  # ax = m * 2**e, m in [0.5, 1)
    return 2.0 ** (max(e - 1, -126) - 7)


def _pair(seed: int = 0):
    """A bf16 reference and a float32 'engine' side: exact up-casts, values within half a bf16 ULP
    (round to A), and a few one ULP away."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    b = a.float().clone()
    ulp = torch.tensor([[_bf16_ulp(v) for v in row] for row in a.float().tolist()])
    b[1] += 0.25 * ulp[1]          # inexact in bf16, rounds back to A
    b[2, :4] += ulp[2, :4]         # exactly one bf16 ULP away: representable, differs after rounding
    b[3, :3] += 0.75 * ulp[3, :3]  # inexact, rounds to the next bf16 value
    return a, b


def _oracle(a: torch.Tensor, b: torch.Tensor) -> dict:
    an = a.float().numpy().astype(np.float64).ravel()
    bn = b.numpy().astype(np.float64).ravel()
    b_round = b.to(torch.bfloat16).float().numpy().astype(np.float64).ravel()
    return {
        "n_diff": int((an != bn).sum()),
        "n_inexact": int((b_round != bn).sum()),
        "n_diff_rounded": int((b_round != an).sum()),
        "max_abs": float(np.abs(an - bn).max()),
        "max_ulp_mag": max(abs(x - y) / _bf16_ulp(max(abs(x), abs(y))) for x, y in zip(an, bn)),
    }


def test_bf16_vs_float32_is_compared_in_float32_with_ulps_in_bf16():
    a, b = _pair()
    want = _oracle(a, b)
    c = compare_pairs(iter([("x", "linear", "Linear", a, b, [], [])]), scenario="s", model="m", positions=(0, 6))
    p = c.points[0]
    assert p.cross_dtype is not None
    x = p.cross_dtype
    assert (x.dtype_a, x.dtype_b, x.compared_in, x.ulps_in) == ("bfloat16", "float32", "float32", "bfloat16")
    assert p.diff.n_diff == want["n_diff"] and x.n_inexact == want["n_inexact"]
    assert x.n_diff_rounded == want["n_diff_rounded"]
    assert p.diff.max_abs_diff == want["max_abs"]
    assert p.diff.max_ulp_mag == pytest.approx(want["max_ulp_mag"], rel=1e-12)
    assert p.diff.max_ulp == 1  # after rounding, the farthest element is one bf16 step away
    # said in the header, the verdict and the table
    assert any("values compared in float32" in n and "ULPs in bfloat16" in n for n in c.facts["notes"])
    assert "values compared in float32" in c.verdict() and "not exactly representable in bfloat16" in c.verdict()
    from tracer.report.tables import rows, to_markdown

    assert "values compared in float32" in rows(c)[0]["cross_dtype"]
    assert "[in float32; A is bfloat16, B float32; ULP* in bfloat16]" in to_markdown(c)


def test_exact_up_cast_is_identical_values_not_bit_identical():
    a = torch.randn(4, 16).to(torch.bfloat16)
    c = compare_pairs(iter([("x", "linear", "Linear", a, a.float(), [], [])]), scenario="s", model="m", positions=(0, 4))
    assert c.identical and c.points[0].cross_dtype.n_inexact == 0
    assert c.verdict().startswith("identical values") and "bit-identical" not in c.verdict()
    assert "B exactly representable in bfloat16" in c.verdict()


def test_cross_dtype_logits_in_memory_and_streamed_from_two_traces(tmp_path):
    """The logits point of two stored runs of different dtypes streams in row blocks like any other."""
    from tracer.execute.records import CaptureRecord, RunRecord
    from tracer.store.trace import TraceWriter

    a, b = _pair(1)
    want = _oracle(a, b)
    calls = [{"positions": [0, 6], "in": [[1, 6, 32]], "out": [1, 6, 32]}]

    def run(name, t, path):
        rec = RunRecord(name=name, token_ids=list(range(6)), plan={}, window=(0, 6),
                        captures={"lm_head": CaptureRecord(name="lm_head", kind="logits", tensor=t, op="Linear", calls=calls)},
                        meta={})
        with TraceWriter(path, header={}) as w:
            w.add_run(rec)

    run("A", a, tmp_path / "a.h5")
    run("B", b, tmp_path / "b.h5")
    c = tracer.compare(f"{tmp_path / 'a.h5'}:A", f"{tmp_path / 'b.h5'}:B", device="cpu")
    x = c.logits_cross_dtype
    assert x is not None and c.logits.tensor.n_diff == want["n_diff"] and x.n_inexact == want["n_inexact"]
    assert x.n_diff_rounded == want["n_diff_rounded"]
    assert c.logits.tensor.max_ulp_mag == pytest.approx(want["max_ulp_mag"], rel=1e-12)
    # the argmax of A and of B agree wherever B rounds to A: flips only where rounding moved a value
    ref_flips = int((a.float().argmax(-1) != b.argmax(-1)).sum())
    assert len(c.logits.argmax_flips) == ref_flips


# ---------------------------------------------------------------- the engine-dump round trip


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tiny = load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)
    path = tmp_path_factory.mktemp("ref") / "ref.h5"
    tracer.run("tiny-llama", loaded=tiny, length=N, split_at=P, granularity="sublayers", output=path, progress=False)
    return str(path)


def _float32_logits(dump: Path, f) -> None:
    for path in sorted(dump.glob("*next_token_logits*")):
        data = torch.load(path, weights_only=True)
        data["value"] = f(data["value"])
        torch.save(data, path)


def test_engine_dump_with_float32_logits_round_trips(ref, tmp_path):
    """SGLang's LogitsProcessor returns float32 logits: a dump of the HF run in SGLang's format with
    its logits up-cast to float32 compares (it was refused with exit 2): every mapped layer is
    bit-identical, the logits are equal in value and exactly representable in bf16."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)
    _float32_logits(dump, lambda v: v.float())
    c = compare_dump((ref, "B"), str(dump))
    assert c.identical
    line = next(n for n in c.facts["notes"] if n.startswith("lm_head (logits)"))
    assert ": 0 / 512 differ" in line and "values compared in float32" in line
    assert "the engine exactly representable in bfloat16" in line


def test_engine_dump_with_float32_logits_computed_in_float32(ref, tmp_path):
    """Logits the engine computed in float32 (not bf16 values): counted, not refused; the numbers
    are checked against numpy on the same rows."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)
    g = torch.Generator().manual_seed(3)
    noise = {}

    def f(v):
        n = noise.setdefault("n", torch.rand(v.shape, generator=g) * 1e-3)
        return v.float() + n

    _float32_logits(dump, f)
    c = compare_dump((ref, "B"), str(dump))
    with tracer.read_trace(ref) as r:
        a = r.tensor("B", "lm_head")[-1:]
    b = a.float() + noise["n"]
    want = _oracle(a, b)
    line = next(n for n in c.facts["notes"] if n.startswith("lm_head (logits)"))
    assert f": {want['n_diff']} / 512 differ" in line
    assert f"not exactly representable in bfloat16 at {want['n_inexact']:,} element" in line
    assert f"{want['n_diff_rounded']:,} differ after rounding both to bfloat16" in line
