"""Engine dumps (SGLang dumper, PassN.pt folders, safetensors/npz) mapped onto an HF reference run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tracer
from tracer.diff.compare_dump import compare_dump, import_dump
from tracer.engines.dumps.read import DumpEntry, RawDump, read_dump
from tracer.engines.dumps.namemap import align_steps
from tracer.errors import TracerError
from tracer.load.hf_cache import cache_kwarg
from tracer.load.models import load_model
from tracer.engines.dumps.sglang_writer import write_sglang_dump

N, P = 40, 32  # prefix-cache: run B computes positions 32..39 with the prefix cached (the engine's cache hit)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)


@pytest.fixture(scope="module")
def ref(tiny, tmp_path_factory):
    """tracer's own trace of the tiny model, sublayers: A = full prefill, B = cache hit (suffix 32..39)."""
    path = tmp_path_factory.mktemp("ref") / "ref.h5"
    tracer.run("tiny-llama", loaded=tiny, length=N, split_at=P, granularity="sublayers", output=path,
               progress=False)
    return str(path)


@pytest.fixture
def dump(ref, tmp_path):
    """B written as SGLang's dumper would: fused qkv/gate_up, (hidden, residual) layers, 2 TP ranks, 2 chunked steps."""
    return write_sglang_dump(ref, "B", tmp_path / "dump", tp=2, chunk=5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.int32)


def test_round_trip_is_bit_identical_at_every_mapped_point(ref, dump, tmp_path):
    c = compare_dump((ref, "B"), str(dump))
    assert c.identical and c.positions == (P, N)
    # SGLang dumps next-token logits (the last position): compared there, on their own
    assert any(n.startswith(f"lm_head (logits) at position(s) {N - 1} only") and ": 0 / 512 differ" in n
               and "no argmax flip" in n for n in c.facts["notes"])
    reader = tracer.read_trace(ref)
    names = reader.capture_names("B")
    # every HF point with an SGLang counterpart is mapped: all but the KV caches, HF's act_fn (act(gate)
    # alone: SGLang's act_fn is act(gate) * up = down_proj.input) and the logits (SGLang: last row only)
    expected = [n for n in names if not n.endswith((".kv_cache", ".mlp.act_fn")) and n != "lm_head"]
    assert [p.name for p in c.points] == expected
    # the imported tensors, compared here independently of compare_pairs: bit for bit with the trace
    out = tmp_path / "imported.h5"
    mapped = import_dump(str(dump), (ref, "B"), str(out))
    for name in expected:
        assert torch.equal(_bits(mapped.tensors[name]), _bits(reader.tensor("B", name))), name
    # the mapping says what was fused and sharded
    assert "fused qkv_proj, part 2 of 3; 2 TP shards" in mapped.mapping["model.layers.1.self_attn.k_proj"]
    assert "summed" in mapped.mapping["model.layers.2"]
    reader.close()


def test_import_never_writes_over_the_reference_or_the_dump(ref, dump, tmp_path):
    """`tracer import DUMP -r REF.h5:B -o REF.h5 --overwrite` replaced the reference it read with the one-run import."""

    own = tmp_path / "ref.h5"
    shutil.copy(ref, own)
    before = own.read_bytes()
    for output in (str(own), str(tmp_path / "." / "ref.h5")):
        with pytest.raises(TracerError, match="is the -r reference input .* of this command"):
            import_dump(str(dump), (str(own), "B"), output, overwrite=True)
    assert own.read_bytes() == before
    st = tmp_path / "named.safetensors"
    from safetensors.torch import save_file

    save_file({"input_ids": torch.arange(4)}, str(st))
    with pytest.raises(TracerError, match="is the DUMP input .* of this command"):
        import_dump(str(st), (str(own), "B"), str(st), overwrite=True)
    assert st.exists()


def test_layer_outputs_match_hf_hidden_states(tiny, ref, dump):
    """Independent oracle: HF's own output_hidden_states of the same cache-hit computation."""
    from transformers import DynamicCache

    ids = tracer.read_trace(ref).run("B", load_tensors=False).token_ids
    with torch.no_grad():
        cache = DynamicCache()
        tiny.model(torch.tensor([ids[:P]]), use_cache=True, **{cache_kwarg(tiny.model): cache})
        out = tiny.model(torch.tensor([ids[P:]]), use_cache=True, output_hidden_states=True,
                         **{cache_kwarg(tiny.model): cache})
    mapped = import_dump(str(dump), (ref, "B"), str(Path(dump).parent / "i.h5"))
    n_layers = tiny.model.config.num_hidden_layers
    for i in range(n_layers - 1):  # the last entry of hidden_states is after the final norm
        assert torch.equal(_bits(mapped.tensors[f"model.layers.{i}"]), _bits(out.hidden_states[i + 1][0])), i


