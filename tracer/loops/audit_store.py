"""The audit on disk: every finished check kept at once, an interrupted audit resumed, one trace at the end.

While ``tracer audit -o OUT.h5`` runs, each finished check lands in the folder ``OUT.h5.checks/``:

- ``audit.json``: the audit's header (the trace header: environment, model and its numeric
  contract, prompt length, every planned check's scenario, the audit's own options) and its
  fingerprint (SHA-256 of the header as canonical JSON);
- ``<check key>.h5``: a complete trace of that check's runs and comparisons (mitigation re-runs
  included), written atomically like any trace;
- ``<check key>.json``: the check's row (:class:`~tracer.loops.audit.AuditRow` as a record), sealed
  with the audit's fingerprint and the SHA-256 of its part trace, written last, atomically.

A check counts as finished only when its row's seal holds: the row is a regular file that passes
the input gate (:func:`tracer.files.check_input_file`: a FIFO or a folder under that name never
blocks the resume), it names its own check and this audit's fingerprint, and its part trace exists
with the SHA-256 the row was sealed with; the audit then derives the row again from the part's
stored comparison (:func:`tracer.loops.audit.believed`). A row that fails any of this is not believed:
its check runs again, and the plan says why.

The folder is claimed by one writer (:class:`FolderClaim`: an exclusive ``flock`` on the folder,
released when the process ends, however it ends): a second ``tracer audit`` of the same output is
refused in one line before it loads a model.

A later ``tracer audit`` with the same output path and the same fingerprint reuses every finished
check (its row read back bit for bit) and runs the others; another fingerprint is refused unless
``--overwrite``. When every check is finished the parts are merged into ``OUT.h5`` (runs
``<key>.A``/``.B``, comparisons ``/comparisons/<key>``, the header with ``audit_rows`` and
``audit_fingerprint``) and the folder is removed. A complete ``OUT.h5`` of the same fingerprint is
reused whole (nothing runs). Interrupting loses at most the check that was running.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tracer.errors import TracerError
from tracer.files import check_input_file, sha256_file, shown_path
from tracer.store.trace import TraceReader, TraceWriter, json_safe

SUFFIX = ".checks"
#: the largest row or header file of the folder read (bytes); a row is a few kB, a header tens of kB
MAX_STATE_BYTES = 64 << 20
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


def _read_json(path: Path, what: str) -> Any:
    """The JSON document of a state file, through the input gate (a regular file of at most
    :data:`MAX_STATE_BYTES`; a FIFO, folder or device refused before anything opens it).

    Raises:
        TracerError: not a regular file, too large, unreadable, not UTF-8 JSON.
    """
    from tracer.files import read_bounded

    check_input_file(path, what, MAX_STATE_BYTES)
    try:
        return json.loads(read_bounded(path, MAX_STATE_BYTES).decode("utf-8"))
    except OSError as e:
        raise TracerError(f"cannot read {what} {shown_path(path)} ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise TracerError(f"{what} {shown_path(path)} is not a JSON document") from None


class FolderClaim:
    """One writer's claim on an audit's folder ``OUT.h5.checks``: the folder exists (created if
    needed) and this process holds an exclusive ``flock`` on it until :meth:`release` or its end.

    Raises:
        TracerError: another process holds the folder (a running ``tracer audit`` of the same
            output); the folder cannot be created or opened (a file of that name, no permission).
    """

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.folder = self.out.with_name(self.out.name + SUFFIX)
        self.created = False
        try:
            self.folder.mkdir(parents=True)
            self.created = True
        except FileExistsError:
            pass
        except OSError as e:
            raise TracerError(f"cannot create {shown_path(self.folder)} ({e.strerror or e}); choose another --output") from None
        try:
            self.fd: int | None = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                                          | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise TracerError(f"{shown_path(self.folder)} is not a folder this audit can use ({e.strerror or e}); "
                              "remove it or choose another --output") from None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no claim
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise TracerError(f"another tracer audit is writing {shown_path(self.out)} (it holds "
                              f"{shown_path(self.folder)}); wait for it to finish, or choose another --output") from None

    def release(self, remove: bool = False) -> None:
        """Give the claim up (idempotent); ``remove``: also remove the folder when this claim
        created it and it is still empty (a failure before the audit wrote anything)."""
        if remove and self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class AuditStore:
    """The on-disk state of one audit (see the module docstring).

    Args:
        out: the audit's trace. header: the header this audit would write (fingerprinted).
        overwrite: start over: an earlier folder or trace of any fingerprint is discarded.
        claim: this process's :class:`FolderClaim` on the folder (taken here when not given).

    Attributes:
        reused: the rows of a complete ``out`` of the same fingerprint (then nothing needs to
            run), else None.

    Raises:
        TracerError: ``out`` or its folder holds another audit (other parameters) or another kind
            of file and ``overwrite`` is not given; another process holds the folder; the folder
            cannot be created.
    """

    def __init__(self, out: str | os.PathLike, header: dict[str, Any], *, overwrite: bool = False,
                 claim: FolderClaim | None = None) -> None:
        self.out = Path(out)
        self.folder = self.out.with_name(self.out.name + SUFFIX)
        self.header = header
        self.fingerprint = fingerprint(header)
        self.overwrite = overwrite
        self.reused: list[dict[str, Any]] | None = None
        self.claim = claim if claim is not None else FolderClaim(self.out)
        if self.out.exists() and not overwrite:
            self.reused = self._complete_rows()
        if self.reused is not None:
            shutil.rmtree(self.folder, ignore_errors=True)  # left over from before a finished merge
            self.claim.release()
            return
        if overwrite:
            self._clear()
        if (self.folder / "audit.json").exists() or (self.folder / "audit.json").is_symlink():
            self._check_folder()
        elif any(self.folder.iterdir()):
            raise TracerError(f"{shown_path(self.folder)} is not the folder of an unfinished audit (no audit.json); "
                              "remove it, pass --overwrite or choose another --output")
        else:
            _write_json(self.folder / "audit.json", {"fingerprint": self.fingerprint, "header": header})

    def _clear(self) -> None:
        """Empty the claimed folder (``--overwrite``: start over); the folder itself stays claimed."""
        for p in self.folder.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

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
            doc = _read_json(self.folder / "audit.json", "audit header")
        except TracerError as e:
            raise TracerError(f"{shown_path(self.folder)} is not the folder of an unfinished audit ({e}); remove it, "
                              "pass --overwrite or choose another --output") from None
        if not isinstance(doc, dict) or doc.get("fingerprint") != self.fingerprint:
            old = doc.get("header") if isinstance(doc, dict) and isinstance(doc.get("header"), dict) else {}
            raise TracerError(f"{shown_path(self.folder)} holds an unfinished audit with other parameters "
                              f"({_differences(old, self.header)} differ); re-run with the same "
                              "options to resume it, pass --overwrite to start over, or choose another --output")

    def finished(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """The kept rows whose seal holds, and why each other kept row is not believed.

        Returns:
            ``(rows, refused)``: check key → row record (the part trace exists and is the one the
            row was sealed with), and check key → the reason a kept row is not believed (its check
            runs again).
        """
        rows: dict[str, dict[str, Any]] = {}
        refused: dict[str, str] = {}
        for p in sorted(self.folder.iterdir()):
            if p.suffix != ".json" or p.name == "audit.json" or p.name.startswith("."):
                continue
            key = p.stem
            try:
                rec = _read_json(p, "audit row")
            except TracerError as e:
                refused[key] = str(e)
                continue
            why = self._unsealed(key, rec)
            if why is None:
                rows[key] = rec
            else:
                refused[key] = why
        return rows, refused

    def _unsealed(self, key: str, rec: Any) -> str | None:
        """Why the row ``rec`` kept for ``key`` is not sealed to this audit and its part (None: it is)."""
        if not isinstance(rec, dict) or rec.get("key") != key:
            return "its row names another check"
        if rec.get("fingerprint") != self.fingerprint:
            return "its row was not written by this audit (another fingerprint)"
        seal = rec.get("part_sha256")
        if not isinstance(seal, str):
            return "its row carries no checksum of its part trace"
        part = self.part(key)
        if not os.path.lexists(part):
            return f"its part trace {part.name} is missing"
        try:
            check_input_file(part, "part trace")
        except TracerError as e:
            return str(e)
        if sha256_file(part) != seal:
            return f"its part trace {part.name} is not the one its row was sealed with"
        return None

    def comparisons(self, key: str) -> dict[str, dict[str, Any]]:
        """The comparisons stored in check ``key``'s part trace (name → document).

        Raises:
            TracerError: the part is not a readable trace.
        """
        with TraceReader(self.part(key)) as r:
            return r.comparisons()

    def discard(self, key: str) -> None:
        """Remove what an earlier run left for check ``key`` (its row and part, whatever they are now:
        a file, a FIFO, a link, a folder) before it runs again."""
        for p in (self.folder / f"{key}.json", self.part(key)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def part(self, key: str) -> Path:
        """The trace file of check ``key``'s runs."""
        return self.folder / f"{key}.h5"

    def keep(self, key: str, record: dict[str, Any]) -> None:
        """Mark check ``key`` finished with its row ``record``, sealed with this audit's fingerprint
        and the SHA-256 of its part trace (which must be complete)."""
        _write_json(self.folder / f"{key}.json", {**record, "key": key, "fingerprint": self.fingerprint,
                                                  "part_sha256": sha256_file(self.part(key))})

    def release(self) -> None:
        """Give up the claim on the folder (the folder stays: a later audit resumes it)."""
        self.claim.release()

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
        self.claim.release()
        return self.out
