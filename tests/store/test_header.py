"""Issue 24 item 8: every reader survives re-sealed tampering (an edit with every CRC recomputed, as
the public spec allows), with a one-line error naming the field instead of exit 3 later; and a
valid-but-huge trace is read in time linear in its number of points."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

import tracer
from tracer.errors import TracerError
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import seal, set_text


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reseal") / "t.h5"
    tracer.run("tiny-llama", prompt="ab" * 12, device="cpu", dtype="float32", output=str(path), progress=False,
               block_size=16)
    return path


def _reindex(g, entries) -> None:
    texts = [json.dumps(e) for e in entries]
    set_text(g, "index", "[" + ", ".join(texts) + "]")
    set_text(g, "index_crc32", json.dumps([[len(t.encode()), crc32_bytes(t.encode())] for t in texts]))


def _run_attr(run, key, fn):
    def go(f):
        g = f["runs"][run]
        doc = fn(json.loads(g.attrs[key]))
        _reindex(g, doc) if key == "index" else set_text(g, key, json.dumps(doc))
        seal(g)
    return go


def _doc(group_path, fn):
    def go(f):
        g = f[group_path] if group_path == "header" else f["comparisons"][next(iter(f["comparisons"]))]
        doc = json.loads(g.attrs["json"])
        fn(doc)
        set_text(g, "json", json.dumps(doc))
        seal(g)
    return go


def _set(k, v):
    def f(d):
        d[k] = v
        return d
    return f


def _entry(k, v, kind="layer"):
    def f(entries):
        next(e for e in entries if e["kind"] == kind)[k] = v
        return entries
    return f


def _logits_3d(entries):
    for e in entries:
        if e["kind"] == "logits":
            e["shape"] = [e["shape"][0], 1, e["shape"][1]]
    return entries


def _first_layer(k, v):
    def f(d):
        d["layers"][0][k] = v
    return f


def _facts(k, v):
    def f(d):
        d["facts"][k] = v
    return f


CASES = {  # name -> (edit, words the one-line error holds); the examples first
    "index_shape_0_by_1e30": (_run_attr("B", "index", _entry("shape", [0, 10**30])), "index of run B"),
    "logits_3d": (lambda f: (_run_attr("A", "index", _logits_3d)(f), _run_attr("B", "index", _logits_3d)(f)), "not (positions, vocab)"),
    "calls_positions_x": (_run_attr("B", "index", _entry("calls", [{"positions": "x"}])), "index of run B"),
    "kernels_device_7": (_run_attr("B", "index", _entry("calls", [{"positions": [16, 24], "kernels": {"device": 7}}])), "index of run B"),
    "numeric_contract_a_list": (_doc("header", _set("numeric_contract", [])), "numeric_contract"),
    "store_auto_malformed": (_run_attr("B", "meta", _set("store_auto", {"dropped": 5})), "store_auto"),
    "replay_malformed": (_doc("comparison", _set("replay", 5)), "replay"),
    "decode_tokens_malformed": (lambda f: (_run_attr("A", "meta", _set("decode_tokens", [1]))(f),
                                           _run_attr("B", "meta", _set("decode_tokens", 7))(f)), "decode_tokens"),
    "chunks_malformed": (_run_attr("B", "plan", _set("chunks", [[1, "a"]])), "chunks"),
    "stored_chunks_malformed": (_doc("comparison", _facts("chunks_a", 5)), "chunks_a"),
    "consumes_malformed": (_doc("comparison", _first_layer("consumes", {"points": 7})), "consumes"),
    "per_position_malformed": (_doc("comparison", _set("per_position", {"names": 5})), "per_position"),
    "ulp_hist_short": (_doc("comparison", _first_layer("ulp_hist", [1, 2])), "ulp_hist"),
    "engine_dump_meta_5": (_run_attr("B", "meta", _set("engine_dump", 5)), "engine_dump"),
    "notes_not_a_list": (_doc("comparison", _facts("notes", 5)), "notes"),
    "stored_shapes_malformed": (_doc("comparison", _first_layer("shapes_a", [{"positions": "x"}])), "shapes"),
    "negative_count": (_doc("comparison", _first_layer("n_total", -5)), "counts out of range"),
    "header_model_name_a_list": (_doc("header", lambda d: d["model"].__setitem__("name", [1])), "name"),
    "generate_huge": (_run_attr("B", "plan", _set("generate", 10**18)), "generate"),
}


def _everything(path: str) -> None:
    """What tracer's readers do with a trace: every run and point, the stored comparison rendered,
    a fresh comparison rendered."""
    from tracer.diff.stored import stored_comparison
    from tracer.report.tables import rows, to_markdown

    with tracer.read_trace(path) as r:
        for n in r.runs:
            r.run(n, load_tensors=False)
            for cap in r.capture_names(n):
                r.tensor(n, cap)
    for c in (stored_comparison(path), tracer.compare_trace(path, device="cpu")):
        c.verdict()
        to_markdown(c)
        rows(c)
        c.to_dict()


def test_the_untouched_trace_reads(base):
    _everything(str(base))


@pytest.mark.parametrize("case", sorted(CASES))
def test_resealed_edit_is_a_one_line_error(base, tmp_path, case):
    edit, words = CASES[case]
    path = tmp_path / "c.h5"
    shutil.copy(base, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    with pytest.raises(TracerError) as e:
        _everything(str(path))
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_many_points_are_read_without_per_point_h5py_objects(tmp_path, monkeypatch):
    """200,000 empty points in run B did not compare in 120 s: every point opened its own h5py
    object (cost growing with the number already open). The h5py lookups of a compare no longer
    grow with the number of points (benchmarks/many_points.py times 25k..200k points: linear)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("many_points", Path(__file__).resolve().parents[2]
                                                  / "benchmarks" / "many_points.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    counts = {}
    original = h5py.Group.__getitem__

    def counting(self, name):
        counts["n"] = counts.get("n", 0) + 1
        return original(self, name)

    monkeypatch.setattr(h5py.Group, "__getitem__", counting)
    seen = []
    for n in (300, 3000):
        bench.make(tmp_path / f"t{n}.h5", n)
        counts["n"] = 0
        c = tracer.compare_trace(str(tmp_path / f"t{n}.h5"), device="cpu")
        assert len(c.skipped) == n - 3  # B's points missing in A, each reported
        seen.append(counts["n"])
    assert seen[1] - seen[0] < 20, seen  # per point: no h5py lookup


# ---------------------------------------------------------------- the trace's facts as records (tracer/store/header.py)

DATA = Path(__file__).resolve().parent / "data"


def _raw_header(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f["header"].attrs["json"])


@pytest.mark.parametrize("name, written, block, blocks, engines", [
    ("v2-hf-prefix-cache", 8, 8, [8, 8], None),   # tracer run tiny-llama --scenario prefix-cache -n 24 -b 8
    ("v2-vllm-batch", 16, 32, [32, 32], {"A": 32, "B": 32}),  # tracer run smollm2-135m --engine vllm --scenario batch
    ("v2-hf-vs-vllm", 16, None, [None, 32], {"A": 0, "B": 32}),  # tracer run smollm2-135m --scenario engine
])
def test_a_version_2_trace_reads_as_version_3_writes_it(name, written, block, blocks, engines):
    """Traces written by tracer before format version 3 (committed, made by that version: see
    tests/store/data/README.md). Version 2 wrote the header's block size as the scenario's default
    16, whatever vLLM used (32, in its own facts), the scheduler facts under meta["vllm"], and the HF
    engine's block size as a sentence; read, they are what version 3 writes, checked by its records."""
    from tracer.diff.stored import stored_comparison
    from tracer.execute.records import EngineFacts, SchedulerFacts
    from tracer.store.header import RunMeta

    path = DATA / f"{name}.h5"
    raw = _raw_header(path)
    assert raw["block_size"] == written  # what version 2 wrote: the scenario's block size, else 16
    with tracer.read_trace(path) as r:
        assert r.format_version == 2
        assert r.header.get("block_size") == r.facts.block_size == block and r.header["block_sizes"] == blocks
        if engines is not None:
            assert {k: EngineFacts.from_dict(v).block_size for k, v in r.header["engines"].items()} == engines
            assert {k: v["block_size"] for k, v in raw["engines"].items()} == {  # the engines' own account, as written
                k: ("none (a contiguous KV cache)" if v == 0 else v) for k, v in engines.items()}
        for run in r.runs:
            meta = r.run(run, load_tensors=False).meta
            RunMeta.from_dict(meta)
            assert "vllm" not in meta
            if (meta.get("engine") or {}).get("engine") == "vllm":
                sched = SchedulerFacts.from_dict(meta["scheduler"])
                assert sched.requests and all(q.num_cached_tokens == 0 for q in sched.requests)
                assert sched.chunks == ((0, 40),)
    stored = stored_comparison(path)
    if engines is not None:
        assert stored.facts.engine_a.block_size == engines["A"] and stored.facts.engine_b.block_size == engines["B"]
    assert tracer.compare_trace(str(path)).verdict() == stored.verdict()


@pytest.fixture(scope="module")
def lm():
    return tracer.load_model("tiny-llama", dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("options, block, blocks", [
    ({"scenario": "batch", "batch_size": 2}, None, [None, None]),  # HF keeps one contiguous KV cache per row
    ({"scenario": "prefix-cache", "block_size": 8}, 8, [8, 8]),  # the cached prefix: the largest multiple of 8
    ({"scenario": "block-size", "block_sizes": [4, 8]}, None, [4, 8]),
])
def test_the_header_block_size_is_the_plans(lm, tmp_path, options, block, blocks):
    """The header's block size comes from the plans that ran (version 2 wrote 16 whatever ran)."""
    path = tmp_path / "t.h5"
    tracer.run(lm, length=24, output=str(path), progress=False, store="stats", **options)
    with tracer.read_trace(path) as r:
        assert r.format_version == 3
        assert r.header.get("block_size") == block and r.header["block_sizes"] == blocks
        assert r.facts.block_sizes == tuple(blocks)


def test_a_header_or_run_of_the_wrong_type_is_refused_when_written(tmp_path):
    """The writer checks what the reader will check (the same records), in one line, before the file exists."""
    from tests.helpers import make_runs, write_trace
    from tracer.store.trace import TraceWriter

    with pytest.raises(TracerError, match=r"the trace header\.numeric_contract: expected an object"):
        TraceWriter(tmp_path / "h.h5", header={"numeric_contract": []})
    a, b = make_runs()
    a.meta["store_auto"] = {"dropped": 5}
    with pytest.raises(TracerError, match=r"meta of run A\.store_auto"):
        write_trace(tmp_path / "m.h5", [a, b])
    assert not list(tmp_path.glob("*.h5"))


def test_a_header_fact_no_field_declares_is_refused_when_built(lm):
    """tracer builds the header from its record (schema.build): a fact without its field is an error, never dropped."""
    from tracer.config import CaptureConfig
    from tracer.pipeline import trace_header

    header = trace_header(lm, None, 8, CaptureConfig(), "stats", extra={"sweep": {"lengths": [8]}})
    assert header["sweep"] == {"lengths": [8]} and header.sweep == {"lengths": [8]}
    with pytest.raises(TracerError, match="'gizmo' is not a field of TraceHeader"):
        trace_header(lm, None, 8, CaptureConfig(), "stats", extra={"gizmo": 1})
