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
from tracer.store.integrity import crc32_bytes, seal, set_text


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
