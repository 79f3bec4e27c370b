"""Real tensor parallelism: run B of the ``tensor-parallel`` scenario sharded over K processes.

Level 4 of the hierarchy with ``tp_mode="distributed"`` (``--tp-mode distributed``): run A
executes in the calling process on the unsharded model (TP-1); run B executes on K worker
processes that tracer starts itself (``torch.multiprocessing`` spawn, a ``TCPStore`` rendezvous
served by the parent on a socket bound to 127.0.0.1 only, port picked by the OS, so there is no
port race and nothing listens beyond this machine, :func:`open_store`; gloo's and NCCL's own
sockets on the loopback interface too), or, under ``torchrun``, on the ranks torchrun started
(:func:`torchrun_rank`).

Sharding is tracer's own, Megatron-style (:mod:`tracer.engines.tp.shard`: column-parallel
q/k/v/gate/up, row-parallel o/down with an all_reduce, optionally vocab-parallel), applied in every
worker to the model the parent loaded (its tensors reach the workers through shared memory, so
run B starts from the very bits run A used); the ranks themselves are :mod:`tracer.engines.tp.ranks`.

With the deterministic mitigation, every all_reduce becomes an all_gather of the K partials
summed in rank order on every rank (the same order whatever algorithm the backend would pick),
and NCCL_ALGO=Ring / NCCL_PROTO=Simple are pinned for NCCL unless set; NVLink multicast
(NCCL_NVLS_ENABLE=0) is off for every NCCL run unless the user set it.

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
parent (``PR_SET_PDEATHSIG`` on Linux and a watchdog thread, armed before the rank imports torch
or receives its job: :mod:`tracer.engines.tp.launch`). A scratch folder a killed parent left
(``tracer-tp-<PID>.*.tmp``) is removed by the next distributed run.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import os
import shutil
import socket
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tracer.errors import TracerError
from tracer.execute.roles import HEAD_SHARDED_ROLES, SHARDED_ROLES
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.engines.tp.launch import rank_main
from tracer.engines.tp.ranks import Job, run_rank, watch
from tracer.engines.tp.shard import backend_for, check_shardable, check_world
from tracer.load.devices import model_device, resolve_device
from tracer.load.recipe_check import clean_stale_temp_dirs


#: seconds a collective (and the rendezvous) may wait before the worker gives up
DEFAULT_TIMEOUT_S = 600


def _merge(name: str, rec0: CaptureRecord, recs: list[CaptureRecord], kind: str, role: str = "") -> torch.Tensor:
    """The unsharded layout of a sharded capture: the ranks' tensors concatenated in rank order
    along the feature dimension (a ``kv_cache`` point: keys of all ranks, then values; a per-head
    norm's ``(T, heads, head_dim)``: along the heads)."""
    ts = [r.tensor for r in recs]
    if role in HEAD_SHARDED_ROLES and ts[0].dim() >= 3:
        return torch.cat(ts, dim=-2)
    if kind != PointKind.KV_CACHE:
        return torch.cat(ts, dim=-1)
    kshape = rec0.calls[0]["out"][0]  # (B, kv_heads_local, S, head_dim_k)
    kw = kshape[1] * kshape[3]
    return torch.cat([t[..., :kw] for t in ts] + [t[..., kw:] for t in ts], dim=-1)


def _sharded(point: CapturePoint) -> bool:
    """Whether a rank holds only a feature slice of this point's tensor (its role is sharded)."""
    return point.role in SHARDED_ROLES


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
                partial_caps[f"{base}.partial.rank{r}"] = replace(pr, name=f"{base}.partial.rank{r}", kind=PointKind.LINEAR,
                                                                  op=f"Linear partial, rank {r} of {k}")
            continue
        p = by_name.get(cname)
        if p is not None and _sharded(p) and k > 1 and rec.tensor.numel():
            tensor = _merge(cname, rec, [per_rank[r]["captures"][cname] for r in range(k)], p.kind, p.role)
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
        token_ids, points, window, decode, meta: as :func:`tracer.engines.hf.run.execute`.

    Returns:
        ``(run, partials)``: the run as rank 0 captured it, sharded captures concatenated over
        the ranks (CPU tensors, the model's dtype, ``(T, *feature)`` as for an unsharded run);
        ``partials`` (with ``plan.tp.partials``) holds ``<row-parallel module>.partial.rank<r>``,
        ``(T, N)`` each, before the all_reduce; otherwise None.

    Raises:
        TracerError: bad K, missing backend, an unshardable model (all before anything is
            spawned); a rank that failed or died (every rank stopped, nothing returned).
    """
    tp = plan.tp
    k = tp.k
    device = str(model_device(model))
    backend = check_world(k, device)
    check_shardable(model, k, vocab_parallel=tp.vocab_parallel)
    limit = timeout_s()
    threads = max(1, torch.get_num_threads() // k)
    store = open_store(limit)
    scratch = scratch_dir()
    job = Job(model=model, token_ids=list(token_ids), plan=plan, points=list(points), window=tuple(window),
              decode=decode, meta=dict(meta or {}), backend=backend, world=k, port=store.port, scratch=scratch,
              threads=threads, timeout_s=limit, socket_ifname=loopback_ifname())
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(k)]  # (reader for the rank, writer for the job)
    procs = [ctx.Process(target=rank_main, args=(r, pipes[r][0], os.getpid()), daemon=True, name=f"tracer-tp-rank{r}")
             for r in range(k)]
    try:
        if say is not None:
            say(f"run {plan.name}: starting {k} {backend} rank(s)")
        for p, (reader, _) in zip(procs, pipes):
            p.start()
            reader.close()
        for _, writer in pipes:  # each rank has armed its parent-death signal before it reads this
            with contextlib.suppress(OSError):  # a rank that died already: watch() names it
                writer.send(job)
            writer.close()
        watch(procs, scratch, limit)
        per_rank = [torch.load(os.path.join(scratch, f"rank{r}.pt"), weights_only=False) for r in range(k)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
        for reader, writer in pipes:
            reader.close()
            writer.close()
        shutil.rmtree(scratch, ignore_errors=True)
        del store
    run, partials = _assemble(points, per_rank, plan, token_ids, tuple(window), plan.name)
    run.meta.update({"device": device, "tp_world_size": k, "tp_backend": backend, "tp_launcher": "tracer (spawn)",
                     "tp_threads_per_rank": threads})
    return run, partials


def open_store(timeout: float) -> Any:
    """The parent's rendezvous: a ``TCPStore`` served on a socket tracer binds to 127.0.0.1 itself
    (a store given a port binds every interface; this one is reachable from this machine only), on
    a port the OS picks (no race for a "free" port).

    Raises:
        TracerError: this torch cannot serve a store on a given socket.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=_dt.timedelta(seconds=timeout), master_listen_fd=sock.fileno())
    except (TypeError, RuntimeError, ValueError) as e:
        sock.close()
        raise TracerError(f"torch {torch.__version__} cannot serve the rendezvous on a loopback socket "
                          f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); "
                          "use torch >= 2.4, or --tp-mode simulated") from None
    sock.detach()  # the store owns the listening socket now (it closes it)
    return store


