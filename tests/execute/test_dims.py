"""Issue 24 item 2: SGLang's dims grammar (both generations), ``tp:partial`` sums, and capture-contract
differences (partial vs full sums) reported as such, never as a numeric divergence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracer
from tracer.diff.compare_dump import compare_dump, import_dump
from tracer.errors import TracerError
from tracer.execute.dims import parse_dims
from tracer.load.models import load_model
from tracer.engines.dumps.sglang_writer import write_sglang_dump

N, P = 24, 20
DOWN = "model.layers.1.mlp.down_proj"


# ---------------------------------------------------------------- the grammar (no model)


@pytest.mark.parametrize("dims, tp", [
    ("bs h[tp:partial]", (1, True)),
    ("h[tp]", (0, False)),
    ("t h(tp)", (1, False)),
    ("t h(tp,partial)", (1, True)),
    ("t h[tp:sharded]", (1, False)),
    ("b s[cp:zigzag] h[tp] d # dp:=moe_dp ep:replicated", (2, False)),
    ("t (num_heads*head_dim)[tp]", (1, False)),
    ("1 t h", None),
    ("s[cp:zigzag+partial] h", None),
])
def test_sglang_dims_grammar_is_read(dims, tp):
    assert parse_dims(dims).tp() == tp


def test_dims_declarations_are_read():
    spec = parse_dims("b s h[tp] # dp:=moe_dp ep:replicated")
    assert spec.dp_group_alias == "moe_dp" and spec.replicated_axes == frozenset({"ep"})
    assert [d.name for d in spec.dims] == ["b", "s", "h"]


@pytest.mark.parametrize("dims, words", [
    ("(tp) h(tp,partial)", ["unknown token '(tp)'"]),
    ("t h[xp]", ["unknown axis 'xp'"]),
    ("t h[tp:foo]", ["qualifier 'foo'"]),
    ("t h(tp,partial,partial)", ["repeated qualifier"]),
    ("t h # nonsense", ["unknown declaration 'nonsense'"]),
    ("t t", ["duplicate dimension"]),
    ("t h[tp] # tp:replicated", ["both sharded"]),
    ("t h!", ["unknown token 'h!'"]),
    ("   # dp:=x", ["no dimension"]),
    ("t (a)[tp]", ["unknown token '(a)[tp]'"]),
])
def test_an_unknown_dims_token_is_a_one_line_error(dims, words):
    with pytest.raises(TracerError) as e:
        parse_dims(dims, "f.pt")
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words) and "f.pt" in msg, msg


# ---------------------------------------------------------------- dumps


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tiny = load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)
    path = tmp_path_factory.mktemp("ref") / "ref.h5"
    tracer.run("tiny-llama", loaded=tiny, length=N, split_at=P, granularity="sublayers", output=path, progress=False)
    return str(path)


def _edit(dump: Path, module: str, f) -> list[Path]:
    files = sorted(dump.glob(f"*name=non_intrusive__{module}.output*"))
    assert files
    for path in files:
        data = torch.load(path, weights_only=True)
        f(data, data["meta"]["sglang_parallel_info"]["tp_rank"])
        torch.save(data, path)
    return files


def _set_dims(dims):
    def f(data, rank):
        data["meta"]["dims"] = dims
    return f


def test_malformed_dims_on_a_bit_identical_dump_is_an_error_not_a_divergence(ref, tmp_path):
    """'(tp) h(tp,partial)' used to sum two full copies and report 'diverges from ... down_proj'."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)
    _edit(dump, DOWN, _set_dims("(tp) h(tp,partial)"))
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    assert "unknown token '(tp)'" in str(e.value) and "\n" not in str(e.value)


def test_dims_marking_a_dim_the_tensor_lacks_is_an_error(ref, tmp_path):
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)
    _edit(dump, DOWN, _set_dims("t a b c d h[tp]"))
    with pytest.raises(TracerError, match=r"names 6 dimension\(s\) but the tensor has 2"):
        compare_dump((ref, "B"), str(dump))


