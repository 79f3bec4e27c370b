"""A KV cache handed from a producer vLLM to a consumer vLLM with vLLM's own ``ExampleConnector``, both
in this process, the consumer captured with hooks (what each run does: :mod:`tracer.engines.vllm.connector`).

Each connected LLM has its own worker-side connector agent, set as vLLM's process-wide global only
while that engine steps (:func:`tracer.engines.vllm.llm._kv_state`, ``VllmEngine.active``).

The consumer's ``kv_cache`` points of run B hold the cache **as transferred** at the handed-over
positions (the producer's files, as the consumer loaded them) and as the consumer computed it after
them; run A's hold what the consumer computed everywhere: the comparison of the two is the KV cache
as transferred against the KV cache as the consumer computes it.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tracer.engines.vllm.assemble import settle_records
from tracer.engines.vllm.engine import execute_loaded
from tracer.engines.vllm.running import engine_for
from tracer.engines.vllm.layout import engine_map, ref_layout
from tracer.engines.vllm.capture import VllmCapture
from tracer.engines.vllm.connector import (BOUNDARY, TOKEN_ROW_BACKENDS, contract, difference, model_dims, role, sides,
                                          transferred, transferred_kv, unit_of)
from tracer.engines.vllm.plan import VllmSettings
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.records import RunRecord, ScheduledRequest, SchedulerFacts, SchedulerStep
from tracer.plan.checks import PREFILL_DECODE_REFUSED
from tracer.load.kv_contract import (KV_CONTRACT_FILE, KvTransfer, check_kv_contract, read_kv_contract, require_kv,
                                     tokens_sha256, write_kv_contract)

_ROOT: list[Path] = []


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def _folder(side: str, settings: VllmSettings) -> str:
    """The connector folder of one side's settings: under a temporary folder of this process (removed at exit)."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="tracer-kv-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    key = abs(hash((side, settings))) % (1 << 40)
    return str(_ROOT[0] / f"{side}-{key:x}")


def _empty(folder: str | Path) -> Path:
    """``folder``, emptied (a connector folder: what an earlier run left there is gone)."""
    path = Path(folder)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def connected(loaded: Any, side: str, settings: dict[str, Any], say: Callable[[str], None] | None) -> Any:
    """The engine of one side (``producer`` / ``consumer``): ``settings`` with vLLM's ExampleConnector
    over a folder of its own, built with its own worker-side agent (module docstring).

    Raises:
        TracerError: as :func:`tracer.engines.vllm.running.engine_for`.
    """
    base = VllmSettings(**settings)
    s = replace(base, kv_role=f"kv_{side}", kv_path=_folder(side, base))
    eng = engine_for(loaded, s, say)  # built with its own worker-side agent (llm._kv_state)
    if eng.kv_agent is None:
        raise TracerError(f"vLLM {_version()} built no KV connector for the {side}; tracer hands the KV "
                          "cache over with vLLM's ExampleConnector (kv_transfer_config)")
    return eng


def consumer_facts(loaded: Any, plan: Any) -> dict[str, Any]:
    """The facts of the consumer a ``prefill-decode`` plan runs on (built now with its connector, and
    reused by the run)."""
    return connected(loaded, "consumer", sides(plan)[0], None).facts()


def _dims(loaded: Any) -> tuple[int, int, int, str]:
    return model_dims(loaded.model)


def produce(loaded: Any, token_ids: list[int], producer: dict[str, Any], say: Callable[[str], None] | None) -> Path:
    """Prefill the prompt on the producer (one greedy token, no hooks): its connector writes the KV cache;
    tracer writes the producer's KV contract beside the files. Returns the folder of files.

    Raises:
        TracerError: the producer wrote no cache (one line).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = connected(loaded, "producer", producer, say)
    root = _empty(eng.settings.kv_path)
    with eng.active(), torch.inference_mode():
        eng.llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)
    written = [d for d in root.iterdir() if d.is_dir() and any(d.glob("*.safetensors"))]
    if len(written) != 1:
        raise TracerError(f"vLLM's ExampleConnector on the producer wrote {len(written)} KV caches into {root} for one "
                          "prompt; expected one folder of per-layer files")
    rows = _rows(written[0])
    mine = contract(producer, _dims(loaded), len(token_ids), facts=eng.facts(), tokens_sha256=tokens_sha256(token_ids[:rows]))
    write_kv_contract(replace(mine, positions=(0, rows)), written[0])  # what the files hold, not what was planned
    return written[0]


def _rows(folder: Path) -> int:
    """How many token rows the producer's files hold (the first layer's ``kv_cache``, read from its header):
    vLLM's ExampleConnector stores a chunked prefill's first chunk only, under the whole prompt's name."""
    from safetensors import safe_open

    first = sorted(folder.glob("*.safetensors"))[0]
    with safe_open(str(first), framework="pt") as fh:
        return int(fh.get_slice("kv_cache").get_shape()[0])


