"""The compiled vLLM capture's direct read of a hidden-states file (the window's rows alone:
tracer/engines/dumps/hidden_states.py ``read_window``, tracer/engines/dumps/namemap.py
``map_window``) against the whole file read as an engine dump (``read_dump``, ``check_slots``,
``map_dump``), the path the capture took before and the oracle here: it is checked against HF and
against tracer's hooks in vLLM by tests/engines/test_dumps.py and test_vllm_compiled.py.

No vLLM: synthetic files in the format of vLLM's connector, ``hidden_states [T, L + 1, hidden]``
(random bf16) and ``token_ids [T]``, written with safetensors; ``execute_compiled`` driven by a
stand-in engine that writes the file when its request finishes.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tracer.engines.dumps.hidden_states import ENGINE, check_slots, read_window
from tracer.engines.dumps.namemap import RefLayout, map_dump, map_window
from tracer.engines.dumps.read import read_dump
from tracer.engines.vllm import compiled
from tracer.engines.vllm.layout import engine_map
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint
from tracer.plan.scenarios import RunPlan

T, L, H = 64, 4, 16


def _file(path: Path, T: int = T, slots: int = L + 1, hidden: int = H, seed: int = 0,
          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"hidden_states": torch.randn(T, slots, hidden, generator=g).to(dtype),
               "token_ids": torch.randint(0, 50000, (T,), generator=g)}
    save_file(tensors, str(path))
    return tensors


def _points(sublayers: int = 0) -> list[CapturePoint]:
    """A qwen3-like reference's points: embedding, every layer (with ``sublayers`` extra Linear points
    each, which the file has no rows for), final norm, logits."""
    pts = [CapturePoint("model.embed_tokens", "model.embed_tokens", PointKind.EMBEDDING, "Embedding", role="embedding")]
    for i in range(L):
        pts += [CapturePoint(f"model.layers.{i}.mlp.lin{k}", f"model.layers.{i}.mlp.lin{k}", PointKind.LINEAR, "Linear")
                for k in range(sublayers)]
        pts.append(CapturePoint(f"model.layers.{i}", f"model.layers.{i}", PointKind.LAYER, "Qwen3DecoderLayer",
                                role="layer"))
    pts.append(CapturePoint("model.norm", "model.norm", PointKind.FINAL_NORM, "Qwen3RMSNorm", role="final_norm"))
    pts.append(CapturePoint("lm_head", "lm_head", PointKind.LOGITS, "Linear", role="logits"))
    return pts


def _ref(ids: torch.Tensor, window: tuple[int, int], points: list[CapturePoint] | None = None,
         hidden: int = H) -> RefLayout:
    feat = {PointKind.LOGITS: (100,), PointKind.LINEAR: (8,)}
    names = {p.name: (p.kind, p.op, feat.get(p.kind, (hidden,)), "bfloat16") for p in points or _points()}
    n_layers = sum(1 for k, *_r in names.values() if k == PointKind.LAYER)
    return RefLayout(names=names, layer_prefix="model.layers", n_layers=n_layers, token_ids=ids.tolist(), window=window,
                     family="qwen3")


def _oracle(path: Path, ref: RefLayout, emap: dict):
    raw = read_dump(str(path))
    check_slots(raw, ref.n_layers)
    return map_dump(raw, ref, emap)


def _fast(path: Path, ref: RefLayout, emap: dict):
    read = read_window(str(path), ref.window, ref.n_layers)
    return None if read is None else map_window(str(Path(path)), ENGINE, *read[:2], ref, emap, read[2])


def _same_mapping(a, b) -> None:
    for field in ("engine", "path", "positions", "mapping", "notes", "facts", "partial_logits", "unmarked_partials"):
        assert getattr(a, field) == getattr(b, field), field
    assert list(a.mapping) == list(b.mapping) and list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert t.dtype == u.dtype and t.shape == u.shape and torch.equal(t.view(torch.int16), u.view(torch.int16)), name


@pytest.mark.parametrize("window", [(0, T), (5, 21), (T - 16, T), (0, 1), (T - 1, T)])
def test_the_window_read_maps_as_the_whole_file_does(tmp_path, window):
    """Every field of the mapping equals the whole file's (tensors bit for bit, mapping lines,
    notes, facts), for windows at the start, inside, at the end and of one row; the rows are the
    file's own (slot j at positions w0..w1-1) and the read copied the window alone."""
    path = tmp_path / "req.safetensors"
    tensors = _file(path)
    ref, emap = _ref(tensors["token_ids"], window), engine_map("qwen3")
    fast = _fast(path, ref, emap)
    assert fast is not None
    _same_mapping(_oracle(path, ref, emap), fast)
    w0, w1 = window
    assert torch.equal(fast.tensors["model.layers.2"], tensors["hidden_states"][w0:w1, 3])
    assert torch.equal(fast.tensors["model.embed_tokens"], tensors["hidden_states"][w0:w1, 0])
    rows = fast.tensors["model.layers.0"]
    assert rows.untyped_storage().nbytes() == (w1 - w0) * (L + 1) * H * 2  # the window's rows, not the file's
    # vLLM saved each layer's hidden + residual already added: one plain tensor, which the line does not call summed
    assert fast.mapping["model.layers.0"] == "hidden_states[:, 1]"