def test_cli_import_then_compare(ref, dump, tmp_path, cli_env):
    out = tmp_path / "engine.h5"
    from tests.helpers import tracer_warm

    r = tracer_warm(["import", str(dump), "-o", str(out), "-r", f"{ref}:B"], cli_env, tmp_path, check=False)
    assert r.returncode == 0, r.stderr
    r = tracer_warm(["compare", f"{ref}:B", str(out), "--fail-on", "any"], cli_env, tmp_path, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HF vs SGLang dumper" in r.stdout and "bit-identical" in r.stdout
    assert "model.layers.0.self_attn.q_proj ← non_intrusive__model.layers.0.self_attn.qkv_proj.output" in r.stdout


def test_planted_mlp_perturbation_is_the_origin(tiny, ref, tmp_path):
    """The 'engine' computes layer 1's MLP differently (+0.25): the origin is that MLP."""
    handle = tiny.model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out + 0.25)
    try:
        bad = tmp_path / "bad.h5"
        tracer.run("tiny-llama", loaded=tiny, length=N, split_at=P, granularity="sublayers", output=bad,
                   progress=False)
    finally:
        handle.remove()
    d = write_sglang_dump(str(bad), "B", tmp_path / "dump", tp=2)
    c = compare_dump((ref, "B"), str(d))
    assert [p.name for p in c.origins] == ["model.layers.1.mlp"]
    assert c.first_divergent == "model.layers.1.mlp"
    assert all(not p.diverged for p in c.points if p.name.startswith(("model.embed", "model.layers.0")))
    logits_note = next(n for n in c.facts["notes"] if n.startswith("lm_head (logits)"))
    assert ": 0 / 512 differ" not in logits_note  # the perturbation reaches the last position's logits


def test_reference_at_layers_granularity(tiny, dump, tmp_path):
    """The sublayer tensors of the dump have no counterpart: listed, and the layers still compare."""
    path = tmp_path / "layers.h5"
    tracer.run("tiny-llama", loaded=tiny, length=N, split_at=P, output=path, progress=False)
    c = compare_dump((str(path), "B"), str(dump))
    assert c.identical
    assert [p.name for p in c.points] == ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(4)] + ["model.norm"]
    assert any("did not capture" in n and "model.layers.0.input_layernorm" in n for n in c.facts["notes"])


def test_per_pass_folders_with_two_ranks(ref, tmp_path):
    d = write_sglang_dump(ref, "B", tmp_path / "passes", tp=2, chunk=3, layout="passes")
    raw = read_dump(d)
    assert raw.layout == "passes" and raw.facts["tp_size"] == 2 and sorted(raw.tokens) == [0, 1, 2]
    c = compare_dump((ref, "B"), str(d))
    assert c.identical
    # leaves only: the layer outputs come from the next layer's input_layernorm residual / the final norm's
    names = {p.name for p in c.points}
    assert {"model.layers.0", "model.layers.3", "model.layers.2.mlp.gate_proj"} <= names


def test_dims_metadata_gives_the_sharded_dim(ref, dump):
    """o_proj is replicated by default; with dims "t h[tp]" the two halves are concatenated."""
    for f in sorted(Path(dump).glob("*name=non_intrusive__model.layers.0.self_attn.o_proj.output*")):
        data = torch.load(f, weights_only=True)
        rank = data["meta"]["sglang_parallel_info"]["tp_rank"]
        half = data["value"].shape[-1] // 2
        data["value"] = data["value"][:, rank * half:(rank + 1) * half].clone()
        data["meta"]["dims"] = "t h[tp]"
        torch.save(data, f)
    c = compare_dump((ref, "B"), str(dump))
    assert c.identical
    assert "2 TP shards along dim 1" in c.facts["mapping"]["model.layers.0.self_attn.o_proj"]


def test_partial_sums_are_added(ref, dump):
    """dims "t h(tp,partial)": each rank holds a partial sum (here half the value each: exact in bf16)."""
    for f in sorted(Path(dump).glob("*name=non_intrusive__model.layers.1.mlp.down_proj.output*")):
        data = torch.load(f, weights_only=True)
        data["value"] = data["value"] * 0.5
        data["meta"]["dims"] = "t h(tp,partial)"
        torch.save(data, f)
    c = compare_dump((ref, "B"), str(dump))
    assert c.identical
    assert "partial sums added" in c.facts["mapping"]["model.layers.1.mlp.down_proj"]


