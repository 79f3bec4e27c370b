"""Seeded mutation fuzz of an unfinished audit's folder (``OUT.h5.checks``), as for traces and sweep files.

A folder kept after two finished checks is copied and mutated: a kept row's bytes or fields (status,
counts, first divergent point, key, fingerprint, seal), a part trace's bytes, a part swapped for
another check's (its row re-sealed to it), the audit's header; a file replaced by a FIFO, a folder
or a link to ``/dev/zero``; a file removed. Resuming the audit on the mutated folder must give the
uninterrupted audit's rows (a row that is not borne out by its part runs again) or a one-line
TracerError: never another answer, a traceback, a hang or a crash. A worker process (restarted after
a hang or crash) resumes each case; the parent bounds it with a timeout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from tests.helpers import Worker

N_CASES = int(os.environ.get("TRACER_AUDIT_FUZZ_CASES", "24"))
SEED = 37
CASE_TIMEOUT_S = 300.0
KW = dict(levels="0,1", length=40, progress=False)


def outcome(out: str):
    """``("ok", rows)`` of the audit resumed on ``out``, ``("error", message)`` for a TracerError, else
    ``("exception", ...)``."""
    import tracer
    from tracer.errors import TracerError
    from tracer.loops.audit import row_record

    global _LOADED
    try:
        res = tracer.audit(_LOADED, output=out, **KW)
        return "ok", json.dumps([row_record(r) for r in res.rows], sort_keys=True)
    except TracerError as e:
        return "error", str(e)
    except Exception as e:  # noqa: BLE001 - the fuzz reports it as a failure
        return "exception", f"{type(e).__name__}: {e}"


_LOADED = None


def _worker(conn) -> None:
    import torch

    import tracer

    global _LOADED
    torch.set_num_threads(min(2, torch.get_num_threads()))  # as tests/conftest.py: the header (and fingerprint) match
    _LOADED = tracer.load_model("tiny-llama", dtype="bfloat16", device="cpu")
    while True:
        path = conn.recv()
        if path is None:
            return
        conn.send(outcome(path))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A folder kept after two of the audit's three checks (levels 0 and 1, N = 40)."""
    import tracer

    d = tmp_path_factory.mktemp("kept")
    lm = tracer.load_model("tiny-llama", dtype="bfloat16", device="cpu")
    seen = []

    def stop_after_two(row):
        seen.append(row)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tracer.audit(lm, output=str(d / "cut.h5"), on_row=stop_after_two, **KW)
    folder = d / "cut.h5.checks"
    assert len(list(folder.glob("*.h5"))) == 2
    return folder


def _flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    kind = rng.choice(("flip", "byte", "truncate"))
    at = rng.randrange(len(data))
    if kind == "flip":
        data[at] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        data[at] = rng.randrange(256)
    else:
        del data[at:]
    path.write_bytes(bytes(data))
    return f"{kind}@{at}"


def _edit_row(path: Path, rng: random.Random) -> str:
    row = json.loads(path.read_text())
    key = rng.choice(("status", "first_divergent", "max_abs_logit_diff", "argmax_flips", "last_layer", "key",
                      "fingerprint", "part_sha256", "mitigations", "level", "scenario"))
    value = rng.choice(({"passed": "failed", "failed": "passed"}.get(row.get("status"), "passed"), "model.layers.0",
                        1.5, 3, [1, 2], None, "x" * 40, {"deterministic": True}, -1, [], {}))
    row[key] = value
    path.write_text(json.dumps(row))
    return f"row.{key}={value!r}"


def _replace(path: Path, rng: random.Random) -> str:
    kind = rng.choice(("fifo", "folder", "devzero", "remove"))
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    return kind


def _swap_parts(folder: Path, rng: random.Random) -> str:
    """One part copied over another's, its row re-sealed to it (a seal anyone can compute)."""
    from tracer.files import sha256_file

    a, b = rng.sample(sorted(folder.glob("*.h5")), 2)
    shutil.copy(a, b)
    row_path = b.with_suffix(".json")
    row = json.loads(row_path.read_text())
    row["part_sha256"] = sha256_file(b)
    row_path.write_text(json.dumps(row))
    return f"{a.name} over {b.name}, re-sealed"


def mutate(folder: Path, rng: random.Random) -> str:
    rows = sorted(p for p in folder.glob("*.json") if p.name != "audit.json")
    parts = sorted(folder.glob("*.h5"))
    what = rng.choice(("row bytes", "row field", "row file", "part bytes", "part file", "swap", "header bytes",
                       "header file", "header field"))
    if what == "row bytes":
        p = rng.choice(rows)
        return f"{p.name}: {_flip(p, rng)}"
    if what == "row field":
        p = rng.choice(rows)
        return f"{p.name}: {_edit_row(p, rng)}"
    if what == "row file":
        p = rng.choice(rows)
        return f"{p.name}: {_replace(p, rng)}"
    if what == "part bytes":
        p = rng.choice(parts)
        return f"{p.name}: {_flip(p, rng)}"
    if what == "part file":
        p = rng.choice(parts)
        return f"{p.name}: {_replace(p, rng)}"
    if what == "swap":
        return _swap_parts(folder, rng)
    header = folder / "audit.json"
    if what == "header bytes":
        return f"audit.json: {_flip(header, rng)}"
    if what == "header file":
        return f"audit.json: {_replace(header, rng)}"
    doc = json.loads(header.read_text())
    doc["fingerprint"] = "0" * 64
    header.write_text(json.dumps(doc))
    return "audit.json: another fingerprint"


def test_mutated_audit_folders_resume_to_the_right_rows_or_one_line_error(template, tmp_path):
    worker = Worker(_worker)
    try:
        status, whole = worker.ask(str(tmp_path / "whole" / "audit.h5"), CASE_TIMEOUT_S)
        assert status == "ok", whole
        rng = random.Random(SEED)
        bad, counts = [], {"ok": 0, "error": 0}
        for i in range(N_CASES):
            case = tmp_path / f"case{i}"
            case.mkdir()
            folder = case / "audit.h5.checks"
            shutil.copytree(template, folder)
            what = mutate(folder, rng)
            status, text = worker.ask(str(case / "audit.h5"), CASE_TIMEOUT_S)
            if status == "ok" and text == whole:
                counts["ok"] += 1
            elif status == "error" and "\n" not in text and text:
                counts["error"] += 1
            else:
                bad.append((what, status, text[:300]))
            shutil.rmtree(case, ignore_errors=True)
        assert not bad, bad
        assert counts["ok"] and counts["error"], counts  # both kinds of outcome were reached
    finally:
        worker.close()