def test_notes_of_sublayers_and_of_names_the_reference_lacks_are_the_whole_files(tmp_path):
    """A reference traced at sublayers (more names only on its side than a note lists) and a map
    that sends the embedding slot to a name the reference did not capture give the same notes."""
    path = tmp_path / "req.safetensors"
    tensors = _file(path, seed=1)
    ref = _ref(tensors["token_ids"], (10, 26), _points(sublayers=3))
    emap = engine_map("qwen3")
    _same_mapping(_oracle(path, ref, emap), _fast(path, ref, emap))
    emap = {**emap, "model": {**emap["model"], "embed_tokens": [{"hf": "model.other_embedding"}]}}
    fast = _fast(path, ref, emap)
    assert fast is not None and any("did not capture" in n and "model.other_embedding" in n for n in fast.notes)
    _same_mapping(_oracle(path, ref, emap), fast)


def test_what_the_direct_read_does_not_take_is_left_to_the_whole_read(tmp_path):
    """None (the caller then reads the whole file) for a map that is not a plain renaming, two
    slots on one name, another hidden size, another slot count, other token ids, another dtype."""
    path = tmp_path / "req.safetensors"
    tensors = _file(path, seed=2)
    ids, emap = tensors["token_ids"], engine_map("qwen3")
    ref = _ref(ids, (3, 9))
    assert _fast(path, ref, emap) is not None
    split = {**emap, "layer": {**emap["layer"], "": [{"hf": "@layer", "element": 0}]}}
    twice = {**emap, "model": {**emap["model"], "embed_tokens": [{"hf": "model.layers.0"}]}}
    for other in (split, twice):
        assert _fast(path, ref, other) is None
    assert _fast(path, _ref(ids, (3, 9), hidden=H + 1), emap) is None
    assert _fast(path, replace(ref, token_ids=[*ids.tolist()[:5], 7, *ids.tolist()[6:]]), emap) is None
    assert _fast(path, replace(ref, token_ids=ids.tolist()[:-1]), emap) is None
    assert _fast(path, replace(ref, window=(3, T + 1)), emap) is None
    _file(path, slots=L + 2, seed=2)
    assert _fast(path, ref, emap) is None
    _file(path, seed=2, dtype=torch.float8_e4m3fn)
    assert _fast(path, ref, emap) is None
    save_file({"hidden_states": tensors["hidden_states"], "token_ids": -tensors["token_ids"]}, str(path))
    assert _fast(path, ref, emap) is None


# ---------------------------------------------------------------- the compiled capture, end to end


class _Engine:
    """A stand-in for tracer's compiled vLLM engine: the request's hidden-states file is written
    (``tensors``) when the request finishes, at ``path``."""

    remote = False

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.path, self.tensors = path, tensors

    def reset_prefix_cache(self) -> None:
        pass

    def start(self, prompts, max_tokens, extra_args=None):
        self.extra_args = extra_args
        return [("0", "req-0")]

    def finish(self):
        save_file(self.tensors, str(self.path))
        out = SimpleNamespace(kv_transfer_params={"hidden_states_path": str(self.path)}, num_cached_tokens=0,
                              outputs=[SimpleNamespace(token_ids=[11, 12])])
        return {"0": out}

    def facts(self):
        return {"device": "cpu", "model_runner": "stand-in", "compilation_mode": 3}