def test_safetensors_of_hf_names(ref, tmp_path):
    from safetensors.torch import save_file

    reader = tracer.read_trace(ref)
    rec = reader.run("B", load_tensors=False)
    tensors = {n: reader.tensor("B", n).contiguous() for n in ("model.embed_tokens", "model.layers.0", "model.layers.1.mlp")}
    tensors["input_ids"] = torch.tensor(rec.token_ids[P - 4:N])  # more positions than the reference kept
    tensors = {k: (torch.cat([torch.zeros(4, *v.shape[1:], dtype=v.dtype), v]) if k != "input_ids" else v)
               for k, v in tensors.items()}
    save_file(tensors, tmp_path / "t.safetensors")
    c = tracer.compare_trace(f"{ref}:B", str(tmp_path / "t.safetensors"))
    assert c.identical and [p.name for p in c.points] == ["model.embed_tokens", "model.layers.0", "model.layers.1.mlp"]
    assert any("positions only in the dump: 28..31" in n for n in c.facts["notes"])
    reader.close()



def test_nan_in_a_dump_is_named_in_the_text_report(ref, tmp_path):
    """A NaN planted in a safetensors dump's layer 1 (two elements): the text report names the dump's
    run, the count and the point, and its row is in the default table."""
    import io

    from rich.console import Console
    from safetensors.torch import save_file

    from tracer.report.render import render

    reader = tracer.read_trace(ref)
    rec = reader.run("B", load_tensors=False)
    tensors = {n: reader.tensor("B", n).contiguous().clone() for n in ("model.embed_tokens", "model.layers.0",
                                                                       "model.layers.1", "model.layers.2")}
    reader.close()
    tensors["model.layers.1"].view(-1)[[3, 7]] = float("nan")
    tensors["input_ids"] = torch.tensor(rec.token_ids[P:N])
    save_file(tensors, tmp_path / "nan.safetensors")
    c = tracer.compare_trace(f"{ref}:B", str(tmp_path / "nan.safetensors"))
    out = io.StringIO()
    render(c, "table", Console(file=out, width=100, no_color=True))
    text = out.getvalue()
    line = next(ln for ln in text.splitlines() if ln.startswith("non-finite:"))
    assert line.split(":", 1)[1].strip() == f"{c.run_b}: 2 NaN, 0 Inf in 1 point, first model.layers.1"  # A: none
    assert any(ln.startswith("│ model.layers.1 ") for ln in text.splitlines())


def test_suffix_shorter_than_the_reference_window_is_reported(ref, dump, tmp_path):
    """A dump of fewer positions than the reference kept: compared where both exist, the rest reported."""
    for f in Path(dump).glob("step=0___*"):
        f.unlink()  # drop the first chunk (positions 32..36)
    c = compare_dump((ref, "B"), str(dump))
    assert c.positions == (37, N) and c.identical
    assert any("positions only in the reference: 32..36" in n for n in c.facts["notes"])


# ---------------------------------------------------------------- logits rows by their count


def _logits_dump(dump: Path, rows: torch.Tensor) -> None:
    """Replace the dump's next-token logits by ``logits_processor.output`` holding ``rows`` on every rank
    (SGLang's LogitsProcessor dumped whole: one row per computed token of a cache-hit step)."""
    for f in dump.glob("*next_token_logits*"):
        f.unlink()
    steps = sorted({int(f.name.split("___")[0].split("=")[1]) for f in dump.glob("step=*.pt")})
    for rank in range(2):
        tags = {"step": steps[-1], "rank": rank, "dump_index": 999, "name": "non_intrusive__logits_processor.output"}
        meta = {**tags, "world_rank": rank, "world_size": 2,
                "sglang_parallel_info": {"tp_rank": rank, "tp_size": 2, "pp_rank": 0, "pp_size": 1}}
        torch.save({"value": rows.clone(), "meta": meta}, dump / ("___".join(f"{k}={v}" for k, v in tags.items()) + ".pt"))


def test_logits_of_every_computed_token_are_compared_at_their_positions(ref, tmp_path):
    """Issue 37 item 0: a cache-hit step's LogitsProcessor output, one float32 row per computed token
    (HF's own logits), was read as "last position of each request": row 0 compared against position 39
    (all 512 differ, an argmax flip in the notes) and the verdict said bit-identical, exit 0, JSON
    "logits": null. The rows are matched to positions by their count: HF's values, equal everywhere."""
    d = write_sglang_dump(ref, "B", tmp_path / "dump", tp=2)  # one step: the cache hit's 8 tokens
    hf = tracer.read_trace(ref).tensor("B", "lm_head")
    _logits_dump(d, hf.float())
    c = compare_dump((ref, "B"), str(d))
    assert c.logits is not None and c.logits.n_positions == N - P and c.logits.tensor.n_diff == 0
    assert c.identical and c.verdict().startswith("identical values") and "lm_head" in c.cross_dtypes
    assert "one logits row per computed token" in c.facts["mapping"]["lm_head"]
    doc = c.to_dict()
    assert doc["logits"]["name"] == "lm_head" and doc["logits"]["positions"] == N - P
    # one row changed (an independent edit of the oracle): the verdict and --fail-on any see it
    planted = hf.float().clone()
    planted[3, 7] += 1.0
    shutil.rmtree(d.parent)
    d = write_sglang_dump(ref, "B", tmp_path / "dump", tp=2)
    _logits_dump(d, planted)
    c = compare_dump((ref, "B"), str(d))
    assert c.logits.tensor.n_diff == 1 and c.first_divergent == "lm_head"
    assert c.verdict().startswith("diverges from lm_head") and c.check("any")[0]


