"""The rank processes of a distributed tensor-parallel run B: what each rank does, and how the
parent watches them.

Each rank (:func:`worker`, a ``torch.multiprocessing`` spawn child started through
:func:`tracer.engines.tp.launch.rank_main`) joins the group through the parent's ``TCPStore``, shards its copy of the model (:mod:`tracer.engines.tp.shard`), executes the
plan with capture and saves its captures into the scratch folder; the parent (:func:`watch`)
waits for every rank and, on the first failure, kills the others and raises one
:class:`~tracer.errors.TracerError` naming the rank that failed first-hand.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import signal
import time
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tracer.errors import TracerError
from tracer.execute.family import family_for
from tracer.execute.points import CapturePoint
from tracer.engines.hf.run import execute
from tracer.engines.tp.shard import Reducer, shard_model

if TYPE_CHECKING:
    from tracer.plan.scenarios import RunPlan


#: environment variable: the rank that kills itself in the middle of run B (fault-injection for tests)
FAULT_ENV = "TRACER_TP_FAULT_RANK"


@dataclass
class Job:
    """Everything a worker needs (sent to the spawned rank over a pipe; tensors via shared memory).

    ``port`` is the parent's rendezvous store (on 127.0.0.1); ``socket_ifname`` the network
    interface gloo and NCCL bind their sockets to (the loopback, ``lo``) unless the user set
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; None leaves the libraries' default."""

    model: nn.Module
    token_ids: list[int]
    plan: RunPlan
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
    socket_ifname: str | None = None


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def _fault_hook(model: nn.Module, rank: int) -> None:
    """Fault injection for tests: rank ``$TRACER_TP_FAULT_RANK`` SIGKILLs itself when it reaches the
    middle decoder layer of run B (the other ranks are then inside or before a collective)."""
    if os.environ.get(FAULT_ENV, "") != str(rank):
        return
    layers = list(model.get_submodule(family_for(model).layers))
    target = layers[len(layers) // 2] if layers else model

    def die(*_: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    target.register_forward_pre_hook(die)


def run_rank(model: nn.Module, rank: int, world: int, backend: str, local_rank: int, plan: RunPlan,
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


def worker(rank: int, job: Job) -> None:
    """One rank of run B (started by :func:`tracer.engines.tp.launch.rank_main`, which tied its life
    to the parent's): join the group, shard, execute the plan with capture, save the captures."""
    _quiet()
    torch.set_num_threads(job.threads)
    if job.socket_ifname:  # the collectives' own sockets on the loopback too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", job.socket_ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", job.socket_ifname)
    if job.backend == "nccl":  # NVLink multicast (NVLS) off unless the user set it: its reductions are not ours to pin
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
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
        mine = run_rank(model, rank, job.world, job.backend, rank, job.plan, job.points, job.token_ids,
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


def watch(procs: list[Any], scratch: str, timeout_s: float) -> None:
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