def _capture(tmp_path, tensors, prompt, window, points, monkeypatch, mode: str, emap: dict | None = None):
    """execute_compiled's run, or its one-line error, and whether the whole file was read. ``mode``:
    ``whole`` (the path before the direct read: ``read_window`` gives way at once), ``direct`` (the
    whole read fails the test), ``either``; ``emap``: the engine map (qwen3's vLLM map)."""
    whole = []
    real = compiled.read_dump
    with monkeypatch.context() as m:
        if mode == "whole":
            m.setattr(compiled, "read_window", lambda *a: None)
        m.setattr(compiled, "read_dump", lambda *a: pytest.fail("the whole file was read") if mode == "direct"
                  else whole.append(1) or real(*a))
        eng = _Engine(tmp_path / "req-0.safetensors", tensors)
        plan = RunPlan("B", ((0, len(prompt)),), "one pass", engine="vllm")
        ref = replace(_ref(torch.tensor(prompt), window, points), token_ids=[], window=(0, 1))  # as ref_layout caches it
        try:
            return (compiled.execute_compiled(eng, None, prompt, plan, points, window, ref, emap or engine_map("qwen3")),
                    bool(whole))
        except TracerError as e:
            return str(e), bool(whole)
        finally:
            assert not eng.path.exists()  # the file is removed either way


def _same_run(a, b) -> None:
    assert (a.name, a.token_ids, a.plan, a.window, a.extras) == (b.name, b.token_ids, b.plan, b.window, b.extras)
    assert list(a.captures) == list(b.captures)
    for name, x in a.captures.items():
        y = b.captures[name]
        assert (x.name, x.kind, x.calls, x.op, x.role) == (y.name, y.kind, y.calls, y.op, y.role), name
        assert x.tensor.dtype == y.tensor.dtype and x.tensor.shape == y.tensor.shape, name
        assert torch.equal(x.tensor.view(torch.int16), y.tensor.view(torch.int16)), name
        assert x.tensor.is_contiguous() and y.tensor.is_contiguous()
    skip = ("wall_s", "phases_s", "hidden_states_file_bytes")  # times; the file's size (a window file's is less)
    meta = lambda r: {k: v for k, v in r.meta.items() if k not in skip}  # noqa: E731
    assert meta(a) == meta(b)
    assert set(a.meta["phases_s"]) == set(b.meta["phases_s"]) == {"request", "file_wait", "read", "map", "captures", "record"}


@pytest.mark.parametrize("window", [(0, T), (7, 23), (T - 16, T)])
def test_the_compiled_capture_gives_the_run_it_gave_before(tmp_path, monkeypatch, window):
    """execute_compiled with the direct read gives the same run, field for field (captures bit for
    bit with their names, kinds, dtypes, calls, ops and roles; the scheduler's mapping and notes;
    every other meta fact), as the whole read it took before; the whole read is not made."""
    tensors = _file(tmp_path / "x.safetensors", seed=3)
    prompt, points = tensors["token_ids"].tolist(), _points(sublayers=1)
    fast, _ = _capture(tmp_path, tensors, prompt, window, points, monkeypatch, "direct")
    before, whole = _capture(tmp_path, tensors, prompt, window, points, monkeypatch, "whole")
    assert not isinstance(fast, str) and not isinstance(before, str) and whole, (fast, before)
    _same_run(before, fast)
    assert torch.equal(fast.captures["model.layers.3"].tensor, tensors["hidden_states"][window[0]:window[1], 4])
    assert fast.meta["scheduler"]["mapping"]["model.layers.3"].startswith("hidden_states[:, 4]")
    rows = (window[1] - window[0]) * (L + 1) * H * 2  # the window's rows of every slot, bf16: no map of the file kept
    assert all(c.tensor.untyped_storage().nbytes() == rows for c in fast.captures.values())