def test_logits_rows_of_another_count_are_refused(ref, tmp_path):
    """3 logits rows in a step of 8 tokens and 1 request: neither one per token nor one per request."""
    d = write_sglang_dump(ref, "B", tmp_path / "dump", tp=2)
    _logits_dump(d, tracer.read_trace(ref).tensor("B", "lm_head")[:3].float())
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(d))
    _one_line(e, "logits of shape (3, 512)", "8 token(s) in 1 request(s)")


def test_next_token_logits_count_in_the_verdict_the_check_and_every_format(ref, tmp_path):
    """Logits dumped at the last position only are compared there and count like any logits: a
    difference planted in them alone makes the verdict diverge from lm_head, --fail-on any fail, and
    JSON, CSV and markdown carry them (they were a note only: verdict bit-identical, "logits": null)."""
    d = write_sglang_dump(ref, "B", tmp_path / "dump", tp=2, perturb={"lm_head": 0.5})
    c = compare_dump((ref, "B"), str(d))
    assert c.logits is not None and c.logits.n_positions == 1 and c.facts["logits_positions"] == [N - 1]
    assert c.logits.tensor.n_diff > 0 and c.first_divergent == "lm_head"
    assert c.verdict().startswith("diverges from lm_head") and "in 1 position" in c.verdict()
    assert c.check("any")[0]
    assert all(p.diff.n_diff == 0 for p in c.points)  # the perturbation is in the logits alone
    doc = c.to_dict()
    assert doc["logits"] is not None and doc["logits"]["n_diff"] == c.logits.tensor.n_diff
    for fmt in ("csv", "markdown"):
        assert "lm_head" in tracer.render(c, fmt), fmt


# ---------------------------------------------------------------- token alignment (no model)


def _raw(steps: dict[int, tuple[list[int], list[int] | None]]) -> RawDump:
    entries = [DumpEntry(name="x", module="x", element=None, step=s, tp_rank=0, tp_size=1, pp_rank=0, dims=None,
                         tensor=torch.zeros(len(ids)), file="f") for s, (ids, _pos) in steps.items()]
    tokens = {s: {"input_ids": torch.tensor(ids), "positions": None if pos is None else torch.tensor(pos), "file": "f"}
              for s, (ids, pos) in steps.items()}
    return RawDump(path="d", layout="tensors", engine="t", entries=entries, tokens=tokens)


def test_batch_row_found_by_token_ids():
    ref = list(range(100, 120))
    other = [7, 8, 9]
    raw = _raw({0: (other + ref[15:20], [0, 1, 2, 15, 16, 17, 18, 19])})
    plan, notes = align_steps(raw, ref)
    assert plan == {0: [(3, 8, 15)]} and "rows 0..2" in notes[0]


def test_chunked_steps_without_positions_are_concatenated():
    ref = [1, 2, 1, 2, 1, 2, 3, 4]  # repeated ids: the second chunk must follow the first
    raw = _raw({0: ([1, 2], None), 1: ([1, 2, 3, 4], None)})
    plan, _ = align_steps(raw, ref)
    assert plan == {0: [(0, 2, 2)], 1: [(0, 4, 4)]}


def test_cache_hit_suffix_without_positions_is_placed_at_the_end():
    ref = [5, 6, 5, 6, 9]
    plan, _ = align_steps(_raw({0: ([5, 6, 9], None)}), ref)
    assert plan == {0: [(0, 3, 2)]}


# ---------------------------------------------------------------- malformed dumps: one-line errors


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_missing_meta(ref, dump):
    f = next(Path(dump).glob("*name=non_intrusive__model.layers.0.mlp.output*"))
    torch.save({"value": torch.zeros(2)}, f)
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    _one_line(e, "missing meta", f.name)


def test_missing_shard(ref, dump):
    next(Path(dump).glob("*rank=1___*qkv_proj*")).unlink()
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    _one_line(e, "inconsistent shards", "qkv_proj", "ranks [0] of tp_size 2")