def test_tp_partial_dims_are_summed_in_float64(ref, tmp_path):
    """'bs h[tp:partial]' (SGLang's nightly precision test): each rank holds a partial sum; the
    float64 sum of the two halves equals the reference value."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)

    def halve(data, rank):
        data["value"] = data["value"] * 0.5
        data["meta"]["dims"] = "bs h[tp:partial]"
    _edit(dump, DOWN, halve)
    c = compare_dump((ref, "B"), str(dump))
    assert c.identical and not c.contract
    assert "partial sums added (float64" in c.facts["mapping"][DOWN]
    x = next(p for p in c.points if p.name == DOWN).cross_dtype
    assert x is not None and x.compared_in == "float64" and x.n_inexact == 0


def test_tp8_full_sums_marked_partial_are_a_capture_contract_difference(ref, tmp_path):
    """SGLang #28925 at TP 8: the ranks hold the full (all-reduced) value but the dims say partial:
    their sum is 8x the reference. Reported as a capture-contract difference, not numerics."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=8)
    _edit(dump, DOWN, _set_dims("t h[tp:partial]"))
    c = compare_dump((ref, "B"), str(dump))
    with tracer.read_trace(ref) as r:
        a = r.tensor("B", DOWN)
    b = torch.stack([a.to(torch.float64)] * 8).sum(0)
    assert torch.equal(b, 8 * a.to(torch.float64))  # what the engine side holds: exactly 8x
    assert [m.name for m in c.contract] == [DOWN] and c.contract[0].factor == 8.0
    v = c.verdict()
    assert v.startswith(f"capture contract differs (partial vs full sums, ×8) at {DOWN}") and "world size 8" in v
    assert "not a numeric divergence" in v and "every other compared point agrees" in v
    from tracer.report.tables import to_markdown

    assert "[capture contract: ×8]" in to_markdown(c)


def test_partial_sums_dumped_as_full_are_a_capture_contract_difference(ref, tmp_path):
    """Each rank dumps its own partial sum (0.75 v and 0.25 v: exact) under a replicated name with no
    dims: the ranks differ, their sum is the reference: the verdict says so (and import refuses)."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)

    def partial(data, rank):
        data["value"] = data["value"].float() * (0.75 if rank == 0 else 0.25)
    _edit(dump, DOWN, partial)
    c = compare_dump((ref, "B"), str(dump))
    assert [m.how for m in c.contract] == ["rank sum"]
    assert c.verdict().startswith(f"capture contract differs (partial vs full sums, 2 ranks) at {DOWN}")
    assert "h[tp:partial]" in c.verdict()
    with pytest.raises(TracerError, match="capture contract differs.*not imported"):
        import_dump(str(dump), (ref, "B"), str(tmp_path / "i.h5"))


def test_replicated_ranks_that_differ_otherwise_are_still_inconsistent(ref, tmp_path):
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)

    def noise(data, rank):
        if rank == 1:
            data["value"] = data["value"] + 1
    _edit(dump, DOWN, noise)
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    assert "inconsistent shards" in str(e.value) and "different values" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- dump meta that used to exit 3 or pass silently


def test_meta_step_that_is_not_a_number_is_one_line(ref, tmp_path):
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)

    def f(data, rank):
        data["meta"]["step"] = "x"
    _edit(dump, DOWN, f)
    with pytest.raises(TracerError, match="meta step = 'x' is not an integer"):
        compare_dump((ref, "B"), str(dump))


def test_empty_input_ids_is_one_line(ref, tmp_path):
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)
    for path in dump.glob("*name=input_ids*"):
        data = torch.load(path, weights_only=True)
        data["value"] = torch.zeros(0, dtype=torch.long)
        torch.save(data, path)
    with pytest.raises(TracerError, match="input_ids of step 0 is empty"):
        compare_dump((ref, "B"), str(dump))


def test_a_rank_whose_tp_size_differs_is_inconsistent(ref, tmp_path):
    """A rank whose meta says tp_size 3 among 2 ranks was accepted silently."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)

    def f(data, rank):
        if rank == 1:
            data["meta"]["sglang_parallel_info"]["tp_size"] = 3
    _edit(dump, DOWN, f)
    with pytest.raises(TracerError, match=r"disagree on tp_size \(\[?2, 3"):
        compare_dump((ref, "B"), str(dump))


def test_dims_beyond_tp_are_named_in_the_mapping(ref, tmp_path):
    """'# dp:=moe_dp' (SGLang's declaration part) is read and said, never dropped silently."""
    dump = write_sglang_dump(ref, "B", tmp_path / "d", tp=2)
    _edit(dump, DOWN, _set_dims("t h # dp:=moe_dp"))
    c = compare_dump((ref, "B"), str(dump))
    assert c.identical and "dims also say dp:=moe_dp: tracer joins TP ranks only" in c.facts["mapping"][DOWN]