def _damaged(tensors: dict[str, torch.Tensor], how: str) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The file's tensors and the prompt, one of them damaged."""
    ids, hs = tensors["token_ids"], tensors["hidden_states"]
    prompt = ids.tolist()
    if how == "first id":
        prompt[0] += 1
    elif how == "id before the window":
        prompt[20] += 1
    elif how == "id in the window":
        prompt[T - 5] += 1
    elif how == "shorter prompt":
        prompt = prompt[:-3]
    elif how == "slot count":
        tensors = {"token_ids": ids, "hidden_states": torch.cat([hs, hs[:, :1]], dim=1)}
    elif how == "float8":
        tensors = {"token_ids": ids, "hidden_states": hs.to(torch.float8_e4m3fn)}
    elif how == "negative ids":
        tensors = {"token_ids": -ids - 1, "hidden_states": hs}
    elif how == "ids of another length":
        tensors = {"token_ids": ids[:-1], "hidden_states": hs}
    elif how == "flat rows":
        tensors = {"token_ids": ids, "hidden_states": hs.reshape(T, -1)}
    return tensors, prompt


#: each damage and what the whole read makes of it: its one-line error, or None: a run of the
#: positions whose ids match (the whole read maps a prefix of the prompt, with a note)
DAMAGES = {"first id": "do not match the reference prompt in any step",
           "id before the window": "no position is on both sides",
           "id in the window": None, "shorter prompt": None,
           "slot count": "list(range(5))", "float8": "is float8_e4m3fn; tracer compares",
           "negative ids": "or negative", "ids of another length": "do not give one id per row",
           "flat rows": "holds [tokens, layers, hidden]"}


@pytest.mark.parametrize("how", list(DAMAGES))
def test_a_damaged_file_gives_the_one_line_error_or_run_it_gave_before(tmp_path, monkeypatch, how):
    """Token ids other than the prompt's, another slot count, dtype or shape: the direct read
    gives way to the whole read, so the capture says what it said before, in one line (or, where
    the whole read maps the matching prefix of the prompt, gives the same run)."""
    tensors, prompt = _damaged(_file(tmp_path / "x.safetensors", seed=4), how)
    window = (T - 16, T - 3) if how == "shorter prompt" else (T - 16, T)
    now, whole = _capture(tmp_path, tensors, prompt, window, _points(), monkeypatch, "either")
    before, _ = _capture(tmp_path, tensors, prompt, window, _points(), monkeypatch, "whole")
    assert whole  # the direct read gave way
    if DAMAGES[how] is None:
        assert not isinstance(before, str), before
        _same_run(before, now)
        assert any("equal the reference's for their first" in n for n in now.meta["scheduler"]["notes"])
    else:
        assert isinstance(before, str) and DAMAGES[how] in before, before
        assert now == before and "\n" not in before


def test_a_map_that_names_no_point_gives_the_error_the_whole_read_gave(tmp_path, monkeypatch):
    """A map that sends every slot to no HF name (``-``) places no position: the whole read refused
    the file ("no position is on both sides"); the direct read mapped it onto nothing, and the
    capture then said that the file "mapped onto none of the run's capture points" instead."""
    tensors = _file(tmp_path / "x.safetensors", seed=6)
    prompt, q = tensors["token_ids"].tolist(), engine_map("qwen3")
    emap = {**q, "model": {**q["model"], "embed_tokens": [{"hf": "-"}]}, "layer": {**q["layer"], "": [{"hf": "-"}]}}
    now, whole = _capture(tmp_path, tensors, prompt, (T - 16, T), _points(), monkeypatch, "either", emap)
    before, _ = _capture(tmp_path, tensors, prompt, (T - 16, T), _points(), monkeypatch, "whole", emap)
    assert isinstance(before, str) and "no position is on both sides" in before, before
    assert now == before and whole


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_token_ids_are_read_as_the_ids_they_hold_or_refused_in_one_line(tmp_path, dtype):
    """token_ids of an unsigned dtype wider than 8 bits (torch compares none of them with 0) made
    the whole read raise NotImplementedError, a traceback. Ids that int64 holds are the prompt's,
    read alike by both paths (as the named-tensors reader widens input_ids); uint64 ids from 2**63
    on are negative once widened and refused as negative ids are, in one line."""
    path = tmp_path / "req.safetensors"
    tensors = _file(path, seed=5)
    ids, hs = tensors["token_ids"], tensors["hidden_states"]
    save_file({"hidden_states": hs, "token_ids": ids.to(dtype)}, str(path))
    ref, emap = _ref(ids, (T - 16, T)), engine_map("qwen3")
    whole, fast = _oracle(path, ref, emap), _fast(path, ref, emap)
    assert fast is not None
    _same_mapping(whole, fast)
    assert torch.equal(fast.tensors["model.layers.1"], hs[T - 16:, 2])
    if dtype == torch.uint64:
        wide = ids.clone()
        wide[3] = -7  # 2**64 - 7 as uint64
        save_file({"hidden_states": hs, "token_ids": wide.view(torch.uint64)}, str(path))
        assert _fast(path, ref, emap) is None
        with pytest.raises(TracerError, match="or negative") as e:
            _oracle(path, ref, emap)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("short", [1, 0])