def test_replicated_shards_that_differ(ref, dump):
    f = next(Path(dump).glob("step=0___rank=1___*model.layers.1.mlp.down_proj.output*"))
    data = torch.load(f, weights_only=True)
    data["value"] = data["value"] + 1
    torch.save(data, f)
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    _one_line(e, "inconsistent shards", "down_proj", "different values")


def test_unknown_name(ref, dump):
    src = next(Path(dump).glob("step=0___rank=0___*model.layers.0.mlp.output*"))
    data = torch.load(src, weights_only=True)
    data["meta"]["name"] = "non_intrusive__model.layers.0.mlp.mystery_proj.output"
    torch.save(data, Path(dump) / "step=0___rank=0___dump_index=999___name=non_intrusive__model.layers.0.mlp.mystery_proj.output.pt")
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    _one_line(e, "unknown engine tensor", "mystery_proj", "--map")


def test_unknown_name_mapped_by_a_toml_override(ref, dump, tmp_path):
    src = next(Path(dump).glob("step=0___rank=0___*model.layers.0.mlp.output*"))
    for f in Path(dump).glob("*model.layers.0.mlp.output*"):
        data = torch.load(f, weights_only=True)
        data["meta"]["name"] = data["meta"]["name"].replace(".mlp.output", ".ffn.output")
        f.rename(f.with_name(f.name.replace(".mlp.output", ".ffn.output")))
        torch.save(data, f.with_name(f.name.replace(".mlp.output", ".ffn.output")))
    assert not src.exists()
    (tmp_path / "m.toml").write_text('[layer]\n"ffn" = { hf = "mlp" }\n')
    c = tracer.compare_trace(f"{ref}:B", str(dump), engine_map=str(tmp_path / "m.toml"))
    assert c.identical and "ffn.output" in c.facts["mapping"]["model.layers.0.mlp"]


class _Evil:  # any class: weights_only=True refuses to construct it
    pass


def test_pickled_objects_are_refused(ref, dump):
    f = next(Path(dump).glob("*name=non_intrusive__model.embed_tokens*"))
    data = torch.load(f, weights_only=True)
    data["meta"]["obj"] = _Evil()
    torch.save(data, f)
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    _one_line(e, f.name, "weights_only=True")


def test_pickled_npz_is_refused(tmp_path):
    np.savez(tmp_path / "x.npz", input_ids=np.arange(3), bad=np.array([{"a": 1}], dtype=object))
    with pytest.raises(TracerError) as e:
        read_dump(tmp_path / "x.npz")
    _one_line(e, "x.npz", "pickled")


def test_token_ids_that_do_not_match(ref, dump):
    for f in Path(dump).glob("*name=input_ids*"):
        data = torch.load(f, weights_only=True)
        data["value"] = data["value"] + 1
        torch.save(data, f)
    with pytest.raises(TracerError) as e:
        compare_dump((ref, "B"), str(dump))
    _one_line(e, "token ids do not match the reference")


def test_cli_error_is_one_line_and_exit_2(ref, dump, tmp_path, cli_env):
    shutil.rmtree(dump)
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "tracer", "compare", f"{ref}:B", str(tmp_path / "empty")],
                       capture_output=True, text=True, env={**cli_env, "TRACER_PROGRESS": "off"},  # no 'compare:' line on a slow machine
                       cwd=tmp_path)
    assert r.returncode == 2 and "holds no engine dump" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["fifo", "loop"])
def test_a_dump_path_that_is_no_regular_file_is_named_as_what_it_is(ref, tmp_path, kind):
    """`tracer compare REF.h5:B x.safetensors` with a FIFO there said "trace file x.safetensors not
    found; give an existing trace": the file exists, and it is no trace. A symlink loop: the same."""
    path = tmp_path / "x.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "y.safetensors").symlink_to(path)
        path.symlink_to(tmp_path / "y.safetensors")
    with pytest.raises(TracerError) as e:
        tracer.compare_trace(f"{ref}:B", str(path))
    msg = str(e.value)
    assert "\n" not in msg and "not found" not in msg and str(path) in msg, msg
    assert ("is a FIFO" in msg and "regular file" in msg) if kind == "fifo" else "symbolic links" in msg, msg


