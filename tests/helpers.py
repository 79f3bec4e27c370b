"""What the tests share: one way to run the ``tracer`` command, one way to build runs by hand, and the
small random-init models (built straight from HF configs, independent of :mod:`tracer.load.models`).

- :func:`tracer_cli` runs ``python -m tracer ARGS`` in a subprocess; :func:`tracer_warm` runs the
  same command by ``tracer.cli.main`` in a warm worker process kept for the whole test session (no
  process start: torch is imported once); :func:`bad_cli` checks a bad input's contract (exit 2,
  one line, no traceback); :func:`cli_batch` runs many argument lists
  in one process in which loading a model raises (bad input must be refused before any load);
  :func:`cli_session` runs several whole commands in one process (one import of torch);
  :class:`Worker` answers fuzz cases in a spawned process that may hang or crash.
- :func:`run_record` builds a :class:`~tracer.execute.records.RunRecord` from ``(name, kind,
  tensor)`` triples; :func:`make_runs` two planted runs A/B; :func:`write_trace` stores runs.
- :func:`make_model` a random-init causal LM of a family in :data:`FAMILIES`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tracer.execute.records import CaptureRecord, RunRecord

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- the tracer command


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout first on ``PYTHONPATH``, the shared model
    cache, 200 columns (tables are not cut), then ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRACER_CACHE_DIR", str(Path.home() / ".cache" / "tracer"))
    env["COLUMNS"] = "200"
    env.update(extra or {})
    return env


def tracer_cli(args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None, *,
               check: bool = True, timeout: float = 600, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python -m tracer ARGS`` in ``cwd`` with ``env`` (default :func:`cli_env`); stdout and stderr
    captured as text. ``check``: raise AssertionError (with stderr) unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "tracer", *args], env=cli_env() if env is None else env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"tracer {args} exited {proc.returncode}: {proc.stderr}")
    return proc


def bad_cli(args: list[str], env: dict[str, str], cwd: str | Path, needle: str, *,
            warm: bool = False) -> subprocess.CompletedProcess:
    """``tracer ARGS`` must refuse: exit 2, no traceback, one line on stderr holding ``needle``.
    ``warm``: run it by :func:`tracer_warm` (no process start) instead of :func:`tracer_cli`."""
    # the error is the only line: progress lines (a slow phase before the error) are off here
    proc = (tracer_warm if warm else tracer_cli)(args, {**env, "TRACER_PROGRESS": "off"}, cwd, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return proc


_DRIVER = """
import contextlib, io, json, sys
sys.path.insert(0, {root!r})
if {refuse_loads!r}:  # bad input must be refused before any load: a load is an error here
    import tracer.load.models
    def refuse(*a, **k):
        raise RuntimeError("a model was loaded")
    tracer.load.models.load_model = refuse
if {refuse_reads!r}:  # ... and before any trace is opened
    import tracer.store.reader
    def unread(*a, **k):
        raise RuntimeError("a trace was read")
    tracer.store.reader.TraceReader.__init__ = unread