def test_a_file_over_the_input_budget_is_refused_as_the_whole_read_refused_it(tmp_path, monkeypatch, short):
    """The whole read charges the file, the int64 ids and positions (16 bytes a token) and the
    rows regrouped by slot to the input budget: with a budget one byte short of that the direct
    read gives way and the capture says what the whole read says; at that budget exactly the
    direct read is taken and gives the same run."""
    tensors = _file(tmp_path / "x.safetensors", seed=7)  # the bytes the stand-in engine writes again
    total = (tmp_path / "x.safetensors").stat().st_size + 16 * T + T * (L + 1) * H * 2
    monkeypatch.setenv("TRACER_INPUT_BUDGET", str(total - short))
    prompt = tensors["token_ids"].tolist()
    now, whole = _capture(tmp_path, tensors, prompt, (T - 16, T), _points(), monkeypatch, "either")
    before, _ = _capture(tmp_path, tensors, prompt, (T - 16, T), _points(), monkeypatch, "whole")
    if short:
        assert isinstance(before, str) and "over the input budget" in before, before
        assert now == before and whole
    else:
        assert not isinstance(before, str) and not whole, before
        _same_run(before, now)


# ---------------------------------------------------------------- files written for a window alone


def _window_file(path: Path, whole: dict[str, torch.Tensor], rows: tuple[int, int], **changed) -> dict:
    """What tracer's connector writes when a request names the window ``rows``: the whole file's rows of
    positions w0..w1-1 (a slice of ``whole``, the oracle), every token id, and ``window``; ``changed``
    replaces tensors."""
    w0, w1 = rows
    tensors = {"hidden_states": whole["hidden_states"][w0:w1].clone(), "token_ids": whole["token_ids"],
               "window": torch.tensor([w0, w1]), **changed}
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize(("written", "asked"), [((0, T), (0, T)), ((5, 21), (5, 21)), ((5, 21), (9, 12)),
                                                ((T - 16, T), (T - 1, T))])
def test_a_window_file_gives_the_rows_the_whole_file_gives(tmp_path, written, asked):
    """A file of the written window's rows alone, read directly for that window or one inside it, maps
    onto the same captures as the whole file (bit for bit, mapping lines, notes, positions)."""
    whole_path, path = tmp_path / "whole.safetensors", tmp_path / "window.safetensors"
    whole = _file(whole_path, seed=5)
    _window_file(path, whole, written)
    ref, emap = _ref(whole["token_ids"], asked), engine_map("qwen3")
    fast = _fast(path, ref, emap)
    assert fast is not None
    expected = _oracle(whole_path, ref, emap)
    fast = replace(fast, path=expected.path)
    _same_mapping(expected, fast)
    assert torch.equal(fast.tensors["model.layers.1"], whole["hidden_states"][asked[0]:asked[1], 2])