#: prefix of the scratch folders of distributed runs (``tracer-tp-<PID>.<random>.tmp`` in the temp dir)
SCRATCH_PREFIX = "tracer-tp-"


def scratch_dir() -> str:
    """A new scratch folder for the ranks' results, named after this process; the folders of
    earlier runs whose process is gone (a ``kill -9``) are removed first."""
    clean_stale_temp_dirs(Path(tempfile.gettempdir()), SCRATCH_PREFIX)
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}.", suffix=".tmp")


def loopback_ifname() -> str | None:
    """The loopback interface's name (``lo``) when this machine has one, else None."""
    with contextlib.suppress(OSError, AttributeError):
        names = [name for _, name in socket.if_nameindex()]
        return next((n for n in names if n == "lo" or n.startswith("lo0")), None)
    return None


def header_facts(plan: Any, device: str) -> dict[str, Any]:
    """What the trace header records about a distributed TP plan: world size, backend, NCCL
    version and the NCCL_ALGO/NCCL_PROTO settings (None when unset), sharding, collective, the
    rendezvous (where its store listens) and the interface the collectives' sockets use."""
    tp = plan.tp
    backend = backend_for(device)
    nccl = None
    if backend == "nccl":
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    env = dict(os.environ)
    if backend == "nccl":
        env.setdefault("NCCL_NVLS_ENABLE", "0")
    if plan.deterministic and backend == "nccl":
        env.setdefault("NCCL_ALGO", "Ring")
        env.setdefault("NCCL_PROTO", "Simple")
    joined = torchrun_rank() is not None
    ifname = None if joined else loopback_ifname()
    sockets = "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"
    return {
        "mode": "distributed", "world_size": tp.k, "backend": backend, "nccl_version": nccl,
        "NCCL_ALGO": env.get("NCCL_ALGO"), "NCCL_PROTO": env.get("NCCL_PROTO"),
        "NCCL_NVLS_ENABLE": env.get("NCCL_NVLS_ENABLE"),
        "sharding": "tracer (column-parallel q/k/v/gate/up, row-parallel o/down + all_reduce"
                    + ("; vocab-parallel embedding and lm_head" if tp.vocab_parallel else "") + ")",
        "collective": "all_gather + sum in rank order (deterministic)" if plan.deterministic
        else f"torch.distributed.all_reduce ({backend})",
        "threads_per_rank": (torch.get_num_threads() if torchrun_rank() is not None
                             else max(1, torch.get_num_threads() // tp.k)) if backend == "gloo" else None,
        "partials": bool(tp.partials),
        "launcher": "torchrun" if joined else "tracer (torch.multiprocessing spawn)",
        "rendezvous": (f"torchrun's store at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}" if joined
                       else "TCPStore served by the parent on 127.0.0.1 only (loopback; an OS-picked port)"),
        "socket_ifname": env.get(sockets, ifname),
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
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if plan.tp.k != world:
        raise TracerError(f"--tp {plan.tp.k} differs from torchrun's world size {world}; "
                          f"pass --tp {world} or start torchrun with --nproc-per-node {plan.tp.k}")
    device = str(model_device(model))
    backend = backend_for(device)
    check_shardable(model, world, vocab_parallel=plan.tp.vocab_parallel)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
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
    mine = run_rank(copy.deepcopy(model), rank, world, backend, local, plan, points, token_ids, tuple(window),
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
    """The ``tp-distributed`` executor of :mod:`tracer.engines.door`: run B over K ranks
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


def check_distributed(plans: list[Any], device: str | None, *, verdict: bool = False, dispatched: bool = False,
                      model: Any = None) -> None:
    """Refuse distributed TP ``plans`` this machine or this run cannot start, before anything is spawned:
    K larger than the GPUs, a missing backend, ``--verdict`` or ``--device-map`` with it, and (given the
    loaded ``model``) K not dividing the heads, KV heads or sharded dimensions.

    Raises:
        TracerError: one line naming the problem and what to do.
    """
    for plan in plans:
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
