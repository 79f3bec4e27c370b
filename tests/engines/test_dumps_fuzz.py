"""Seeded fuzz of engine-dump metadata and tensor kinds (issue 37 items 2, 3, 8): every mutated
dumper folder gives an answer or a one-line TracerError, never a traceback, a hang or a crash.

A small SGLang dumper folder (2 TP ranks, 2 steps: input_ids, positions, the embedding, two
decoder layers as ``(hidden, residual)``, the final norm, next-token logits) is mapped onto a
reference layout of the same names (``map_dump``, what ``tracer compare REF DUMP`` and ``tracer
import`` run after reading). Each case edits one file: a meta field set to a wild value (ranks and
sizes, step, dims, name, layer_id, the parallel-info dicts), or its value replaced by another
kind of tensor (sparse, stride 0, complex, bool, 0-d, a list, a huge expand). A spawned worker
(:class:`tests.helpers.Worker`, restarted after a hang or crash) answers each case under a timeout,
with 1 GB of input budget.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import Worker

N_CASES = int(os.environ.get("TRACER_DUMP_FUZZ_CASES", "90"))
SEED = 37
CASE_TIMEOUT_S = 60.0
H, V, T = 8, 16, 3  # hidden width, vocabulary, tokens per step
IDS = [5, 3, 9, 1, 7, 2]


def outcome(path: str):
    from tracer.errors import TracerError
    from tracer.engines.dumps.namemap import RefLayout, map_dump
    from tracer.engines.dumps.rules import load_engine_map
    from tracer.engines.dumps.read import read_dump

    ref = RefLayout(names={"model.embed_tokens": ("embedding", "Embedding", (H,), "float32"),
                           "model.layers.0": ("layer", "Layer", (H,), "float32"),
                           "model.layers.1": ("layer", "Layer", (H,), "float32"),
                           "model.norm": ("final_norm", "RMSNorm", (H,), "float32"),
                           "lm_head": ("logits", "Linear", (V,), "float32")},
                    layer_prefix="model.layers", n_layers=2, token_ids=IDS, window=(0, len(IDS)), family="llama")
    try:
        m = map_dump(read_dump(path), ref, load_engine_map("llama", None))
        return "ok", repr((m.positions, sorted(m.tensors), sorted(m.partial_logits)))
    except TracerError as e:
        return "error", str(e)
    except Exception as e:  # noqa: BLE001 - the fuzz reports it as a failure
        return "exception", f"{type(e).__name__}: {e}"


def _worker(conn) -> None:
    os.environ["TRACER_INPUT_BUDGET"] = str(1 << 30)
    while True:
        path = conn.recv()
        if path is None:
            return
        conn.send(outcome(path))


def _write(folder: Path) -> None:
    """The dumper folder: per step (3 tokens) and TP rank, SGLang's files with their meta."""
    g = torch.Generator().manual_seed(0)
    folder.mkdir()
    for step in range(2):
        rows = slice(step * T, (step + 1) * T)
        emb, h0, h1, norm = (torch.randn(len(IDS), H, generator=g) for _ in range(4))
        logits = torch.randn(1, V, generator=g)
        for rank in range(2):
            files = [("input_ids", torch.tensor(IDS[rows]), None), ("positions", torch.arange(len(IDS))[rows], None),
                     ("non_intrusive__model.embed_tokens.output", emb[rows], None),
                     ("non_intrusive__model.layers.0.output.0", h0[rows], 0),
                     ("non_intrusive__model.layers.0.output.1", emb[rows], 0),
                     ("non_intrusive__model.layers.1.output.0", h1[rows], 1),
                     ("non_intrusive__model.layers.1.output.1", h0[rows], 1),
                     ("non_intrusive__model.norm.output.0", norm[rows], None),
                     ("non_intrusive__model.norm.output.1", h1[rows], None),
                     ("non_intrusive__logits_processor.output.next_token_logits", logits, None)]
            for i, (name, value, layer) in enumerate(files):
                tags = {"step": step, "rank": rank, "dump_index": i + 1, "name": name}
                if layer is not None:
                    tags["layer_id"] = layer
                meta = {**tags, "world_rank": rank, "world_size": 2,
                        "sglang_parallel_info": {"tp_rank": rank, "tp_size": 2, "pp_rank": 0, "pp_size": 1}}
                torch.save({"value": value.clone(), "meta": meta},
                           folder / ("___".join(f"{k}={v}" for k, v in tags.items()) + ".pt"))