def test_a_window_file_read_whole_holds_its_positions_alone(tmp_path):
    """``read_dump`` of a window file: positions w0..w1-1 with their token ids, one entry per slot of
    w1 - w0 rows, the window and prompt length in the facts; mapped, the same tensors as the whole file."""
    whole_path, path = tmp_path / "whole.safetensors", tmp_path / "window.safetensors"
    whole = _file(whole_path, seed=6)
    _window_file(path, whole, (20, 30))
    raw = read_dump(str(path))
    assert raw.tokens[0]["positions"].tolist() == list(range(20, 30))
    assert torch.equal(raw.tokens[0]["input_ids"], whole["token_ids"][20:30])
    assert raw.facts["window"] == [20, 30] and raw.facts["prompt_tokens"] == T
    assert [e.tensor.shape for e in raw.entries] == [(10, H)] * (L + 1)
    ref, emap = _ref(whole["token_ids"], (20, 30)), engine_map("qwen3")
    got, expected = map_dump(raw, ref, emap), _oracle(whole_path, ref, emap)
    assert got.positions == expected.positions and list(got.tensors) == list(expected.tensors)
    for name, t in expected.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.int16), t.view(torch.int16)), name


@pytest.mark.parametrize("how", ["float", "three", "reversed", "past-the-prompt", "rows-mismatch", "negative"])
def test_a_damaged_window_is_one_line_and_never_read_directly(tmp_path, how):
    """A ``window`` that does not name the file's rows inside its prompt: the direct read gives way and the
    whole read refuses in one line naming the file."""
    path = tmp_path / "window.safetensors"
    whole = _file(tmp_path / "whole.safetensors", seed=7)
    window = {"float": torch.tensor([4.0, 8.0]), "three": torch.tensor([4, 8, 9]), "reversed": torch.tensor([8, 4]),
              "past-the-prompt": torch.tensor([T - 2, T + 2]), "rows-mismatch": torch.tensor([4, 9]),
              "negative": torch.tensor([-4, 0])}[how]
    _window_file(path, whole, (4, 8), window=window)
    assert _fast(path, _ref(whole["token_ids"], (4, 8)), engine_map("qwen3")) is None
    with pytest.raises(TracerError) as e:
        read_dump(str(path))
    assert "window" in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_window_files_token_ids_of_two_dims_are_named_as_the_fault(tmp_path):
    """A window file whose ``token_ids`` are ``[1, T]`` (a batch row, not vLLM's ``[T]``): the error names
    the token ids and their shape, not the (sound) window."""
    path = tmp_path / "window.safetensors"
    whole = _file(tmp_path / "whole.safetensors", seed=8)
    _window_file(path, whole, (4, 8), token_ids=whole["token_ids"][None])
    assert _fast(path, _ref(whole["token_ids"], (4, 8)), engine_map("qwen3")) is None
    with pytest.raises(TracerError) as e:
        read_dump(str(path))
    msg = str(e.value)
    assert f"token_ids (1, {T})" in msg and "its window" not in msg and str(path) in msg and "\n" not in msg


def test_a_window_outside_the_files_rows_is_left_to_the_whole_read(tmp_path):
    """Asked for positions the window file does not hold: no direct read; the whole read maps what it
    holds (the compared positions it lacks are the whole read's to report)."""
    path = tmp_path / "window.safetensors"
    whole = _file(tmp_path / "whole.safetensors", seed=8)
    _window_file(path, whole, (10, 20))
    emap = engine_map("qwen3")
    for asked in ((5, 15), (15, 25), (0, T)):
        assert _fast(path, _ref(whole["token_ids"], asked), emap) is None


class _WindowEngine(_Engine):
    """The stand-in engine writing what tracer's connector writes for the window the request names."""

    def finish(self):
        from tracer.engines.vllm.hidden_states import requested_window

        params = (self.extra_args or {}).get("kv_transfer_params")
        w = requested_window(params, self.tensors["token_ids"].numel())
        self.tensors = {**self.tensors, "hidden_states": self.tensors["hidden_states"][w[0]:w[1]].clone(),
                        "window": torch.tensor(list(w))}
        return super().finish()


