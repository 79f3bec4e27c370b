"""Real tensor parallelism: run B of the ``tensor-parallel`` scenario sharded over K processes.

Level 4 of the hierarchy with ``tp_mode="distributed"`` (``--tp-mode distributed``): run A
executes in the calling process on the unsharded model (TP-1); run B executes on K worker
processes that tracer starts itself (``torch.multiprocessing`` spawn, a ``TCPStore`` rendezvous
on a free localhost port opened by the parent, so there is no port race), or, under
``torchrun``, on the ranks torchrun started (:func:`torchrun_rank`).

Sharding is tracer's own, Megatron-style, applied in every worker to the model the parent
loaded (its tensors reach the workers through shared memory, so run B starts from the very
bits run A used):

- column-parallel ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``: rank r keeps the
  output rows ``[r N/K, (r+1) N/K)`` (whole heads: K must divide the attention heads and the KV
  heads); these GEMMs run with N/K columns, so the kernels pick other tiles;
- row-parallel ``o_proj``/``down_proj``: rank r keeps the input columns ``[r K_in/K, ...)``, computes
  the partial product ``x_r @ W_r.T`` (its *partial*, in the activation dtype) and a real
  ``torch.distributed.all_reduce`` (gloo on the CPU, NCCL on GPUs) sums the K partials; a bias
  is added once, after the sum;
- optionally (``vocab_parallel``) the embedding (each rank looks up its vocabulary rows, zeros
  elsewhere, then all_reduce) and the LM head (N = V/K logits per rank, then all_gather).

With the deterministic mitigation, every all_reduce becomes an all_gather of the K partials
summed in rank order on every rank (the same order whatever algorithm the backend would pick),
and NCCL_ALGO=Ring / NCCL_PROTO=Simple are pinned for NCCL unless set.

Every rank captures with the same hooks; rank 0's captures are the run's (the residual stream
is replicated after each all_reduce), and captures of sharded tensors (q/k/v, gate/up, the
attention core, the MLP activation, the KV cache) are concatenated over the ranks in rank order,
which is the unsharded layout. ``partials=True`` also keeps each rank's row-parallel partials
before the all_reduce (run ``B.partials``: ``<module>.partial.rank<r>``).

transformers' own plans (``from_pretrained(..., tp_plan="auto")``) do run over gloo on the CPU
in transformers 5.24 (DTensor parameters; TP-2 logits of tiny-llama within 2e-7 of TP-1 in
float32), but they are not used here: tracer needs the partials before the all_reduce and a
reduction order of its own for the deterministic mitigation, both inside the collective, and the
workers reuse the parent's weights instead of re-loading them (a random-init or GGUF model would
first have to be saved).

A worker that dies (a crash, a signal, a collective timeout) makes the parent kill every other
worker, delete the scratch folder and raise one :class:`TracerError`; workers also die with the
parent (``PR_SET_PDEATHSIG`` on Linux, and a watchdog thread).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from tracer.execute.capture import CapturePoint
from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.execute.runner import execute, model_device

#: last path component of the column-parallel Linear layers (output rows sharded)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
#: last path component of the row-parallel Linear layers (input columns sharded, all_reduce after)
ROW_PARALLEL = ("o_proj", "down_proj")
#: layouts tracer's sharding cannot split by whole heads (fused projections, GPT-2's Conv1D)
FUSED = ("qkv_proj", "gate_up_proj", "c_attn", "query_key_value", "W_pack")
#: sublayer kinds whose tensors are sharded along the feature dimension in run B
SHARDED_KINDS = ("attention_core", "mlp_hidden", "activation", "kv_cache")
#: seconds a collective (and the rendezvous) may wait before the worker gives up
DEFAULT_TIMEOUT_S = 600
#: environment variable: the rank that kills itself in the middle of run B (fault-injection for tests)
FAULT_ENV = "TRACER_TP_FAULT_RANK"
#: the most worker processes tracer starts on the CPU
MAX_CPU_RANKS = 64


def backend_for(device: str) -> str:
    """The torch.distributed backend for a device string: ``gloo`` (CPU) or ``nccl`` (CUDA).

    Raises:
        TracerError: torch.distributed, or the backend, is not available in this torch build;
            or the device is neither CPU nor CUDA.
    """
    import torch.distributed as dist

    kind = torch.device(device).type
    if not dist.is_available():
        raise TracerError("this torch build has no torch.distributed; --tp-mode distributed needs it "
                          "(use --tp-mode simulated)")
    if kind == "cpu":
        if not dist.is_gloo_available():
            raise TracerError("this torch build has no gloo backend; --tp-mode distributed on the CPU needs it "
                              "(use --tp-mode simulated)")
        return "gloo"
    if kind == "cuda":
        if not dist.is_nccl_available():
            raise TracerError("this torch build has no NCCL backend; --tp-mode distributed on GPUs needs it "
                              "(use --tp-mode simulated, or --device cpu for gloo)")
        return "nccl"
    raise TracerError(f"--tp-mode distributed runs on cpu (gloo) or cuda (NCCL), not on {device}")


def check_world(k: int, device: str) -> str:
    """Check that K ranks can start for a model on ``device``; return the backend.

    Raises:
        TracerError: K < 1, more ranks than GPUs (CUDA), more than :data:`MAX_CPU_RANKS` (CPU),
            or a missing backend.
    """
    if k < 1:
        raise TracerError(f"--tp must be a positive number of ranks, got {k}")
    backend = backend_for(device)
    if backend == "nccl":
        n_gpu = torch.cuda.device_count()
        if k > n_gpu:
            raise TracerError(f"--tp {k} needs {k} GPUs (one per rank) but {n_gpu} are visible; "
                              f"use --tp {n_gpu} or fewer, or --device cpu for gloo ranks")
    elif k > MAX_CPU_RANKS:
        raise TracerError(f"--tp {k} would start {k} CPU processes; use at most {MAX_CPU_RANKS}")
    return backend


def _config_int(cfg: Any, *names: str) -> int | None:
    for name in names:
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    return None


def check_shardable(model: nn.Module, k: int, *, vocab_parallel: bool = False) -> dict[str, int]:
    """Check that tracer's sharding applies to ``model`` at K ranks (before anything is spawned).

    Returns:
        ``{"heads", "kv_heads", "intermediate", "vocab"}`` from the model's config.

    Raises:
        TracerError: a fused projection layout, no q/k/v/o or MLP projections, or K not dividing
            the attention heads, the KV heads, a sharded Linear's dimension or (with
            ``vocab_parallel``) the vocabulary.
    """
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = _config_int(cfg, "num_attention_heads", "n_head")
    kv_heads = _config_int(cfg, "num_key_value_heads") or heads
    vocab = _config_int(cfg, "vocab_size")
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    fused = sorted(names & set(FUSED))
    if fused or not {"q_proj", "k_proj", "v_proj", "o_proj"} <= names:
        what = "fused projections " + "/".join(fused) if fused else "no q/k/v/o_proj"
        raise TracerError(f"{type(model).__name__} has {what}; "
                          "tracer's tensor-parallel sharding covers Llama-style layouts (Llama, Qwen, Mistral, "
                          "SmolLM); use --tp-mode simulated")
    for what, n in (("attention heads", heads), ("KV heads", kv_heads)):
        if n is None or n % k:
            raise TracerError(f"--tp {k} does not divide the {n} {what} of this model; choose a divisor of {n}")
    for name, m in _linears(model, COLUMN_PARALLEL + ROW_PARALLEL):
        dim = m.out_features if name.rsplit(".", 1)[-1] in COLUMN_PARALLEL else m.in_features
        if dim % k:
            raise TracerError(f"--tp {k} does not divide dimension {dim} of {name}; choose a divisor of {dim}")
    if vocab_parallel and (vocab is None or vocab % k):
        raise TracerError(f"--tp-vocab-parallel needs --tp {k} to divide the vocabulary ({vocab}); "
                          "drop --tp-vocab-parallel or choose a divisor")
    return {"heads": heads or 0, "kv_heads": kv_heads or 0, "vocab": vocab or 0,
            "intermediate": _config_int(cfg, "intermediate_size") or 0}


def _linears(model: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names]


# ---------------------------------------------------------------- collectives and sharding (in the workers)


class Reducer:
    """The sum over ranks of a row-parallel layer's partials, ``(..., N)`` → ``(..., N)`` same dtype.

    ``deterministic=False``: ``torch.distributed.all_reduce`` (the backend picks the algorithm);
    ``True``: all_gather, then ``((p0 + p1) + p2) + ...`` in rank order on every rank.
    """

    def __init__(self, world: int, deterministic: bool) -> None:
        self.world, self.deterministic = world, deterministic

    def __call__(self, part: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.world == 1:
            return part
        if not self.deterministic:
            out = part.contiguous()
            dist.all_reduce(out)
            return out
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(parts, part.contiguous())
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc


class Partial(nn.Module):
    """Identity module whose output is a rank's partial product (a hook point for ``--tp-partials``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - identity
        return x


