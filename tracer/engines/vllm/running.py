"""The running vLLM engine and the engines kept per settings.

:class:`VllmEngine` is one ``vllm.LLM`` (built from :mod:`tracer.engines.vllm.llm`'s pieces) and
what tracer needs of it: its model and runner in this process, or its workers (a remote engine core,
TP ranks); a capture of its model (:meth:`VllmEngine.new_capture`); requests added and stepped to
the end (:meth:`VllmEngine.start`, :meth:`VllmEngine.finish`) with the KV connector global set to
its own agent and a dead engine core turned into one line; its facts. :func:`engine_for` keeps one
engine per :class:`~tracer.engines.vllm.plan.VllmSettings` for the life of the process (at most
:data:`MAX_ENGINES`, the least recently used released first, :func:`_release`). A run plan executed
on one: :mod:`tracer.engines.vllm.engine`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from tracer import watchdog
from tracer.errors import TracerError, interrupt, signals_seen
from tracer.engines.vllm.llm import (_hidden_size, _kv_state, _own_rotary, _settings_for, check_head_size, platform, vllm,
                                     weights_folder)
import tracer.engines.vllm.environment as environment
from tracer.engines.dumps.namemap import RefLayout
from tracer.engines.vllm.capture import VllmCapture
from tracer.engines.vllm.remote import RemoteCapture, death_watch, in_process, rpc, worker_facts
from tracer.engines.vllm.plan import VllmSettings, check_architecture

#: how many LLM instances (one per settings) are kept alive at once; the oldest is dropped first
MAX_ENGINES = 2


class VllmEngine:
    """One in-process ``vllm.LLM`` and what tracer needs of it.

    Attributes:
        llm: the ``vllm.LLM``.
        model: vLLM's ``nn.Module`` (hooks go here).
        runner: vLLM's model runner.
        settings: the :class:`VllmSettings` it was built with; kwargs: the resolved LLM arguments.
        folder: the weights folder.
    """

    def __init__(self, llm: Any, settings: VllmSettings, kwargs: dict[str, Any], folder: Path,
                 threads: tuple[int, int]) -> None:
        self.llm, self.settings, self.kwargs, self.folder, self.threads = llm, settings, kwargs, folder, threads
        self._ids = itertools.count()
        self._facts: dict[str, Any] | None = None
        self.log: str | None = None
        self.tp = int(getattr(llm.llm_engine.vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        # the engine core in its own process, or TP ranks in worker processes: captures go through the workers
        self.remote = not in_process(llm) or self.tp > 1
        self.kv_agent: Any = None  # vLLM's worker-side KV connector of this LLM (in this process), or None
        self.runner: Any = None
        self.model: Any = None
        if not self.remote:
            try:
                core = llm.llm_engine.engine_core.engine_core
                self.runner = core.model_executor.driver_worker.worker.model_runner
                self.model = self.runner.model
            except AttributeError:
                raise TracerError("vLLM's engine core is in this process but tracer cannot reach its model runner "
                                  f"(vLLM {vllm.__version__}); build the LLM with its engine core in its own process "
                                  "(VLLM_ENABLE_V1_MULTIPROCESSING=1)") from None
        comp = llm.llm_engine.vllm_config.compilation_config
        graphs = str(getattr(comp, "cudagraph_mode", "NONE")).rsplit(".", 1)[-1]
        self.hidden_states: str | None = None  # the folder of vLLM's hidden-states output (compiled)
        if settings.compiled or settings.hidden_states:
            spec = llm.llm_engine.vllm_config.speculative_config
            if getattr(spec, "method", None) != "extract_hidden_states":
                raise TracerError("a compiled vLLM is captured through its hidden-states output; build it with "
                                  "tracer.engines.vllm.hidden_states.llm_kwargs(...)")
        if not settings.compiled and (int(getattr(comp, "mode", 0) or 0) != 0 or graphs not in ("NONE", "None", "0")):
            raise TracerError(f"this vLLM runs with compilation mode {comp.mode} and CUDA graphs {graphs}, which hide "
                              "its modules from tracer's hooks; build it eager (enforce_eager=True, compilation mode 0)")

    def facts(self) -> dict[str, Any]:
        """The engine's numeric contract, the document of a :class:`~tracer.execute.records.EngineFacts`
        (for the run's meta and the trace header):
        version, device, attention backend (the one that runs, and what was asked for) and
        implementation, KV-cache dtype and block size, the chunked-prefill budget, prefix caching,
        compilation and graphs (off), batch-invariant mode, the model runner, threads, vLLM's log
        file. Read once per engine (a new dict each call)."""
        if self._facts is None:
            self._facts = self._read_facts()
        return dict(self._facts)

    def worker_facts(self) -> dict[str, Any]:
        """What the model in vLLM's worker (TP rank 0) says of itself
        (:func:`tracer.engines.vllm.remote.worker_facts`), read once.

        Raises:
            TracerError: the worker could not answer (one line)."""
        if getattr(self, "_worker_facts", None) is None:
            got = rpc(self.llm, worker_facts, self.kwargs["dtype"], what="read its model's facts")
            self._worker_facts = min(got, key=lambda r: r["rank"])
        return self._worker_facts

    def _read_facts(self) -> dict[str, Any]:
        from tracer.engines.vllm.engine_facts import read_facts

        return read_facts(self)

    def new_capture(self, emap: dict[str, Any], ref: RefLayout, token_ids: list[int], window: tuple[int, int],
                    kv_points: dict[int, str], kv_positions: int | None = None) -> Any:
        """A capture of this engine's model (:class:`~tracer.engines.vllm.capture.VllmCapture`'s
        arguments): the hooks in this process, or, with the engine core in its own process, in its
        workers (:class:`~tracer.engines.vllm.remote.RemoteCapture`); used the same way."""
        block = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
        if self.remote:
            return RemoteCapture(self.llm, {"emap": emap, "ref": ref, "token_ids": list(token_ids),
                                            "window": (int(window[0]), int(window[1])), "kv_points": dict(kv_points),
                                            "kv_positions": kv_positions, "block_size": block})
        return VllmCapture(self.model, self.runner, emap, ref, token_ids, window, kv_points, kv_positions,
                           block_size=block)

    @contextlib.contextmanager
    def active(self) -> Any:
        """For the block (this engine steps): vLLM's worker-side KV connector global set to this engine's
        own agent, empty again afterwards (:func:`_kv_state`). In this process only; a remote engine
        core keeps its own."""
        if self.remote:
            yield
            return
        state = _kv_state()
        state._KV_CONNECTOR_AGENT = self.kv_agent
        try:
            yield
        finally:
            state._KV_CONNECTOR_AGENT = None

    @contextlib.contextmanager
    def alive(self, what: str) -> Any:
        """For the block (calls into vLLM's engine core): an engine core that died is one line, and
        this engine is forgotten (the next run builds a new one).

        Raises:
            TracerError: vLLM's ``EngineDeadError`` (its process ended: a worker killed, out of memory).
        """
        try:
            with self.active(), death_watch(self.llm):
                yield
        except Exception as e:  # noqa: BLE001 - only vLLM's EngineDeadError is turned into a line
            if "CUDA graph capturing detected at an inappropriate time" in str(e):  # vLLM 0.26's V2 runner
                raise TracerError(f"vLLM's model runner tried to capture a CUDA graph while {what} (vLLM "
                                  f"{vllm.__version__}'s V2 runner with the hidden-states output, seen on an H200); "
                                  "run with VLLM_USE_V2_MODEL_RUNNER=0 (its V1 runner)") from None
            if type(e).__name__ != "EngineDeadError":
                raise
            for key in [k for k, v in _ENGINES.items() if v is self]:
                _ENGINES.pop(key)
            raise TracerError(f"vLLM's engine core died while {what} (its process ended: a worker killed or out of "
                              f"memory; vLLM's log: {self.log}); the next run starts a new engine") from None

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache (no request may be running).

        Raises:
            TracerError: vLLM refused (requests still running), or its engine core died.
        """
        with self.alive("resetting its prefix cache"):
            ok = not self.settings.enable_prefix_caching or self.llm.reset_prefix_cache()
            for _ in range(0 if ok or self.remote else 100):  # a finished request whose KV blocks a connector
                self.llm.llm_engine.step()  # still holds (the hidden-states file written, not yet reported)
                ok = self.llm.reset_prefix_cache()  # is let go by the scheduler's next steps
                if ok:
                    break
                time.sleep(0.01)
        if not ok:
            raise TracerError("vLLM refused to reset its prefix cache (requests are still running)")

    def labels(self, k: int) -> list[str]:
        """``k`` new request ids (``tracer-<n>``): name requests before :meth:`start` adds them."""
        return [f"tracer-{next(self._ids)}" for _ in range(k)]

    def start(self, prompts: list[list[int]], max_tokens: int = 1, params: list[Any] | None = None,
              labels: list[str] | None = None, extra_args: dict[str, Any] | None = None) -> list[tuple[str, str]]:
        """Add one request per prompt (greedy, ``max_tokens``, ``extra_args`` as ``SamplingParams``'
        own; or ``params``, one ``SamplingParams`` per prompt), not yet scheduled, under ``labels``
        (default: new ones); returns ``(external id, vLLM's internal id)`` per request."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra_args)
        out = []
        labels = labels or self.labels(len(prompts))
        with self.alive("adding requests"):
            for j, p in enumerate(prompts):
                ext = labels[j]
                sp = params[j] if params is not None else greedy
                internal = self.llm.llm_engine.add_request(ext, TokensPrompt(prompt_token_ids=list(p)), sp)
                out.append((ext, str(internal)))
        return out

    def finish(self) -> dict[str, Any]:
        """Step the engine until every added request is finished; returns external id → RequestOutput."""
        eng = self.llm.llm_engine
        done: dict[str, Any] = {}
        with self.alive("running requests"):
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if getattr(o, "finished", False):
                        done[str(o.request_id)] = o
        return done


_ENGINES: "OrderedDict[tuple, VllmEngine]" = OrderedDict()


def engine_for(loaded: Any, settings: VllmSettings = VllmSettings(), say: Callable[[str], None] | None = None) -> VllmEngine:
    """The in-process vLLM engine of ``loaded``'s weights with ``settings``, built on first use
    (about 15 s and 1-2 GB for SmolLM2-135M on a CPU) and kept for the life of the process.

    Raises:
        TracerError: compilation or graphs on, no weights folder, or vLLM failing to start (one line).
    """
    settings = replace(settings.check(), attention_backend=environment.check_attention_backend(settings.attention_backend))
    environment.check_batch_invariant(settings.batch_invariant, platform())
    folder = weights_folder(loaded)
    check_architecture(loaded, folder)
    kwargs = _settings_for(loaded, settings)
    multiprocess = environment.multiprocess_default() if settings.multiprocess is None else bool(settings.multiprocess)
    multiprocess = multiprocess or settings.tensor_parallel_size > 1  # TP ranks are processes: so is vLLM's core
    key = (str(folder), settings.batch_invariant, multiprocess, settings.compiled, settings.hidden_states,
           tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    if key in _ENGINES:
        _ENGINES.move_to_end(key)
        return _ENGINES[key]
    while len(_ENGINES) >= MAX_ENGINES:  # drop the least recently used LLM (its KV cache and weights)
        _release(_ENGINES.popitem(last=False)[1])
    if say is not None:
        say(f"starting vLLM {vllm.__version__} on {folder} (block size {kwargs['block_size']}, "
            f"budget {kwargs['max_num_batched_tokens']} tokens per step"
            f"{', engine core in its own process' if multiprocess else ''}"
            f"{f', TP {settings.tensor_parallel_size}' if settings.tensor_parallel_size > 1 else ''})")
    before = torch.get_num_threads()
    hidden, outputs = {}, None
    if settings.compiled or settings.hidden_states:  # vLLM writes each request's layer outputs to a folder of its own
        from tracer.engines.vllm.hidden_states import llm_kwargs, outputs_folder

        layers = int(getattr(loaded.model.config.get_text_config(), "num_hidden_layers"))
        outputs = outputs_folder(kwargs["max_model_len"] * (layers + 1) * _hidden_size(loaded) * loaded.model.dtype.itemsize)
        hidden = llm_kwargs(layers, outputs)
    with signals_seen() as seen, environment.quiet(f"starting vLLM {vllm.__version__} on {folder}") as log:
        if settings.batch_invariant:
            environment.enable_batch_invariant()
        connected = "kv_transfer_config" in kwargs or "kv_transfer_config" in hidden
        if connected:
            _kv_state()._KV_CONNECTOR_AGENT = None  # its own agent, not an earlier LLM's (_kv_state)
        guard = None
        _own_rotary()
        try:
            with environment.process_mode(multiprocess), \
                    environment.cpu_ranks_bound(settings.tensor_parallel_size, platform()), \
                    watchdog.guard_start("vLLM", "VLLM::", seen) as guard:
                llm = vllm.LLM(model=str(folder), **kwargs, **hidden)
        except (ValueError, RuntimeError, OSError, NotImplementedError) as e:
            interrupt(seen)  # a signal that vLLM turned into another error
            if guard is not None and guard.reason is not None:  # the start guard ended a start that would have hung
                raise TracerError(environment.start_failure(guard.reason, log, settings.tensor_parallel_size)) from None
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise TracerError(f"vLLM could not start on {folder}: {first}") from None
    if seen:  # vLLM's start swallowed the interrupt: honour it now
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        interrupt(seen)
    engine = VllmEngine(llm, settings, kwargs, folder, (before, torch.get_num_threads()))
    if connected:
        engine.kv_agent, _kv_state()._KV_CONNECTOR_AGENT = _kv_state()._KV_CONNECTOR_AGENT, None
    engine.log = str(log) if log is not None else None
    engine.hidden_states = outputs
    try:
        if engine.remote:
            refusal = engine.worker_facts()["head_size_refusal"]
            if refusal:
                raise TracerError(refusal)
        else:
            check_head_size(engine.model)
    except TracerError:
        _release(engine)
        raise
    _ENGINES[key] = engine
    return engine


def _release(old: VllmEngine) -> None:
    """Free one LLM's engine core (its executor, KV cache and weights) without vLLM's teardown of
    the process-wide distributed state (``EngineCore.shutdown`` ends with it), which the other LLMs
    of this process still use: after it they fail with "pipeline model parallel group is not
    initialized"."""
    import gc

    if getattr(old, "hidden_states", None):
        import shutil

        shutil.rmtree(old.hidden_states, ignore_errors=True)
    if getattr(old, "remote", False):  # the engine core's own process ends with its executor, KV cache and weights
        with environment.quiet("releasing an LLM"), contextlib.suppress(Exception):
            old.llm.llm_engine.engine_core.shutdown()
        del old
        gc.collect()
        return
    core = getattr(old.llm.llm_engine.engine_core, "engine_core", None)
    steps = [getattr(getattr(core, "structured_output_manager", None), "clear_backend", None),
             getattr(getattr(core, "model_executor", None), "shutdown", None),
             getattr(getattr(core, "scheduler", None), "shutdown", None)]
    with environment.quiet("releasing an LLM"):
        for step in steps:
            if callable(step):
                with contextlib.suppress(Exception):
                    step()
    del old, core, steps
    gc.unfreeze()  # vLLM froze its start-up objects: collectable again
    gc.collect()


__all__ = ["VllmEngine", "engine_for", "MAX_ENGINES"]