_WILD = [0, -1, 1, 2, 3, 2**31, 10**12, 2**40 - 1, 2**62, "1", "x", "", None, True, 1.5, float("nan"), [], {}, [1, 2],
         "t h[tp]", "t h(tp,partial)", "(a*b)[tp]", "t h[tp] # dp:=x", "h" * 300]
_META_KEYS = ["step", "rank", "dump_index", "name", "layer_id", "world_rank", "world_size", "dims", "tokenizer_path"]
_INFO_KEYS = ["tp_rank", "tp_size", "pp_rank", "pp_size", "cp_rank", "cp_size", "dp_rank", "dp_size", "sp_size",
              "vpp_size"]


def _tensor(rng: random.Random, like: torch.Tensor):
    kind = rng.choice(["sparse", "stride0", "huge", "complex", "bool", "int", "scalar", "list", "empty", "nan",
                       "wide", "3d", "fp16", "transposed"])
    if kind == "sparse":
        return like.to_sparse() if like.dim() else like, kind
    if kind == "stride0":
        return like.reshape(-1)[:1].expand(rng.choice([7, 10**6, 10**9])), kind
    if kind == "huge":
        return torch.zeros(1).expand(10**11), kind
    if kind == "complex":
        return like.to(torch.complex64), kind
    if kind == "bool":
        return like > 0, kind
    if kind == "int":
        return like.to(torch.int64), kind
    if kind == "scalar":
        return torch.tensor(3.0), kind
    if kind == "list":
        return [like, None, like], kind
    if kind == "empty":
        return like[:0], kind
    if kind == "nan":
        return torch.full_like(like, float("nan")) if like.is_floating_point() else like, kind
    if kind == "wide":
        return torch.cat([like, like], dim=-1) if like.dim() else like, kind
    if kind == "3d":
        return like.unsqueeze(0), kind
    if kind == "fp16":
        return like.half() if like.is_floating_point() else like, kind
    return like.t() if like.dim() == 2 else like, kind


def _mutate(folder: Path, rng: random.Random) -> str:
    """Edit one file of ``folder`` in place; returns what was done."""
    path = rng.choice(sorted(folder.iterdir()))
    data = torch.load(path, weights_only=True)
    target = rng.choice(["meta", "meta", "info", "info", "tensor"])
    if target == "meta":
        key, value = rng.choice(_META_KEYS), rng.choice(_WILD)
        data["meta"][key] = value
        what = f"meta.{key} = {value!r}"[:80]
    elif target == "info":
        which = rng.choice(["sglang_parallel_info", "megatron_parallel_info"])
        info = dict(data["meta"].get("sglang_parallel_info", {}))
        key, value = rng.choice(_INFO_KEYS), rng.choice(_WILD)
        info[key] = value
        data["meta"][which] = info
        what = f"{which}.{key} = {value!r}"[:80]
    else:
        data["value"], kind = _tensor(rng, data["value"])
        what = f"value -> {kind}"
    torch.save(data, path)
    return f"{path.name}: {what}"


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dumpfuzz") / "dump"
    _write(folder)
    return folder


def test_the_dump_maps_as_built(dump):
    status, detail = outcome(str(dump))
    assert status == "ok" and "'model.layers.1'" in detail and "lm_head" in detail, detail


def test_mutated_dump_metadata_gives_an_answer_or_one_line_error(dump, tmp_path):
    worker = Worker(_worker)
    bad, counts = [], {"ok": 0, "error": 0}
    try:
        rng = random.Random(SEED)
        for i in range(N_CASES):
            case = tmp_path / f"case{i % 2}"
            if case.exists():
                shutil.rmtree(case)
            shutil.copytree(dump, case)
            what = _mutate(case, rng)
            status, detail = worker.ask(str(case), CASE_TIMEOUT_S)
            if status in counts and (status == "ok" or (detail and "\n" not in detail)):
                counts[status] += 1
            else:
                bad.append((i, what, status, detail[:300]))
                shutil.copytree(case, tmp_path / f"bad-{i}")
    finally:
        worker.close()
    assert not bad, f"{len(bad)} mutation(s) gave a traceback, hang or crash: {bad[:5]}"
    print(json.dumps(counts))
    assert counts["error"] > N_CASES // 4, counts  # most edits are refused by their values