def _slice_param(t: torch.Tensor, dim: int, rank: int, k: int) -> nn.Parameter:
    step = t.shape[dim] // k
    return nn.Parameter(t.narrow(dim, rank * step, step).clone(), requires_grad=False)  # own copy, not shared


def shard_model(model: nn.Module, rank: int, k: int, reducer: Reducer, *, vocab_parallel: bool = False) -> list[str]:
    """Shard ``model`` in place for rank ``rank`` of ``k`` (see the module docstring); return the
    row-parallel module paths (each gets a :class:`Partial` child named ``tp_partial``).

    The parameters are replaced by copies of their slices (shared tensors are never written).
    """
    for _, m in _linears(model, COLUMN_PARALLEL):
        m.weight = _slice_param(m.weight, 0, rank, k)
        if m.bias is not None:
            m.bias = _slice_param(m.bias, 0, rank, k)
        m.out_features //= k
    rows = _linears(model, ROW_PARALLEL)
    for _, m in rows:
        m.weight = _slice_param(m.weight, 1, rank, k)
        m.in_features //= k
        m.tp_partial = Partial()

        def row_forward(x: torch.Tensor, _m: nn.Linear = m) -> torch.Tensor:
            part = _m.tp_partial(nn.functional.linear(x, _m.weight))  # (..., N) this rank's partial
            out = reducer(part)
            return out if _m.bias is None else out + _m.bias

        m.forward = row_forward
    if vocab_parallel:
        _shard_vocab(model, rank, k)
    return [n for n, _ in rows]