import os
from tracer.cli import main
for case in json.loads(sys.argv[1]):
    args, env = (case["args"], case["env"]) if isinstance(case, dict) else (case, {{}})
    saved = {{k: os.environ.get(k) for k in env}}
    os.environ.update(env)  # this case's environment (rich reads COLUMNS and TTY_COMPATIBLE as it prints)
    sys.argv = ["tracer", *args]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main()
        except SystemExit as e:
            code = e.code
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    print("\\x00" + json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


def cli_session(cases: list[list[str] | dict[str, Any]], env: dict[str, str], cwd: str | Path, *,
                timeout: float = 600, refuse_loads: bool = False,
                refuse_reads: bool = False) -> list[subprocess.CompletedProcess]:
    """``tracer ARGS`` for each case, one after another in ONE process (torch and transformers are
    imported once, not once per command): a ``CompletedProcess`` (``returncode``, ``stdout``,
    ``stderr``) per case, in order; the exit codes are the CLI's own (``main`` raises
    ``SystemExit``). A case is the argument list, or ``{"args": [...], "env": {...}}``: variables
    set for that case only (``COLUMNS``, ``TTY_COMPATIBLE``: leave them out of ``env`` then, so the
    consoles made at import read them as each case prints). ``refuse_loads``: loading a model
    raises in that process; ``refuse_reads``: opening a trace does. Without either, the process is
    the suite's warm worker (:func:`tracer_warm`, ``timeout`` a command); with one, a new process,
    whose patches are in place before anything imports the functions they replace."""
    if not (refuse_loads or refuse_reads):
        return [tracer_warm(case["args"] if isinstance(case, dict) else case,
                            {**env, **(case["env"] if isinstance(case, dict) else {})}, cwd, check=False,
                            timeout=timeout) for case in cases]
    driver = _DRIVER.format(root=str(ROOT), refuse_loads=refuse_loads, refuse_reads=refuse_reads)
    proc = subprocess.run([sys.executable, "-c", driver, json.dumps(cases)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    done = [json.loads(line[1:]) for line in proc.stdout.split("\n") if line.startswith("\x00")]
    assert len(done) == len(cases), proc.stderr[-3000:]
    return [subprocess.CompletedProcess(["tracer", *(args["args"] if isinstance(args, dict) else args)], code, out, err)
            for args, (code, out, err) in zip(cases, done)]


def _warm_cli_loop(conn) -> None:
    """The loop of :func:`tracer_warm`'s worker: for each ``(args, env, cwd)`` it receives, one whole
    ``tracer`` command (:func:`tracer.cli.main`) with ``env`` as the whole environment, ``cwd`` as
    the working folder and file descriptors 1 and 2 sent to files (as a subprocess's captured pipes
    are: what child processes and native code write lands there too); it answers ``("done", exit
    code, stdout, stderr)``, or ``("exception", traceback)`` when something other than SystemExit
    escaped ``main``. After each command the process is put back as it was: environment, folder,
    signal handlers, warning filters, torch's flags; before each, torch's global RNG is seeded as a new
    process's is and the warnings shown once (Python's, transformers' ``warning_once``) are forgotten."""
    import io
    import locale
    import signal
    import tempfile
    import traceback
    import warnings

    for name in ("COLUMNS", "LINES", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR", "NO_COLOR"):
        os.environ.pop(name, None)  # the console made at import reads each command's COLUMNS as it prints
    import tracer.report.terminal  # noqa: F401 - that console (stderr), made here and not in a command's environment
    from tracer.cli import main
    from tracer.cli_exit import restore_signals

    seed = torch.initial_seed()  # a fresh process's: sampling without a seed starts where a new process does
    sigs = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]

    def text(f) -> str:  # as subprocess.run(text=True) decodes a pipe: locale encoding, universal newlines
        f.seek(0)
        return io.TextIOWrapper(f, encoding=locale.getpreferredencoding(False), newline=None).read()

    while True:
        request = conn.recv()
        if request is None:
            return
        args, env, cwd = request
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        handlers = {s: signal.getsignal(s) for s in sigs}
        flags = (torch.get_num_threads(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                 torch.is_grad_enabled())
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        sys.stdout.flush(), sys.stderr.flush()
        fd1, fd2 = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        code, problem = 0, None
        try:
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            torch.manual_seed(seed)
            warnings.onceregistry.clear()  # warnings and transformers' *_once messages: shown again, as in
            # a new process
            hf_logging = sys.modules.get("transformers.utils.logging")
            for once in (getattr(hf_logging, "warning_once", None), getattr(hf_logging, "info_once", None)):
                if hasattr(once, "cache_clear"):
                    once.cache_clear()
            sys.argv = ["tracer", *args]
            with warnings.catch_warnings():  # each command's warnings show as in a new process, once each
                try:
                    main()
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
            problem = traceback.format_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(fd1, 1), os.dup2(fd2, 2)
            os.close(fd1), os.close(fd2)
            restore_signals()
            for s, h in handlers.items():
                signal.signal(s, h)
            torch.set_num_threads(flags[0]), torch.set_default_dtype(flags[1])
            torch.use_deterministic_algorithms(flags[2]), torch.set_grad_enabled(flags[3])
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        conn.send(("exception", problem) if problem else ("done", code, text(out), text(err)))


_WARM: list[Worker] = []  # the one warm worker of this pytest process, started on first use


def tracer_warm(args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None, *,
                check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """``tracer ARGS`` as :func:`tracer_cli` runs it (``env`` default :func:`cli_env`, ``cwd``
    default this process's; ``check``: raise AssertionError unless it exits 0), but by
    :func:`tracer.cli.main` in one warm worker process that this pytest process starts once and
    keeps (torch and transformers are imported once, not once per command: about 4 s of CPU a
    command on a 2-core machine). What the command prints reaches the test exactly as a
    subprocess's captured pipes would hold it (file descriptors 1 and 2, the ranks it starts
    included), and the worker is put back as it was after each command (:func:`_warm_cli_loop`).
    Not for what only a process of its own shows: ``python -m tracer``'s start, signals and the
    watchdog, ``os._exit``, what is imported before an error, that no warning is printed (one of
    torch's C++ code is shown once a process), stderr's colours in a terminal (its console is made
    once, as in :func:`cli_session`): those use :func:`tracer_cli`. Messages name the program ``tracer`` (the
    console script's name; ``python -m tracer`` names itself so).

    Raises:
        AssertionError: the command exits non-zero with ``check``; it runs past ``timeout`` seconds
            or crashes the worker (which is started again for the next command); something other
            than SystemExit escapes ``main`` (the traceback is the message).
    """
    if not _WARM:
        import atexit

        _WARM.append(Worker(_warm_cli_loop, daemon=False))  # its commands start processes (TP ranks)
        atexit.register(lambda: _WARM[0].proc.is_alive() and _WARM[0].close())
    if not _WARM[0].proc.is_alive():  # ended by something outside it: a new one
        _WARM[0].start()
    answer = _WARM[0].ask((list(args), cli_env() if env is None else dict(env), str(cwd or os.getcwd())), timeout)
    if answer[0] != "done":
        raise AssertionError(f"tracer {args}: {answer[0]}: {answer[1]}")
    _, code, out, err = answer
    if check and code != 0:
        raise AssertionError(f"tracer {args} exited {code}: {err}")
    return subprocess.CompletedProcess(["tracer", *args], code, out, err)


def cli_batch(cases: list[list[str]], cwd: str | Path, timeout: float = 120, *,
              refuse_reads: bool = False) -> list[tuple[int, str]]:
    """``(exit code, stderr)`` of ``tracer ARGS`` for each case, in one time-boxed process in which
    loading a model raises, so a case that would load one fails (:func:`cli_session`); with
    ``refuse_reads`` opening a trace raises too."""
    # the error is the only line (README: stderr without a terminal): no progress line of a slow start-up
    done = cli_session(cases, dict(os.environ, COLUMNS="200", TRACER_PROGRESS="off"), cwd, timeout=timeout,
                       refuse_loads=True, refuse_reads=refuse_reads)
    return [(p.returncode, p.stderr) for p in done]


class Worker:
    """One spawned process answering ``(outcome kind, text)`` requests for a path, with a timeout per
    request; ``target(conn)`` is the child's loop (a module-level function, for spawn): it receives
    paths and sends answers until it receives None. A hang or a crash is an answer too, and the
    child is started again. ``daemon``: False for a child that starts processes of its own (a
    daemonic one may not); then it must be closed before this process exits."""

    def __init__(self, target, daemon: bool = True) -> None:
        import multiprocessing as mp

        self.ctx, self.target, self.daemon = mp.get_context("spawn"), target, daemon
        self.start()

    def start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=self.target, args=(child,), daemon=self.daemon)
        self.proc.start()

    def ask(self, path: str, timeout: float):
        self.conn.send(path)
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        code = self.proc.exitcode
        self.proc.kill()
        self.proc.join()
        self.start()
        return ("hang", f"no answer in {timeout} s") if code is None else ("crash", f"exit code {code}")

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------- runs built by hand


def run_record(name: str, tensors: list[tuple[str, str, torch.Tensor]], ids: tuple[int, ...] = (1, 2, 3, 4),
               window: tuple[int, int] = (2, 4), *, calls: dict[str, list] | None = None,
               chunks: list[list[int]] | None = None) -> RunRecord:
    """A run of prompt ``ids`` that kept ``window``: one capture per ``(name, kind, tensor)`` (op
    ``X``; ``calls``: capture name → its calls), plan chunks ``chunks`` (default one pass)."""
    caps = {n: CaptureRecord(name=n, kind=k, tensor=t, calls=(calls or {}).get(n, []), op="X") for n, k, t in tensors}
    return RunRecord(name=name, token_ids=list(ids), plan={"chunks": chunks or [[0, len(ids)]]}, window=window,
                     captures=caps)


def planted_pair() -> tuple[RunRecord, RunRecord, tuple[torch.Tensor, ...]]:
    """Runs A/B of 2 positions, bf16: ``emb`` identical, ``l0`` 1 ULP off at (1, 3), ``l1`` off by
    +4 at (0, 0) and -2 at (1, 7), logits ``head`` (vocabulary 4) flipping at position 1; also
    ``(l0, l0b, l1, l1b)``."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2, 8, generator=g).to(torch.bfloat16)
    l0 = torch.randn(2, 8, generator=g).to(torch.bfloat16)
    l1 = torch.randn(2, 8, generator=g).to(torch.bfloat16)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 0.0, 4.9]], dtype=torch.bfloat16)
    a = run_record("A", [("emb", "embedding", emb), ("l0", "layer", l0), ("l1", "layer", l1), ("head", "logits", logits)])
    # B: l0 differs by 1 ULP at one element, l1 by a large amount at two, logits flip at position 1
    l0b = l0.clone()
    l0b.view(torch.int16)[1, 3] += 1
    l1b = l1.clone()
    l1b[0, 0] += 4.0
    l1b[1, 7] -= 2.0
    lb = logits.clone()
    lb[1, 3] = 5.5
    b = run_record("B", [("emb", "embedding", emb.clone()), ("l0", "layer", l0b), ("l1", "layer", l1b), ("head", "logits", lb)])
    return a, b, (l0, l0b, l1, l1b)


T, H, V = 4, 8, 16  # make_runs: window positions, hidden size, vocabulary
NAMES = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm")


def make_runs(diverge_at: str | None = "model.layers.1", empty_in_b: str | None = None,
              drop_in_b: str | None = None, kv_empty_in_b: bool = False) -> list[RunRecord]:
    """Runs A and B of 6 tokens, window [2, 6); B differs by one ULP from ``diverge_at`` on."""
    g = torch.Generator().manual_seed(0)
    runs = []
    for name in ("A", "B"):
        caps: dict[str, CaptureRecord] = {}
        diverged = False
        for cap in NAMES:
            x = torch.randn(T, H, generator=g) if name == "A" else runs[0].captures[cap].tensor.clone()
            diverged = diverged or cap == diverge_at
            if name == "B" and diverged:
                x = torch.nextafter(x, torch.full_like(x, 10.0))
            if name == "B" and cap == empty_in_b:
                x = torch.empty(0, H)
            if not (name == "B" and cap == drop_in_b):
                caps[cap] = CaptureRecord(cap, "embedding" if "embed" in cap else "layer", x)
        kv = torch.empty(0) if (name == "B" and kv_empty_in_b) else torch.ones(6, 4)
        caps["model.layers.0.self_attn.kv_cache"] = CaptureRecord("model.layers.0.self_attn.kv_cache", "kv_cache", kv)
        logits = torch.randn(T, V, generator=torch.Generator().manual_seed(1))
        caps["lm_head"] = CaptureRecord("lm_head", "logits", logits)
        runs.append(RunRecord(name, [1, 2, 3, 4, 5, 6], {"description": name}, (2, 6), caps, meta={}))
    return runs


def write_trace(path: Path, runs: list[RunRecord], header: dict | None = None, version: int = 2) -> Path:
    """``runs`` stored in a trace at ``path`` (format ``version``)."""
    from tracer.store.trace import TraceWriter

    with TraceWriter(path, header=header or {"model": {"name": "planted"}}, format_version=version) as w:
        for r in runs:
            w.add_run(r)
    return path


def write_sweep_v1(path: Path, rows: list, params: dict, points: list[str], kinds: list[str]) -> Path:
    """A version-1 sweep file, as tracer wrote them before checksums (texts as variable-length strings)."""
    import h5py
    import numpy as np

    from tracer.store.sweepfile import MATRIX_FIELDS, ROW_FIELDS

    with h5py.File(path, "w") as f:
        f.attrs.update({"format": "tracer-sweep", "format_version": np.int64(1), "complete": True})
        f.create_group("header").attrs["json"] = "{}"
        g = f.create_group("sweep")
        g.attrs.update({"params": json.dumps(params), "points": json.dumps(points), "kinds": json.dumps(kinds),
                        "n_done": np.int64(len(rows))})
        for name, dt in {**ROW_FIELDS, **MATRIX_FIELDS}.items():
            g.create_dataset(name, data=np.asarray([getattr(r, name) for r in rows], dtype=dt))
    return path


def zero_heap_free_space(path: Path) -> int:
    """Zero the 16-byte header of the free-space object (index 0) of the file's first global heap
    collection, in place: HDF5 then loops forever loading the collection (issue 37 item 1). Returns
    the byte offset zeroed."""
    import struct

    data = bytearray(Path(path).read_bytes())
    at = data.find(b"GCOL\x01\x00\x00\x00")
    assert at >= 0, "no global heap collection"
    (size,) = struct.unpack_from("<Q", data, at + 8)
    p = at + 16
    while p + 16 <= at + size:
        index, _refs, _res, n = struct.unpack_from("<HHIQ", data, p)
        if index == 0:
            data[p:p + 16] = bytes(16)
            Path(path).write_bytes(bytes(data))
            return p
        p += 16 + (n + 7) // 8 * 8
    raise AssertionError("no free-space object in the collection")


# ---------------------------------------------------------------- tiny random-init models

FAMILIES = {
    "llama": dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
    "qwen2": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
    "qwen3": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512),
    "mistral": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, sliding_window=None),
    "gemma": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512),
    "phi3": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, pad_token_id=0),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, bos_token_id=0, eos_token_id=0),
}


def make_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn: str = "sdpa"):
    """A random-init causal LM of the given HF family, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **FAMILIES[model_type])
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype).eval()
    model.requires_grad_(False)
    return model