def _vllm_pass(reader, run: str) -> dict:
    """Run ``run`` of a stored sublayers trace as one ``Pass00000.pt`` shaped exactly like a dump of
    real vLLM 0.32 written with plain forward hooks (see hooks/engine-vllm.toml): Linear layers
    ``[output, None]``, fused ``qkv_proj``/``gate_up_proj``, ``rotary_emb`` ``[q, k]``, a fused
    add + RMSNorm ``[normed, residual]`` (layer 0's input norm: a tensor), layers ``[hidden, residual]``."""
    rec = reader.run(run, load_tensors=False)
    lo, hi = rec.window
    get = lambda n: reader.tensor(run, n).reshape(hi - lo, -1)  # noqa: E731
    layers = [n for n in reader.capture_names(run) if reader.capture_info(run, n)["kind"] == "layer"]
    data = {"model.forward_batch_info.input_ids": torch.tensor(rec.token_ids[lo:hi]),
            "model.forward_batch_info.positions": torch.arange(lo, hi),
            "model.embed_tokens": get("model.embed_tokens")}
    prev = get("model.embed_tokens")
    for i, layer in enumerate(layers):
        mid = prev + get(f"{layer}.self_attn")  # the residual after attention (HF adds in bf16)
        q, k, v = (get(f"{layer}.self_attn.{x}_proj") for x in "qkv")
        data.update({
            f"{layer}.input_layernorm": get(f"{layer}.input_layernorm") if i == 0 else [get(f"{layer}.input_layernorm"), prev],
            f"{layer}.self_attn.qkv_proj": [torch.cat([q, k, v], dim=-1), None],
            f"{layer}.self_attn.rotary_emb": [q.clone(), k.clone()],
            f"{layer}.self_attn.attn": get(f"{layer}.self_attn.core"),
            f"{layer}.self_attn.o_proj": [get(f"{layer}.self_attn.o_proj"), None],
            f"{layer}.self_attn": get(f"{layer}.self_attn"),
            f"{layer}.post_attention_layernorm": [get(f"{layer}.post_attention_layernorm"), mid],
            f"{layer}.mlp.gate_up_proj": [torch.cat([get(f"{layer}.mlp.gate_proj"), get(f"{layer}.mlp.up_proj")], -1), None],
            f"{layer}.mlp.act_fn": get(f"{layer}.mlp.down_proj.input"),
            f"{layer}.mlp.down_proj": [get(f"{layer}.mlp.down_proj"), None],
            f"{layer}.mlp": get(f"{layer}.mlp"),
            layer: [get(f"{layer}.mlp"), mid],
        })
        prev = get(layer)
    data["model.norm"] = [get("model.norm"), prev]
    data["logits_processor"] = get("lm_head")[-1:]
    return data


def test_per_pass_dump_shaped_like_real_vllm_maps_at_sublayers(ref, tmp_path):
    """Real vLLM returns tuples ((output, None) from Linear layers, fused qkv of q + k + v widths):
    at sublayers granularity every point maps and equals the reference bit for bit (the fused
    outputs split by the HF widths at TP 1, the None bias skipped, rotary_emb ignored)."""
    reader = tracer.read_trace(ref)
    dump = tmp_path / "vllm-dump"
    dump.mkdir()
    torch.save(_vllm_pass(reader, "B"), dump / "Pass00000.pt")
    c = compare_dump((ref, "B"), str(dump))
    assert c.identical and c.positions == (P, N)
    names = reader.capture_names("B")
    expected = [n for n in names if not n.endswith((".kv_cache", ".mlp.act_fn")) and n != "lm_head"]
    assert [p.name for p in c.points] == expected
    mapped = import_dump(str(dump), (ref, "B"), str(tmp_path / "imported.h5"))
    for name in expected:
        assert torch.equal(_bits(mapped.tensors[name]), _bits(reader.tensor("B", name))), name
    assert mapped.tensors["model.layers.0.self_attn.q_proj"].shape[1] == reader.tensor("B", "model.layers.0.self_attn.q_proj").shape[1]
    assert "fused qkv_proj, part 1 of 3" in mapped.mapping["model.layers.0.self_attn.q_proj"]
    assert any(f"lm_head (logits) at position(s) {N - 1} only" in n and ": 0 / 512 differ" in n for n in c.facts["notes"])
    reader.close()


def test_per_pass_value_of_none_only_is_refused(ref, tmp_path):
    dump = tmp_path / "bad"
    dump.mkdir()
    torch.save({"model.forward_batch_info.input_ids": torch.tensor([1]), "model.embed_tokens": [None, None]},
               dump / "Pass00000.pt")
    with pytest.raises(TracerError, match="not a tensor or a list of tensors"):
        compare_dump((ref, "B"), str(dump))