def hand_over(src: Path, consumer_folder: str | Path) -> Path:
    """Copy the producer's folder (files and contract) into the consumer's connector folder: the boundary."""
    dst = Path(consumer_folder) / src.name
    shutil.copytree(src, dst)
    return dst


def execute_run(loaded: Any, token_ids: list[int], plan: Any, points: list[Any], window: tuple[int, int],
                **options: Any) -> tuple[RunRecord, None]:
    """The vLLM ``run`` executor: :func:`execute_transfer` for a plan with a KV hand-over (run A or B of
    ``prefill-decode``), else :func:`tracer.engines.vllm.engine.execute_loaded`."""
    if role(plan) is None:
        return execute_loaded(loaded, token_ids, plan, points, window, **options)
    return execute_transfer(loaded, token_ids, plan, points, window, **options)


def execute_transfer(loaded: Any, token_ids: list[int], plan: Any, points: list[Any], window: tuple[int, int], *,
                     keep_on_device: bool = False, decode: int = 0, meta: dict[str, Any] | None = None,
                     say: Callable[[str], None] | None = None, kernels: bool = False, sdpa_inputs: bool = False,
                     engine_options: dict[str, Any] | None = None) -> tuple[RunRecord, None]:
    """One run of ``prefill-decode`` (:mod:`tracer.engines.vllm.connector`): run A (``miss``) the consumer
    alone; run B (``load``) the producer's KV cache handed over, its contract checked, then the consumer.
    The consumer prefills the prompt and greedy-decodes ``plan.generate`` tokens, captured at the
    window's positions (prompt rows and decode steps) and every position's KV cache.

    Returns:
        ``(run, None)`` as :func:`tracer.engines.vllm.engine.execute_loaded`, with ``meta["generated"]``
        (the greedy continuation) and ``meta["kv_transfer"]`` (role, tokens handed over, files, the
        producer's difference, whether the handed-over cache is compared at the kv_cache points and
        why not, the contract check's document).

    Raises:
        TracerError: ``--kernels``/``--op-replay``/``--decode`` (not with a hand-over), a fatal contract
            difference (before the consumer runs), or a hand-over that moved nothing (vLLM's
            ``num_cached_tokens``: one line, never a silent bit-identical).
    """
    if kernels or sdpa_inputs or decode:
        raise TracerError(PREFILL_DECODE_REFUSED)  # a caller that skipped validation (the API's own path)
    meta = dict(meta or {})
    consumer, producer = sides(plan)
    n, t = len(token_ids), int(plan.generate)
    how = role(plan)
    check, files = None, 0
    src = produce(loaded, token_ids, producer, say) if how == "load" else None
    cons = connected(loaded, "consumer", consumer, say)
    n_moved = transferred(n, cons.settings.block_size) if how == "load" else 0
    folder = _empty(cons.settings.kv_path)
    if src is not None:
        dst = hand_over(src, folder)
        files = len(list(dst.glob("*.safetensors")))
        mine = contract(consumer, _dims(loaded), n, facts=cons.facts(), tokens_sha256=tokens_sha256(token_ids[:n_moved]))
        check = require_kv(check_kv_contract(read_kv_contract(dst), mine, BOUNDARY))
    run, cap, req = _consume(loaded, cons, token_ids, points, window, t)
    got = int(req.num_cached_tokens)
    if got != n_moved:
        what = ("no KV cache crossed: the consumer computed every position itself" if got == 0 else
                f"the consumer loaded {got} tokens")
        raise TracerError(f"prefill-decode run {plan.name}: vLLM reported num_cached_tokens {got}, the hand-over needs "
                          f"{n_moved}: {what} (the ExampleConnector finds a cache by the hash of the first "
                          f"(N-2)//B*B tokens); nothing to compare")
    kv_points = {p.layer_index: p.name for p in points if p.kind == PointKind.KV_CACHE}
    unit = unit_of(check.consumer.layout)[0] if check is not None else ""
    unread = None
    if n_moved and not kv_points:
        unread = "no kv_cache points were captured (--no-kv-cache)"
    elif n_moved and not unit:  # rows tracer cannot read yet
        backend = (check.consumer.attention_backend if check else "") or "?"
        unread = (f"the rows of attention backend {backend} are not decoded (tracer reads CPU_ATTN's block rows and "
                  f"the token rows of {', '.join(TOKEN_ROW_BACKENDS)} on a GPU)")
        cap.kv_missing_why = f"positions 0..{n_moved - 1} were handed over, and {unread}"
        cap.notes.append(f"the handed-over KV cache is not compared: {unread}; the kv_cache points of run {plan.name} "
                         f"lack positions 0..{n_moved - 1}")
    elif n_moved:  # the handed-over positions: the cache as transferred, where the consumer computed nothing
        dev = next((parts[0][1].device for parts in cap.kv.values() if parts), torch.device("cpu"))
        block = int(dict(producer).get("block_size", cons.settings.block_size))
        for layer, rows in transferred_kv(dst, kv_points, n_moved, block, dev, unit).items():
            cap.kv.setdefault(layer, []).insert(0, (np.arange(n_moved), rows))
    return _record(loaded, cons, token_ids, plan, points, window, run, cap, req, keep_on_device, meta, KvTransfer(
        role=how, transferred=n_moved, files=files, boundary=BOUNDARY, producer=difference(plan),
        kv_compared=bool(n_moved) and unread is None, kv_not_compared=unread, contract=check,
        contract_file=str(src / KV_CONTRACT_FILE) if src is not None else None).to_dict()), None


