"""The audit on disk: every finished check kept at once, an interrupted audit resumed, one trace at the end.

While ``tracer audit -o OUT.h5`` runs, each finished check lands in the folder ``OUT.h5.checks/``:

- ``audit.json``: the audit's header (the trace header: environment, model and its numeric
  contract, prompt length, every planned check's scenario, the audit's own options) and its
  fingerprint (SHA-256 of the header as canonical JSON);
- ``<check key>.h5``: a complete trace of that check's runs and comparisons (mitigation re-runs
  included), written atomically like any trace; absent for a skipped check;
- ``<check key>.json``: the check's row (:class:`~tracer.loops.audit.AuditRow` as a record), written
  last, atomically: a check counts as finished only once this file exists.

A later ``tracer audit`` with the same output path and the same fingerprint reuses every finished
check (its row read back bit for bit) and runs the others; another fingerprint is refused unless
``--overwrite``. When every check is finished the parts are merged into ``OUT.h5`` (runs
``<key>.A``/``.B``, comparisons ``/comparisons/<key>``, the header with ``audit_rows`` and
``audit_fingerprint``) and the folder is removed. A complete ``OUT.h5`` of the same fingerprint is
reused whole (nothing runs). Interrupting loses at most the check that was running.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tracer.errors import TracerError
from tracer.store.trace import TraceReader, TraceWriter, json_safe

SUFFIX = ".checks"
#: the header keys that hold the audit's own state (not part of the fingerprint)
STATE_KEYS = ("audit_rows", "audit_fingerprint")


def fingerprint(header: dict[str, Any]) -> str:
    """SHA-256 (hex) of ``header`` as canonical JSON (sorted keys), the state keys left out."""
    doc = {k: v for k, v in header.items() if k not in STATE_KEYS}
    return hashlib.sha256(json.dumps(json_safe(doc), sort_keys=True, default=str).encode()).hexdigest()


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if k not in STATE_KEYS and old.get(k) != new.get(k))
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "") if keys else "the header"


def _write_json(path: Path, doc: Any) -> None:
    """``doc`` as JSON at ``path``, atomically (a temporary sibling renamed onto it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class AuditStore:
    """The on-disk state of one audit (see the module docstring).

    Args:
        out: the audit's trace. header: the header this audit would write (fingerprinted).
        overwrite: start over: an earlier folder or trace of any fingerprint is discarded.

    Attributes:
        reused: the rows of a complete ``out`` of the same fingerprint (then nothing needs to
            run), else None.

    Raises:
        TracerError: ``out`` or its folder holds another audit (other parameters) or another kind
            of file and ``overwrite`` is not given; the folder cannot be created.
    """

    def __init__(self, out: str | os.PathLike, header: dict[str, Any], *, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.folder = self.out.with_name(self.out.name + SUFFIX)
        self.header = header
        self.fingerprint = fingerprint(header)
        self.overwrite = overwrite
        self.reused: list[dict[str, Any]] | None = None
        if self.out.exists() and not overwrite:
            self.reused = self._complete_rows()
        if self.folder.exists() and (overwrite or self.reused is not None):
            shutil.rmtree(self.folder)  # starting over, or left over from before a finished merge
        if self.reused is not None:
            return
        if self.folder.exists():
            self._check_folder()
        else:
            try:
                self.folder.mkdir(parents=True)
            except OSError as e:
                raise TracerError(f"cannot create {self.folder} ({e.strerror or e}); choose another --output") from None
            _write_json(self.folder / "audit.json", {"fingerprint": self.fingerprint, "header": header})

    def _complete_rows(self) -> list[dict[str, Any]]:
        """The rows of ``out`` when it is a complete audit of this fingerprint; else an error."""
        try:
            with TraceReader(self.out) as r:
                old = r.header
        except TracerError:
            raise TracerError(f"{self.out} exists and is not a complete trace; pass --overwrite to replace it "
                              "or choose another --output") from None
        if "audit_rows" not in old:
            raise TracerError(f"{self.out} exists and holds no audit; pass --overwrite to replace it or choose "
                              "another --output")
        if old.get("audit_fingerprint") != self.fingerprint:
            raise TracerError(f"{self.out} holds an audit with other parameters ({_differences(old, self.header)} "
                              "differ); pass --overwrite to re-run it or choose another --output")
        return list(old["audit_rows"])

    def _check_folder(self) -> None:
        try:
            doc = json.loads((self.folder / "audit.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise TracerError(f"{self.folder} is not the folder of an unfinished audit; remove it, pass --overwrite "
                              "or choose another --output") from None
        if doc.get("fingerprint") != self.fingerprint:
            raise TracerError(f"{self.folder} holds an unfinished audit with other parameters "
                              f"({_differences(doc.get('header') or {}, self.header)} differ); re-run with the same "
                              "options to resume it, pass --overwrite to start over, or choose another --output")

    def finished(self) -> dict[str, dict[str, Any]]:
        """Check key → row record of every finished check in the folder."""
        out = {}
        for p in sorted(self.folder.glob("*.json")):
            if p.name == "audit.json":
                continue
            try:
                rec = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # not finished: it runs again
            if rec.get("key") == p.stem:
                out[p.stem] = rec
        return out

    def part(self, key: str) -> Path:
        """The trace file of check ``key``'s runs."""
        return self.folder / f"{key}.h5"

    def keep(self, key: str, record: dict[str, Any]) -> None:
        """Mark check ``key`` finished with its row ``record`` (after its trace part is complete)."""
        _write_json(self.folder / f"{key}.json", {**record, "key": key})

    def merge(self, keys: list[str], rows: list[dict[str, Any]]) -> Path:
        """Write ``out``: the header with the rows and the fingerprint, then every check's runs and
        comparisons from its part, in ``keys`` order; then remove the folder.

        Raises:
            TracerError: a part cannot be read (damaged: remove it and re-run), ``out`` cannot be written.
        """
        header = {**self.header, "audit_rows": rows, "audit_fingerprint": self.fingerprint}
        with TraceWriter(self.out, header=header, overwrite=self.overwrite or self.out.exists()) as w:
            for key in keys:
                part = self.part(key)
                if not part.exists():
                    continue
                with TraceReader(part) as r:
                    for name in r.runs:
                        w.add_run(r.run(name))
                    for name, doc in r.comparisons().items():
                        w.add_comparison(name, doc)
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.out