@pytest.mark.parametrize("window", [(0, T), (T - 16, T), (7, 8)])
def test_the_compiled_capture_asks_for_its_window_and_reads_it_directly(tmp_path, monkeypatch, window):
    """execute_compiled names its window in the request (``kv_transfer_params``), reads the window file
    without the whole read, and gives the run the whole file gave (captures bit for bit)."""
    tensors = _file(tmp_path / "whole.safetensors", seed=9)
    prompt = tensors["token_ids"].tolist()
    expected, _ = _capture(tmp_path, tensors, prompt, window, _points(), monkeypatch, "direct")
    monkeypatch.setattr(sys.modules[__name__], "_Engine", _WindowEngine)
    got, whole_read = _capture(tmp_path, tensors, prompt, window, _points(), monkeypatch, "direct")
    assert not whole_read
    _same_run(expected, got)
    whole_bytes = expected.meta["hidden_states_file_bytes"]
    assert whole_bytes == (tmp_path / "whole.safetensors").stat().st_size
    row_bytes = (L + 1) * H * 2
    extra = got.meta["hidden_states_file_bytes"] - (whole_bytes - (T - (window[1] - window[0])) * row_bytes)
    assert 16 <= extra <= 16 + 128  # the window tensor's 16 bytes and its header entry: the other rows are gone


def test_the_connector_takes_a_window_only_where_it_fits_the_prompt():
    """``requested_window``: two ints 0 <= w0 < w1 <= n; anything else (no window, floats, bools, three
    numbers, reversed, past the prompt) gives None, so the whole file is written."""
    from tracer.engines.vllm.hidden_states import WINDOW_PARAM, requested_window, window_params

    assert requested_window(window_params((3, 9))["kv_transfer_params"], 9) == (3, 9)
    assert requested_window({WINDOW_PARAM: (0, 1)}, 1) == (0, 1)
    for bad in (None, {}, {"other": [1, 2]}, {WINDOW_PARAM: [1.0, 2.0]}, {WINDOW_PARAM: [True, 2]},
                {WINDOW_PARAM: [1, 2, 3]}, {WINDOW_PARAM: [5, 5]}, {WINDOW_PARAM: [6, 5]}, {WINDOW_PARAM: [-1, 2]},
                {WINDOW_PARAM: [3, 10]}, {WINDOW_PARAM: "3:9"}, [3, 9]):
        assert requested_window(bad, 9) is None, bad


@pytest.mark.parametrize("differs_at", [0, 10, 19, 20, 30, 39, 50])
def test_a_window_file_of_another_prompt_is_compared_where_the_whole_file_is(tmp_path, differs_at):
    """A window file records the request's whole prompt: where it differs from the reference's
    before the window, no row of the window was computed from the reference's prompt, and the whole
    file of that request is refused (one line); the window file was compared as if it matched.
    Where it differs inside the window, the rows before the difference alone are compared, as the
    whole file's are; after the window, every row."""
    whole_path, path = tmp_path / "whole.safetensors", tmp_path / "window.safetensors"
    whole = _file(whole_path, seed=10)
    _window_file(path, whole, (20, 40))
    prompt = whole["token_ids"].clone()
    prompt[differs_at] += 1  # the reference's prompt: the file's, but for one token
    ref, emap = _ref(prompt, (20, 40)), engine_map("qwen3")
    try:
        expected = _oracle(whole_path, ref, emap)
    except TracerError as e:
        assert differs_at < 21 and "\n" not in str(e)  # nothing before the difference inside the window
        with pytest.raises(TracerError) as got:
            _oracle(path, ref, emap)
        assert str(path) in str(got.value) and "\n" not in str(got.value)
        return
    got = _oracle(path, ref, emap)
    assert got.positions == expected.positions == (20, min(differs_at, 40))
    assert list(got.tensors) == list(expected.tensors)
    for name, t in expected.tensors.items():
        assert torch.equal(got.tensors[name].view(torch.int16), t.view(torch.int16)), name
    # the window's rows after the difference were dumped, for other ids: never "not dumped by the engine"
    for mapped in (got, expected):
        left = [n for n in mapped.notes if n.startswith("positions only in the reference")]
        if differs_at < 40:
            span = f"{differs_at}..39" if differs_at < 39 else "39"
            assert left == [f"positions only in the reference: {span} (dumped, but for other token ids "
                            "than the reference's: another prompt)"], mapped.notes
        else:
            assert left == [], mapped.notes