def _consume(loaded: Any, eng: Any, token_ids: list[int], points: list[Any], window: tuple[int, int],
             t: int) -> tuple[dict[str, Any], VllmCapture, Any]:
    """The consumer's request (the prompt, ``t`` greedy tokens) under the capture hooks; returns
    ``(timing, capture, vLLM's RequestOutput)``."""
    n = len(token_ids)
    emap = engine_map(loaded.info.family)
    ref = ref_layout(loaded, points, token_ids, window)
    kv_points = {p.layer_index: p.name for p in points if p.kind == PointKind.KV_CACHE}
    cap = VllmCapture(eng.model, eng.runner, emap, ref, token_ids, window, kv_points, kv_positions=n + t - 1,
                      block_size=eng.settings.block_size, positions=n + t - 1)
    t0 = time.perf_counter()
    with eng.active(), torch.inference_mode(), cap:
        label, = eng.labels(1)
        cap.follow(label, list(token_ids))
        (ext, internal), = eng.start([list(token_ids)], max_tokens=t, labels=[label])
        out = eng.finish()[ext]
        cap.close(ext)
    return {"wall_s": time.perf_counter() - t0, "internal": internal, "label": ext}, cap, out


def _record(loaded: Any, eng: Any, token_ids: list[int], plan: Any, points: list[Any], window: tuple[int, int],
            run: dict[str, Any], cap: VllmCapture, out: Any, keep_on_device: bool, meta: dict[str, Any],
            transfer: dict[str, Any]) -> RunRecord:
    """The consumer's :class:`RunRecord` (as :func:`tracer.engines.vllm.engine.execute_loaded` writes one)."""
    captures, info = cap.records(points, f"vLLM {_version()}")
    captures, logits = settle_records(captures, info, window, keep_on_device)
    generated = [int(x) for x in out.outputs[0].token_ids]
    request = ScheduledRequest(run["label"], run["internal"], len(token_ids), True, int(out.num_cached_tokens or 0),
                               tuple(generated))
    steps = [s for s in cap.steps if s["traced"]]
    facts = eng.facts()
    record_meta = {
        "wall_s": run["wall_s"], "device": facts["device"], "gemm_m": [s["tokens"] for s in steps], "engine": facts,
        "cached_tokens": request.num_cached_tokens,
        "scheduler": SchedulerFacts(
            "one-step", (request,), tuple(SchedulerStep.from_dict(s) for s in steps),
            tuple(tuple(x["positions"]) for s in steps for x in s["traced"] if x["request"] == run["label"]),
            info["mapping"], tuple(info["notes"]), cap.runner).to_dict(),
        "not_captured": info["not_captured"], "logits": logits, "generated": generated, "kv_transfer": transfer, **meta}
    return RunRecord(name=plan.name, token_ids=list(token_ids), plan=plan.to_dict(), window=(int(window[0]), int(window[1])),
                     captures=captures, meta=record_meta, extras={"partial_logits": info["partial_logits"]})


__all__ = ["connected", "consumer_facts", "produce", "hand_over", "transferred_kv", "execute_run", "execute_transfer"]