def _shard_vocab(model: nn.Module, rank: int, k: int) -> None:
    """Vocab-parallel embedding (masked lookup + all_reduce) and LM head (V/K logits + all_gather)."""
    import torch.distributed as dist

    emb = model.get_input_embeddings()
    if type(emb) is nn.Embedding:  # a subclass (scaled embeddings) keeps its own forward: left replicated
        vocab = emb.num_embeddings
        lo, hi = rank * (vocab // k), (rank + 1) * (vocab // k)
        emb.weight = _slice_param(emb.weight, 0, rank, k)

        def emb_forward(ids: torch.Tensor, _e: nn.Embedding = emb) -> torch.Tensor:
            outside = (ids < lo) | (ids >= hi)
            out = nn.functional.embedding((ids - lo).masked_fill(outside, 0), _e.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0).contiguous()  # (B, T, hidden)
            dist.all_reduce(out)
            return out

        emb.forward = emb_forward
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        head.weight = _slice_param(head.weight, 0, rank, k)
        if head.bias is not None:
            head.bias = _slice_param(head.bias, 0, rank, k)

        def head_forward(x: torch.Tensor, _h: nn.Linear = head) -> torch.Tensor:
            local = nn.functional.linear(x, _h.weight, _h.bias).contiguous()  # (..., V/K)
            parts = [torch.empty_like(local) for _ in range(k)]
            dist.all_gather(parts, local)
            return torch.cat(parts, dim=-1)

        head.forward = head_forward


# ---------------------------------------------------------------- the worker process


@dataclass
class _Job:
    """Everything a worker needs (pickled into the spawned process; tensors via shared memory)."""

    model: nn.Module
    token_ids: list[int]
    plan: Any
    points: list[CapturePoint]
    window: tuple[int, int]
    decode: int
    meta: dict[str, Any]
    backend: str
    world: int
    port: int
    scratch: str
    threads: int
    timeout_s: float
    parent_pid: int


def _die_with_parent(parent_pid: int) -> None:
    """Kill this process when the parent goes away (no orphans even after a SIGKILL of the parent)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="tracer-tp-watchdog").start()


def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def _fault_hook(model: nn.Module, rank: int) -> None:
    """Fault injection for tests: rank ``$TRACER_TP_FAULT_RANK`` SIGKILLs itself when it reaches the
    middle decoder layer of run B (the other ranks are then inside or before a collective)."""
    if os.environ.get(FAULT_ENV, "") != str(rank):
        return
    layers = [m for n, m in model.named_modules() if n.count(".") == 2 and n.split(".")[1] == "layers"]
    target = layers[len(layers) // 2] if layers else model

    def die(*_: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    target.register_forward_pre_hook(die)


def _run_rank(model: nn.Module, rank: int, world: int, backend: str, local_rank: int, plan: Any,
              points: list[CapturePoint], token_ids: list[int], window: tuple[int, int], decode: int,
              meta: dict[str, Any]) -> dict[str, Any]:
    """One rank's part of run B, the group already joined: shard ``model`` (in place), run the plan
    with capture; return ``{"captures": name -> CaptureRecord (CPU tensors), "meta": ...}``."""
    tp = plan.tp
    rows = shard_model(model, rank, world, Reducer(world, plan.deterministic), vocab_parallel=tp.vocab_parallel)
    if backend == "nccl":
        model.to(torch.device("cuda", local_rank))
    points = list(points)
    if tp.partials:
        points += [CapturePoint(name=f"{r}.tp_partial", module=f"{r}.tp_partial", kind="partial",
                                op="Linear partial") for r in rows]
    _fault_hook(model, rank)
    rec = execute(model, token_ids, replace(plan, tp=None), points, window, decode=decode, meta=meta)
    return {"captures": {n: replace(c, tensor=c.tensor.cpu()) for n, c in rec.captures.items()}, "meta": rec.meta}


def _worker(rank: int, job: _Job) -> None:
    """One rank of run B: join the group, shard, execute the plan with capture, save the captures."""
    import torch.distributed as dist

    _die_with_parent(job.parent_pid)
    _quiet()
    torch.set_num_threads(job.threads)
    if job.backend == "nccl" and job.plan.deterministic:
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("NCCL_PROTO", "Simple")
    try:
        timeout = _dt.timedelta(seconds=job.timeout_s)
        store = dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=timeout)
        model = job.model
        if job.backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=job.world, timeout=timeout,
                                    device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=job.world, timeout=timeout)
        mine = _run_rank(model, rank, job.world, job.backend, rank, job.plan, job.points, job.token_ids,
                         job.window, job.decode, job.meta)
        path = os.path.join(job.scratch, f"rank{rank}.pt")
        torch.save(mine, path + ".tmp")
        os.replace(path + ".tmp", path)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        with contextlib.suppress(OSError), open(os.path.join(job.scratch, f"rank{rank}.err"), "w") as f:
            f.write(msg if isinstance(e, TracerError) else f"{type(e).__name__}: {msg}")
        os._exit(3)


# ---------------------------------------------------------------- the parent: launch, watch, merge


def _how(code: int | None) -> str:
    if code is None:
        return "did not finish"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _rank_error(scratch: str, rank: int) -> str:
    """The one-line error rank ``rank`` left in the scratch folder ("" when none)."""
    with contextlib.suppress(OSError), open(os.path.join(scratch, f"rank{rank}.err")) as f:
        return f.read().strip()
    return ""


def _peer_lost(why: str) -> bool:
    """An error that only says a peer went away (the collective's side effect of another rank dying)."""
    return any(s in why for s in ("Connection reset", "Connection closed", "connection closed", "transport",
                                  "communicator was aborted"))


def _watch(procs: list[Any], scratch: str, timeout_s: float) -> None:
    """Wait until every rank exits 0; on the first failure kill the others and raise.

    Raises:
        TracerError: a rank exited non-zero or was killed, or the run exceeded the timeout.
    """
    k = len(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.exitcode for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            time.sleep(0.5)  # a peer's collective fails as soon as one rank dies: let the cause show too
            bad = [(r, c) for r, c in enumerate(p.exitcode for p in procs) if c not in (None, 0)]
            # the rank that failed first-hand: not one whose collective only lost its peer
            first = bad[0]
            for r, c in bad:
                if not _peer_lost(_rank_error(scratch, r)):
                    first = (r, c)
                    break
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            r, c = first
            why = _rank_error(scratch, r)
            raise TracerError(f"tensor-parallel rank {r} of {k} failed ({why or _how(c)}); every rank was stopped "
                              "and no trace was written; rerun, or use --tp-mode simulated")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise TracerError(f"tensor-parallel run B did not finish within {timeout_s:.0f} s; every rank was stopped "
                              f"and no trace was written; raise $TRACER_TP_TIMEOUT or use a shorter prompt")
        time.sleep(0.05)


def _merge(name: str, rec0: CaptureRecord, recs: list[CaptureRecord], kind: str) -> torch.Tensor:
    """The unsharded layout of a sharded capture: the ranks' tensors concatenated in rank order
    along the feature dimension (a ``kv_cache`` point: keys of all ranks, then values)."""
    ts = [r.tensor for r in recs]
    if kind != "kv_cache":
        return torch.cat(ts, dim=-1)
    kshape = rec0.calls[0]["out"][0]  # (B, kv_heads_local, S, head_dim_k)
    kw = kshape[1] * kshape[3]
    return torch.cat([t[..., :kw] for t in ts] + [t[..., kw:] for t in ts], dim=-1)


def _sharded(point: CapturePoint) -> bool:
    last = point.module.rsplit(".", 1)[-1]
    return point.kind in SHARDED_KINDS or (point.kind == "linear" and last in COLUMN_PARALLEL)


def _assemble(points: list[CapturePoint], per_rank: list[dict[str, Any]], plan: Any, token_ids: list[int],
              window: tuple[int, int], name: str) -> tuple[RunRecord, RunRecord | None]:
    k = len(per_rank)
    caps0 = per_rank[0]["captures"]
    by_name = {p.name: p for p in points}
    captures: dict[str, CaptureRecord] = {}
    partial_caps: dict[str, CaptureRecord] = {}
    for cname, rec in caps0.items():
        if rec.kind == "partial":
            base = cname.removesuffix(".tp_partial")
            for r in range(k):
                pr = per_rank[r]["captures"][cname]
                partial_caps[f"{base}.partial.rank{r}"] = replace(pr, name=f"{base}.partial.rank{r}", kind="linear",
                                                                  op=f"Linear partial, rank {r} of {k}")
            continue
        p = by_name.get(cname)
        if p is not None and _sharded(p) and k > 1 and rec.tensor.numel():
            tensor = _merge(cname, rec, [per_rank[r]["captures"][cname] for r in range(k)], p.kind)
            rec = replace(rec, tensor=tensor)
        captures[cname] = rec
    meta = dict(per_rank[0]["meta"])
    plan_dict = plan.to_dict()
    run = RunRecord(name=name, token_ids=list(token_ids), plan=plan_dict, window=window, captures=captures, meta=meta)
    partials = None
    if partial_caps:
        partials = RunRecord(name=f"{name}.partials", token_ids=list(token_ids), plan=plan_dict, window=window,
                             captures=partial_caps, meta={"ranks": k, "what": "each rank's row-parallel partial "
                                                          "product before the all_reduce"})
    return run, partials


def timeout_s() -> float:
    """The collective/run timeout: ``$TRACER_TP_TIMEOUT`` seconds (default :data:`DEFAULT_TIMEOUT_S`).

    Raises:
        TracerError: not a positive number.
    """
    raw = os.environ.get("TRACER_TP_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise TracerError(f"TRACER_TP_TIMEOUT={raw!r} must be a positive number of seconds")
    return value


def execute_distributed(model: nn.Module, token_ids: list[int], plan: Any, points: list[CapturePoint],
                        window: tuple[int, int], *, decode: int = 0, meta: dict[str, Any] | None = None,
                        say: Callable[[str], None] | None = None) -> tuple[RunRecord, RunRecord | None]:
    """Execute a run plan whose ``tp.mode == "distributed"`` on ``plan.tp.k`` worker processes.

    Args:
        model: the loaded (unsharded) model, on the CPU (gloo ranks) or a GPU (NCCL ranks,
            rank r on ``cuda:r``); it is not modified (workers shard their own copies).
        token_ids, points, window, decode, meta: as :func:`tracer.execute.runner.execute`.

    Returns:
        ``(run, partials)``: the run as rank 0 captured it, sharded captures concatenated over
        the ranks (CPU tensors, the model's dtype, ``(T, *feature)`` as for an unsharded run);
        ``partials`` (with ``plan.tp.partials``) holds ``<row-parallel module>.partial.rank<r>``,
        ``(T, N)`` each, before the all_reduce; otherwise None.

    Raises:
        TracerError: bad K, missing backend, an unshardable model (all before anything is
            spawned); a rank that failed or died (every rank stopped, nothing returned).
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    tp = plan.tp
    k = tp.k
    device = str(model_device(model))
    backend = check_world(k, device)
    check_shardable(model, k, vocab_parallel=tp.vocab_parallel)
    limit = timeout_s()
    threads = max(1, torch.get_num_threads() // k)
    # the parent serves the rendezvous on a port the OS picks (no race for a "free" port)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=_dt.timedelta(seconds=limit))
    scratch = tempfile.mkdtemp(prefix="tracer-tp-")
    job = _Job(model=model, token_ids=list(token_ids), plan=plan, points=list(points), window=tuple(window),
               decode=decode, meta=dict(meta or {}), backend=backend, world=k, port=store.port, scratch=scratch,
               threads=threads, timeout_s=limit, parent_pid=os.getpid())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, job), daemon=True, name=f"tracer-tp-rank{r}") for r in range(k)]
    try:
        if say is not None:
            say(f"run {plan.name}: starting {k} {backend} rank(s)")
        for p in procs:
            p.start()
        _watch(procs, scratch, limit)
        per_rank = [torch.load(os.path.join(scratch, f"rank{r}.pt"), weights_only=False) for r in range(k)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
        shutil.rmtree(scratch, ignore_errors=True)
        del store
    run, partials = _assemble(points, per_rank, plan, token_ids, tuple(window), plan.name)
    run.meta.update({"device": device, "tp_world_size": k, "tp_backend": backend, "tp_launcher": "tracer (spawn)",
                     "tp_threads_per_rank": threads})
    return run, partials


def header_facts(plan: Any, device: str) -> dict[str, Any]:
    """What the trace header records about a distributed TP plan: world size, backend, NCCL
    version and the NCCL_ALGO/NCCL_PROTO settings (None when unset), sharding, collective."""
    tp = plan.tp
    backend = backend_for(device)
    nccl = None
    if backend == "nccl":
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    env = dict(os.environ)
    if plan.deterministic and backend == "nccl":
        env.setdefault("NCCL_ALGO", "Ring")
        env.setdefault("NCCL_PROTO", "Simple")
    return {
        "mode": "distributed", "world_size": tp.k, "backend": backend, "nccl_version": nccl,
        "NCCL_ALGO": env.get("NCCL_ALGO"), "NCCL_PROTO": env.get("NCCL_PROTO"),
        "sharding": "tracer (column-parallel q/k/v/gate/up, row-parallel o/down + all_reduce"
                    + ("; vocab-parallel embedding and lm_head" if tp.vocab_parallel else "") + ")",
        "collective": "all_gather + sum in rank order (deterministic)" if plan.deterministic
        else f"torch.distributed.all_reduce ({backend})",
        "threads_per_rank": (torch.get_num_threads() if torchrun_rank() is not None
                             else max(1, torch.get_num_threads() // tp.k)) if backend == "gloo" else None,
        "partials": bool(tp.partials),
        "launcher": "torchrun" if torchrun_rank() is not None else "tracer (torch.multiprocessing spawn)",
    }


def torchrun_rank() -> int | None:
    """This process's rank when it was started by ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
    set), else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return int(os.environ["RANK"])
    return None


def execute_joined(model: nn.Module, token_ids: list[int], plan: Any, points: list[CapturePoint],
                   window: tuple[int, int], *, decode: int = 0, meta: dict[str, Any] | None = None,
                   say: Callable[[str], None] | None = None) -> tuple[RunRecord | None, RunRecord | None]:
    """Run B as one rank of the group ``torchrun`` started (this process; ``plan.tp.k`` must be
    ``WORLD_SIZE``): shard a copy of ``model``, run with capture, gather every rank's captures on
    rank 0. Returns what :func:`execute_distributed` returns on rank 0, ``(None, None)`` elsewhere.
    With NCCL, rank r uses ``cuda:$LOCAL_RANK``.

    Raises:
        TracerError: ``--tp`` differs from the world size, a missing backend, an unshardable model.
    """
    import copy

    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if plan.tp.k != world:
        raise TracerError(f"--tp {plan.tp.k} differs from torchrun's world size {world}; "
                          f"pass --tp {world} or start torchrun with --nproc-per-node {plan.tp.k}")
    device = str(model_device(model))
    backend = backend_for(device)
    check_shardable(model, world, vocab_parallel=plan.tp.vocab_parallel)
    if backend == "nccl" and plan.deterministic:
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("NCCL_PROTO", "Simple")
    if not dist.is_initialized():
        kw: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(local)
            kw["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, timeout=_dt.timedelta(seconds=timeout_s()), **kw)
    if say is not None:
        say(f"run {plan.name}: rank {rank} of {world} ({backend}, torchrun)")
    mine = _run_rank(copy.deepcopy(model), rank, world, backend, local, plan, points, token_ids, tuple(window),
                     decode, dict(meta or {}))
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None, None
    run, partials = _assemble(points, gathered, plan, token_ids, tuple(window), plan.name)
    run.meta.update({"device": device, "tp_world_size": world, "tp_backend": backend, "tp_launcher": "torchrun",
                     "tp_threads_per_rank": torch.get_num_threads()})
    return run, partials


def execute_loaded(loaded: Any, token_ids: list[int], plan: Any, points: list[CapturePoint],
                   window: tuple[int, int], **kw: Any) -> tuple[RunRecord, RunRecord | None]:
    """The ``tp-distributed`` executor of :mod:`tracer.execute.engines`: run B over K ranks
    (:func:`execute_distributed`, or :func:`execute_joined` under ``torchrun``).

    Raises:
        TracerError: ``--kernels`` or ``--op-replay`` (they record inside this process), and every
            error of the two functions above.
    """
    kw.pop("keep_on_device", None)
    if kw.pop("kernels", False) or kw.pop("sdpa_inputs", False):
        raise TracerError("--kernels and --op-replay record inside this process; they do not combine with "
                          "--tp-mode distributed yet (use --tp-mode simulated)")
    if torchrun_rank() is not None:
        return execute_joined(loaded.model, token_ids, plan, points, window, **kw)
    return execute_distributed(loaded.model, token_ids, plan, points, window, **kw)


def distributed_plans(scen: Any) -> list[Any]:
    """The plans of ``scen`` that run over torch.distributed (``--tp-mode distributed``)."""
    return [p for p in (scen.plan_a, scen.plan_b) if p.tp is not None and p.tp.mode == "distributed"]


def check_distributed(scen: Any, device: str | None, *, verdict: bool = False, dispatched: bool = False,
                      model: Any = None) -> None:
    """Refuse a distributed TP plan this machine or this run cannot start, before anything is spawned:
    K larger than the GPUs, a missing backend, ``--verdict`` or ``--device-map`` with it, and (given the
    loaded ``model``) K not dividing the heads, KV heads or sharded dimensions.

    Raises:
        TracerError: one line naming the problem and what to do.
    """
    from tracer.load.models import resolve_device

    for plan in distributed_plans(scen):
        if verdict:
            raise TracerError("--verdict re-runs the scenario in this process; it does not combine with "
                              "--tp-mode distributed (use --tp-mode simulated)")
        if dispatched:
            raise TracerError("--tp-mode distributed shards the model over processes; it does not combine with --device-map")
        check_world(plan.tp.k, resolve_device(device))
        world = os.environ.get("WORLD_SIZE") if torchrun_rank() is not None else None
        if world is not None and int(world) != plan.tp.k:
            raise TracerError(f"--tp {plan.tp.k} differs from torchrun's world size {world}; "
                              f"pass --tp {world} or start torchrun with --nproc-per-node {plan.tp.k}")
        if model is not None:
            check_shardable(model, plan.tp.k, vocab_parallel=plan.tp.vocab_parallel)


def distributed_header(scen: Any, device: str) -> dict[str, Any]:
    """``{"tensor_parallel": {...}}`` for the trace header when run B is distributed (else ``{}``)."""
    plans = distributed_plans(scen)
    return {"tensor_parallel": header_facts(plans[0], device)} if plans else {}