def test_a_dump_of_another_hidden_size_names_both_sizes_and_the_map_only_when_given(ref, tmp_path):
    """A dump of another model (hidden 96 against the reference's 64) was blamed on "the map" with no
    --map given: the error names the two hidden sizes and says the dump is of another model; the
    map is named only when the user gave one."""
    from safetensors.torch import save_file

    reader = tracer.read_trace(ref)
    rec = reader.run("B", load_tensors=False)
    layer = reader.tensor("B", "model.layers.0")
    reader.close()
    n, hidden = layer.shape
    wide = hidden + 32
    save_file({"input_ids": torch.tensor(rec.token_ids[-n:]), "model.layers.0": torch.zeros(n, wide, dtype=layer.dtype)},
              tmp_path / "other.safetensors")
    with pytest.raises(TracerError) as e:
        tracer.compare_trace(f"{ref}:B", str(tmp_path / "other.safetensors"))
    _one_line(e, f"hidden size is {wide}", f"is {hidden}", "another model")
    assert "map" not in str(e.value), e.value
    (tmp_path / "m.toml").write_text("[layer]\n")
    with pytest.raises(TracerError) as e:
        tracer.compare_trace(f"{ref}:B", str(tmp_path / "other.safetensors"), engine_map=str(tmp_path / "m.toml"))
    _one_line(e, f"hidden size is {wide}", f"is {hidden}", f'engine_map="{tmp_path / "m.toml"}"')


def test_a_dump_of_float8_activations_is_refused_in_one_line(tmp_path):
    """Issue 37 (this stop's trial): a vLLM hidden-states file of float8 rows made ``tracer compare``
    exit 3 (torch has no promotion of float8 with bfloat16); a dtype the trace does not hold is
    refused when the dump is read, naming the tensor and what to do."""
    import pytest
    from safetensors.torch import save_file

    from tracer.engines.dumps.read import read_dump
    from tracer.errors import TracerError

    path = tmp_path / "fp8.safetensors"
    save_file({"hidden_states": torch.randn(6, 3, 8).to(torch.float8_e4m3fn),
               "token_ids": torch.arange(6, dtype=torch.int64)}, str(path))
    with pytest.raises(TracerError, match="float8_e4m3fn; tracer compares bfloat16") as e:
        read_dump(path)
    assert "\n" not in str(e.value)
    save_file({"hidden_states": torch.randn(6, 3, 8).to(torch.bfloat16),
               "token_ids": torch.arange(6, dtype=torch.int64)}, str(path))
    assert len(read_dump(path).entries) == 3


def test_a_dump_file_with_no_tensors_says_so(tmp_path):
    """Issue 37 (this stop's trial): a .safetensors file with an empty header was refused as 'token ids
    do not match the reference prompt in any step ()'."""
    import pytest
    from safetensors.torch import save_file

    from tracer.engines.dumps.read import read_dump
    from tracer.errors import TracerError

    path = tmp_path / "empty.safetensors"
    save_file({}, str(path))
    with pytest.raises(TracerError, match="holds no tensors"):
        read_dump(path)


def test_a_prefills_rows_are_a_view_and_a_second_placement_is_checked_position_by_position():
    """The mapping keeps one request's prefill rows as one slice of the dump (no copy, no entry per
    position), and a later step that computes some positions again still has each checked against
    the first: a planted change at one re-computed position is named, the first rows are compared."""
    from tracer.engines.dumps.namemap import RefLayout, map_dump
    from tracer.engines.vllm.layout import engine_map

    hidden, ids = 8, list(range(100, 108))
    names = {"model.embed_tokens": ("embedding", "Embedding", (hidden,), "bfloat16"),
             "model.layers.0": ("layer", "LlamaDecoderLayer", (hidden,), "bfloat16")}
    ref = RefLayout(names=names, layer_prefix="model.layers", n_layers=1, token_ids=ids, window=(0, 8), family="llama")
    rows = torch.randn(8, 2, hidden).to(torch.bfloat16)  # [tokens, slots, hidden] as vLLM's hidden-states file
    def entry(module, step, t):
        return DumpEntry(name=module, module=module, element=None, step=step, tp_rank=0, tp_size=1, pp_rank=0,
                         dims=None, tensor=t, file="x")
    prefill = [entry("model.embed_tokens", 0, rows[:, 0]), entry("model.layers.0", 0, rows[:, 1])]
    tok = {0: {"input_ids": torch.tensor(ids), "positions": torch.arange(8), "file": "x"}}
    mapped = map_dump(RawDump("x", "tensors", "t", prefill, tok), ref, engine_map("llama"))
    layer = mapped.tensors["model.layers.0"]
    assert torch.equal(layer, rows[:, 1]) and layer.data_ptr() == rows[:, 1].data_ptr()  # the dump's own rows
    again = rows[5:8, 1].clone()
    again[1] += 1  # position 6 computed again, differently
    tok[1] = {"input_ids": torch.tensor(ids[5:8]), "positions": torch.arange(5, 8), "file": "x"}
    mapped = map_dump(RawDump("x", "tensors", "t", [*prefill, entry("model.layers.0", 1, again)], tok), ref,
                      engine_map("llama"))
    assert torch.equal(mapped.tensors["model.layers.0"], rows[:, 1])  # the first rows of every position
    assert any(n.startswith("model.layers.0 at position(s) 6: a later engine tensor") for n in mapped.notes), mapped.notes


