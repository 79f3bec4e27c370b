"""Seeded mutation fuzz of a small real trace (issue 16): every outcome is the original result or a
one-line TracerError; never a silent wrong answer, a traceback, a hang or a crash.

A worker process (spawned once, restarted after a hang or crash) opens each mutated copy through
the public reader (header, runs, run metadata, stored comparisons) and compares its two runs;
the parent bounds each case with a timeout. The original answer comes from the unmutated file.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from tests.helpers import Worker

N_CASES = int(os.environ.get("TRACER_FUZZ_CASES", "240"))
SEED = 16
CASE_TIMEOUT_S = 20.0


def outcome(path: str):
    """What a user sees: ``("ok", summary)`` or ``("error", message)`` for a TracerError; any
    other exception is ``("exception", type and message)``."""
    import tracer
    from tracer.errors import TracerError

    try:
        with tracer.read_trace(path) as r:
            runs = [(name, r.run(name, load_tensors=False)) for name in r.runs]
            shown = (r.header, [(n, rec.token_ids, rec.window, rec.plan, rec.meta, list(rec.captures)) for n, rec in runs],
                     r.comparisons())
            tensors = {(n, cap): r.tensor(n, cap).view(-1).float().sum().item() for n, _ in runs for cap in r.capture_names(n)}
        c = tracer.compare_trace(path, device="cpu")
        points = [(p.name, p.diff.n_diff, p.diff.max_abs_diff) for p in c.points]
        from tracer.diff.stored import stored_comparison
        from tracer.report.tables import to_markdown

        stored = stored_comparison(path)
        rendered = (to_markdown(c), to_markdown(stored) if stored is not None else None)
        return "ok", repr((shown, sorted(tensors.items()), c.verdict(), c.identical, points,
                           [s.to_dict() for s in c.skipped], c.check("any"), rendered))
    except TracerError as e:
        return "error", str(e)
    except Exception as e:  # noqa: BLE001 - the fuzz reports it as a failure
        return "exception", f"{type(e).__name__}: {e}"


def _worker(conn) -> None:
    import torch

    torch.set_num_threads(1)
    while True:
        path = conn.recv()
        if path is None:
            return
        conn.send(outcome(path))


def mutate(data: bytearray, rng: random.Random) -> tuple[bytearray, str]:
    """One mutation: a bit flip, a random byte, a zeroed block or a truncation."""
    out = bytearray(data)
    kind = rng.choice(("flip", "byte", "zero", "truncate"))
    at = rng.randrange(len(out))
    if kind == "flip":
        out[at] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        out[at] = rng.randrange(256)
    elif kind == "zero":
        n = rng.randrange(1, 256)
        out[at:at + n] = bytes(len(out[at:at + n]))
    else:
        del out[at:]
    return out, f"{kind}@{at}"


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    """A real trace of tiny-llama (prefix-cache, float32, 24 tokens) made by this test."""
    import tracer

    path = tmp_path_factory.mktemp("fuzz") / "t.h5"
    tracer.run("tiny-llama", prompt="ab" * 12, device="cpu", dtype="float32", output=str(path), progress=False,
               block_size=16)
    return path


def test_mutations_give_the_original_result_or_one_line_error(small_trace, tmp_path):
    worker = Worker(_worker)
    try:
        status, original = worker.ask(str(small_trace), 120)
        assert status == "ok", original
        data = bytearray(small_trace.read_bytes())
        rng = random.Random(SEED)
        bad, counts = [], {"ok": 0, "error": 0}
        case = tmp_path / "case.h5"
        for i in range(N_CASES):
            mutated, what = mutate(data, rng)
            case.write_bytes(mutated)
            status, detail = worker.ask(str(case), CASE_TIMEOUT_S)
            if status == "ok" and detail == original:
                counts["ok"] += 1
            elif status == "error" and "\n" not in detail and detail:
                counts["error"] += 1
            else:
                bad.append((i, what, status, detail if status != "ok" else "a different answer"))
                shutil.copy(case, tmp_path / f"bad-{i}.h5")
        assert not bad, f"{len(bad)} of {N_CASES} mutations gave a wrong answer, traceback, hang or crash: {bad[:5]}"
        assert counts["error"] > N_CASES // 4  # most mutations hit data or metadata and are caught
    finally:
        worker.close()


# ---------------------------------------------------------------- re-sealed mode (issue 24 item 8)

N_RESEALED = int(os.environ.get("TRACER_RESEAL_CASES", "120"))
_WILD = ["x", 5, -1, 0, None, True, [], {}, [1, "a"], {"a": 1}, 2**70, 1.5, -(2**40), [[[[]]]], "\x1b[31m", [0, 10**30]]


def _paths(doc, prefix=()):
    """Every (path, value) inside a JSON document, containers included."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _reseal(path: Path, rng: random.Random) -> str:
    """Replace one value somewhere in one JSON attribute (header, a run's plan/meta/index, a stored
    comparison) and recompute every checksum that covers it."""
    import json

    import h5py

    from tracer.store.crc import crc32_bytes
    from tracer.store.integrity import seal, set_text

    with h5py.File(path, "r+") as f:
        targets = [("header", "json")] + [(f"runs/{r}", k) for r in f["runs"] for k in ("plan", "meta", "index")]
        targets += [(f"comparisons/{c}", "json") for c in f.get("comparisons", {})]
        group, key = rng.choice(targets)
        g = f[group]
        doc = json.loads(g.attrs[key])
        paths = [p for p, _ in _paths(doc) if p]
        where = rng.choice(paths)
        node = doc
        for step in where[:-1]:
            node = node[step]
        node[where[-1]] = rng.choice(_WILD)
        if key == "index":
            texts = [json.dumps(e) for e in doc]
            set_text(g, "index", "[" + ", ".join(texts) + "]")
            set_text(g, "index_crc32", json.dumps([[len(t.encode()), crc32_bytes(t.encode())] for t in texts]))
        else:
            set_text(g, key, json.dumps(doc))
        seal(g)
    return f"{group}.{key}{list(where)}"


def test_resealed_json_edits_give_an_answer_or_one_line_error(small_trace, tmp_path):
    """Edits with every CRC recomputed (as the public spec allows) may change the answer, but never
    give a traceback, a hang or a crash (on main before issue 24: exit 3 at 15+ places)."""
    worker = Worker(_worker)
    try:
        rng = random.Random(SEED + 24)
        bad, counts = [], {"ok": 0, "error": 0}
        case = tmp_path / "case.h5"
        for i in range(N_RESEALED):
            shutil.copy(small_trace, case)
            what = _reseal(case, rng)
            status, detail = worker.ask(str(case), CASE_TIMEOUT_S)
            if status == "ok" or (status == "error" and detail and "\n" not in detail):
                counts[status] += 1
            else:
                bad.append((i, what, status, detail[:300]))
                shutil.copy(case, tmp_path / f"bad-{i}.h5")
        assert not bad, f"{len(bad)} of {N_RESEALED} re-sealed edits gave a traceback, hang or crash: {bad[:5]}"
        assert counts["error"] > N_RESEALED // 4, counts  # most edits are refused by the validation
    finally:
        worker.close()