def _run_b_slots(ref: str) -> tuple[list[int], list[str], list[torch.Tensor]]:
    """Run B of the reference: its token ids, its decoder layers' names in order, and its captures as
    a hidden-states file's slots (the embedding, then each layer), each ``[window rows, hidden]``."""
    with tracer.read_trace(ref) as reader:
        ids = reader.run("B", load_tensors=False).token_ids
        layers = sorted((n for n in reader.capture_names("B") if n.count(".") == 2 and n.startswith("model.layers.")),
                        key=lambda n: int(n.rsplit(".", 1)[1]))
        slots = [reader.tensor("B", "model.embed_tokens")] + [reader.tensor("B", n) for n in layers]
    return ids, layers, slots


def test_a_hidden_states_file_is_compared_from_the_reference_windows_rows_alone(ref, tmp_path, monkeypatch):
    """A vLLM hidden-states file of run B's prompt (the window's rows are B's own captures, the other
    rows noise): `tracer compare` reads only the window's rows (the whole read is never made) and
    gives what the whole read gives: every layer and the embedding bit-identical to the reference."""
    from safetensors.torch import save_file

    from tracer.diff import compare_dump as cd

    ids, layers, slots = _run_b_slots(ref)
    hs = torch.randn(N, len(slots), slots[0].shape[-1]).to(slots[0].dtype)
    hs[P:N] = torch.stack(slots, dim=1)
    path = tmp_path / "req.safetensors"
    save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(path))
    whole = compare_dump((ref, "B"), str(path))
    real = cd.read_dump
    monkeypatch.setattr(cd, "read_dump", lambda *a: pytest.fail("the whole file was read"))
    direct = compare_dump((ref, "B"), str(path))
    assert direct.identical and whole.identical and direct.positions == whole.positions == (P, N)
    assert [p.name for p in direct.points] == [p.name for p in whole.points] == ["model.embed_tokens", *layers]
    assert direct.facts["notes"] == whole.facts["notes"]
    hs[N - 1, 2, 0] += 1.0  # one element of layer 1 at the last position: found there, by both reads
    save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(path))
    direct = compare_dump((ref, "B"), str(path))
    monkeypatch.setattr(cd, "read_dump", real)
    whole = compare_dump((ref, "B"), str(path))
    for c in (direct, whole):
        assert {p.name: p.diff.n_diff for p in c.points if p.diff.n_diff} == {"model.layers.1": 1}


@pytest.mark.parametrize("first", [P, P - 4])
def test_a_window_file_is_compared_and_imported_as_its_whole_read_says(ref, tmp_path, monkeypatch, first):
    """A hidden-states file of a window alone (tracer's connector: rows ``first..N-1`` and ``window``):
    `tracer compare` and `tracer import` give what reading the file whole gives. The direct read took
    the file for the whole prompt's: "positions only in the dump: 0..31" (rows the file does not hold)
    and GEMM M 40 for the 8 or 12 rows the file holds, and the import lost the file's window."""
    from safetensors.torch import save_file

    from tracer.diff import compare_dump as cd

    ids, layers, slots = _run_b_slots(ref)
    hs = torch.randn(N - first, len(slots), slots[0].shape[-1]).to(slots[0].dtype)
    hs[P - first:] = torch.stack(slots, dim=1)
    path = tmp_path / "req.safetensors"
    save_file({"hidden_states": hs, "token_ids": torch.tensor(ids), "window": torch.tensor([first, N])}, str(path))
    got = {}
    for how in ("direct", "whole"):
        if how == "whole":
            monkeypatch.setattr(cd, "read_window", lambda *a: None)
        c = compare_dump((ref, "B"), str(path))
        m = import_dump(str(path), (ref, "B"), str(tmp_path / f"{how}.h5"))
        got[how] = (c.identical, c.positions, c.facts["notes"], c.facts["gemm_m_b"], m.facts, m.notes)
    assert got["direct"] == got["whole"]
    # independently: the file holds rows first..N-1 of a 40-token prompt
    assert got["direct"][3] == [N - first] and got["direct"][4]["window"] == [first, N]
    outside = [n for n in got["direct"][2] if n.startswith("positions only in the dump")]
    assert outside == ([] if first == P else [f"positions only in the dump: {first}..{P - 1} (outside the reference's "
                                                 f"kept window {P}..{N - 1})"])
