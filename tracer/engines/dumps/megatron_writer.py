"""Writing a stored HF run as a Megatron-LM trainer's dump: a **synthetic** trainer dump, for examples and tests.

No Megatron runs here. This takes the sublayer captures of one run of a trace (made by hooks on the
HF model) and writes the files SGLang's dumper (non-intrusive mode ``all``) writes when Miles
registers it on a Megatron model chunk (``miles/utils/dumper_utils.py``, ``DumperMegatronUtil``):

- file names ``step=S___rank=R___dump_index=I___name=NAME___recompute_status=disabled[___layer_id=L].pt``
  in ``<out>/<exp_name>/`` (Miles' phase names: ``fwd_only``, ``fwd_bwd``), each
  ``torch.save({"value": tensor, "meta": {...}})``; ``rank`` is the world rank (Megatron's order:
  TP fastest, then CP, then PP), the static meta holds ``world_rank``, ``world_size``,
  ``megatron_parallel_info`` (``tp_*``, ``pp_*``, ``dp_*``, ``cp_*``, ``vpp_*``, ``ep_*``, and
  ``sp_rank``/``sp_size`` under sequence parallelism) and, as in a Miles process that has SGLang
  installed, an ``sglang_parallel_info`` holding only error flags;
- megatron-core GPTModel module names behind Miles' wrappers (``module.module.`` =
  DDP(Float16Module(GPTModel))) and their semantics (``hooks/engine-megatron.toml``): ``[s, b, ...]``
  activations (b = 1), the fused ``linear_qkv`` with each query group's q heads, k head and v head
  side by side and ``linear_fc1`` with each rank's ``[gate_r | up_r]``, column-parallel outputs
  sharded over ``tp`` ranks (one file per rank), row-parallel and replicated outputs whole on
  every rank, or split along the sequence under ``sp``; ``output_layer``'s logits with the
  vocabulary padded to a multiple of ``vocab_multiple × tp``; the ``[b, s, vocab/tp]`` logits of the
  model chunk;
- the token fields of the root's forward call: ``input_ids`` ``[1, s]`` and ``position_ids``
  (``tokens="position_ids"``), or THD packing's ``cu_seqlens_q``/``cu_seqlens_kv``/``qkv_format``
  (``tokens="thd"``), or neither (``tokens="bshd"``: positions 0..s-1);
- the sequence padded (pad id 0, rows of zeros) to a multiple of ``2 × cp`` (× ``tp`` under SP), as
  Miles pads packed sequences; context parallelism: the sequence cut into ``2 × cp`` chunks, CP rank
  r holding chunks r and 2·cp − 1 − r (Megatron's load-balanced split), its own ``input_ids`` and
  activations;
- pipeline parallelism: the layers split evenly over ``pp`` stages, numbered from 0 on every stage,
  the modules inside a layer tagged with the global ``layer_id`` (the dumper's layer context);
- ``spec="te"``: Transformer Engine's spec, where the norms are fused into ``linear_qkv`` /
  ``linear_fc1`` and ``input_layernorm`` / ``pre_mlp_layernorm`` are ``IdentityOp`` (their output is
  their input, which the dumper also writes as ``inputs.0``).

What it cannot reproduce: the trainer's own kernels (the values are HF's, bit for bit), module
inputs other than the norms', gradients. The positions written are the run's kept window
(``tokens="thd"``/``"bshd"`` need it to start at position 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracer.errors import TracerError
from tracer.execute.kinds import PointKind

_PREFIX = "module.module."


def _groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``linear_qkv`` columns: its ``groups/tp`` query groups, each ``[q heads | k | v]``."""
    per = [x.shape[-1] // groups for x in (q, k, v)]
    g = groups // tp
    cols = [torch.cat([x[..., (rank * g + j) * w:(rank * g + j + 1) * w] for x, w in zip((q, k, v), per)], dim=-1)
            for j in range(g)]
    return torch.cat(cols, dim=-1)


def _columns(t: torch.Tensor, tp: int, rank: int, what: str) -> torch.Tensor:
    w = t.shape[-1]
    if w % tp:
        raise TracerError(f"{what}: width {w} does not split into {tp} TP shards; pick a tp that divides it")
    return t[..., rank * (w // tp):(rank + 1) * (w // tp)]


def _layer_items(get: Any, i: int, hf: dict[str, str], prev: torch.Tensor, spec: str) -> list[tuple[str, Any, str, Any]]:
    """``(layer-relative module, value, style, input 0 or None)`` of decoder layer ``i``, in execution order.

    Styles: ``replicated`` (whole on every TP rank; split along the sequence under SP), ``column``
    (TP shards of the last dim), ``qkv`` (q, k, v grouped per query group), ``fc1`` ([gate_r | up_r]).
    """
    attn = get(hf["attention"])
    mid = prev + attn  # HF: hidden_states = residual + hidden_states (the residual before the MLP)
    norm_in = prev if spec == "te" else get(hf["attn_norm"])  # TE: IdentityOp (the norm is fused into linear_qkv)
    norm_mlp = mid if spec == "te" else get(hf["mlp_norm"])
    return [
        ("input_layernorm", norm_in, "replicated", prev),
        ("self_attention.linear_qkv", [get(hf[f"{x}_proj"]) for x in "qkv"], "qkv", None),
        ("self_attention.core_attention", get(hf["attention_core"]), "column", None),
        ("self_attention.linear_proj", get(hf["o_proj"]), "replicated", None),
        ("self_attention", attn, "replicated", None),
        ("pre_mlp_layernorm", norm_mlp, "replicated", mid),
        ("mlp.linear_fc1", [get(hf["gate_proj"]), get(hf["up_proj"])], "fc1", None),
        ("mlp.linear_fc2", get(hf["down_proj"]), "replicated", None),
        ("mlp", get(hf["mlp"]), "replicated", None),
        ("", get(hf["layer"]), "replicated", None),
    ]


def _cp_rows(n: int, cp: int, rank: int) -> torch.Tensor:
    """Row indices CP rank ``rank`` holds of ``n`` rows (a multiple of 2·cp: chunks rank and 2·cp − 1 − rank)."""
    c = n // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def write_megatron_dump(trace: str, run: str, out: str | Path, *, tp: int = 2, sp: bool = False, cp: int = 1,
                        pp: int = 1, spec: str = "local", tokens: str = "position_ids", exp_name: str = "fwd_only",
                        vocab_multiple: int = 128, perturb: dict[str, float] | None = None) -> Path:
    """Write run ``run`` of ``trace`` (captured with ``granularity="sublayers"``) as a Megatron trainer's dump.

    Args:
        trace, run: the HF run to express (e.g. the trainer run B of ``rollout-vs-train``); its
            kept window is the sequence the trainer computed.
        out: the dumper's ``dir``; files go to ``out/exp_name/``.
        tp: tensor-parallel ranks (must divide the model's KV heads: Megatron shards query groups).
        sp: sequence parallelism (replicated outputs split along the sequence over the TP ranks).
        cp: context-parallel ranks (the zigzag split of the sequence).
        pp: pipeline stages (must divide the number of layers).
        spec: ``local`` (norm modules) or ``te`` (Transformer Engine: the norms are IdentityOps).
        tokens: ``position_ids``, ``thd`` (``cu_seqlens_q``, ``qkv_format``) or ``bshd`` (ids only).
        vocab_multiple: Megatron's ``make_vocab_size_divisible_by``; the vocabulary is padded to a
            multiple of it times ``tp`` with zero logits.
        perturb: ``{HF capture name: delta}``: add ``delta`` to that point's tensor before writing.

    Returns:
        the folder written (``out/exp_name``).

    Raises:
        TracerError: the run lacks sublayer captures; ``out/exp_name`` is not empty; sizes that the
            ranks do not divide; ``thd``/``bshd`` tokens for a window not starting at 0; bad options.
    """
    from tracer.engines.dumps.sglang_writer import capture_getter, layer_roles
    from tracer.store.trace import TraceReader

    if spec not in ("local", "te") or tokens not in ("position_ids", "thd", "bshd") or min(tp, cp, pp) < 1:
        raise TracerError("spec is local|te, tokens position_ids|thd|bshd, tp/cp/pp >= 1")
    folder = Path(out) / exp_name
    if folder.exists() and any(folder.iterdir()):
        raise TracerError(f"{folder} exists and is not empty; choose another --out")
    with TraceReader(trace) as r:
        rec = r.run(run, load_tensors=False)
        names = r.capture_names(run)
        kv = (r.header.get("model") or {}).get("n_kv_heads")
        get = capture_getter(r, run, trace, perturb)

        kind = {n: r.capture_info(run, n)["kind"] for n in names}
        layers = [n for n in names if kind[n] == PointKind.LAYER]
        first = {k: next(n for n in names if kind[n] == k) for k in (PointKind.EMBEDDING, PointKind.FINAL_NORM,
                                                                       PointKind.LOGITS)}
        per_layer, prev = [], get(first["embedding"])
        for layer in layers:
            hf = layer_roles(r, run, names, layer)
            per_layer.append(_layer_items(get, len(per_layer), {**hf, "layer": layer}, prev, spec))
            prev = get(layer)
        model = {"embedding": get(first["embedding"]), "final": get(first["final_norm"]), "logits": get(first["logits"])}
        lo, hi = rec.window
        ids = torch.tensor(rec.token_ids[lo:hi], dtype=torch.long)
    if not isinstance(kv, int):
        raise TracerError(f"{trace} does not record the model's KV heads (traced by an older tracer); re-trace it")
    if kv % tp or len(layers) % pp:
        raise TracerError(f"tp {tp} must divide the {kv} KV heads and pp {pp} the {len(layers)} layers (as in Megatron)")
    if tokens != "position_ids" and lo != 0:
        raise TracerError(f"tokens={tokens} infers positions from 0 but run {run} kept {lo}..{hi - 1}; "
                          "trace the reference with --positions all or use tokens=position_ids")
    folder.mkdir(parents=True, exist_ok=True)
    shape = _Shape(tp=tp, sp=sp, cp=cp, pp=pp, groups=kv, vocab_multiple=vocab_multiple)
    # Megatron (Miles) pads each sequence to a multiple of 2 x cp (x tp under SP): pad id 0, rows of zeros here
    mult = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    n = -(-(hi - lo) // mult) * mult
    ids = torch.cat([ids, ids.new_zeros(n - (hi - lo))])
    for c in range(cp):
        rows = _cp_rows(n, cp, c) if cp > 1 else torch.arange(n)
        for p in range(pp):
            for t in range(tp):
                _write_rank(folder, shape, t, c, p, rows, ids, lo, per_layer, model, tokens)
    return folder


@dataclass(frozen=True)
class _Shape:
    """The parallel layout of a synthetic Megatron dump: TP, SP, CP, PP, query groups, vocabulary multiple."""

    tp: int
    sp: bool
    cp: int
    pp: int
    groups: int
    vocab_multiple: int


def _write_rank(folder: Path, shape: _Shape, t: int, c: int, p: int, rows: torch.Tensor, ids: torch.Tensor, lo: int,
                per_layer: list, model: dict, tokens: str) -> None:
    """Every file of one rank (TP rank t, CP rank c, PP stage p) for one forward pass (step 0)."""
    world = t + shape.tp * (c + shape.cp * p)
    info = {"tp_rank": t, "tp_size": shape.tp, "pp_rank": p, "pp_size": shape.pp, "dp_rank": 0, "dp_size": 1,
            "cp_rank": c, "cp_size": shape.cp, "vpp_rank": None, "vpp_size": None, "ep_rank": 0, "ep_size": 1,
            "etp_rank": t, "etp_size": shape.tp, "tcp_rank": t + shape.tp * c, "tcp_size": shape.tp * shape.cp,
            **({"sp_rank": t, "sp_size": shape.tp} if shape.sp else {})}
    static = {"world_rank": world, "world_size": shape.tp * shape.cp * shape.pp, "megatron_parallel_info": info,
              "sglang_parallel_info": {"distributed_error": True, "dp_attention_error": True}}
    index = 0

    def dump(name: str, value: Any, layer_id: int | None = None) -> None:
        nonlocal index
        index += 1
        tags = {"step": 0, "rank": world, "dump_index": index, "name": name, "recompute_status": "disabled"}
        if layer_id is not None:
            tags["layer_id"] = layer_id
        fname = "___".join(f"{k}={v}" for k, v in tags.items()) + ".pt"
        value = value.clone() if isinstance(value, torch.Tensor) else value
        torch.save({"value": value, "meta": {**tags, **static}}, folder / fname)

    def sbh(x: torch.Tensor, style: str) -> torch.Tensor:
        if x.shape[0] < len(ids):  # the padding tokens
            x = torch.cat([x, x.new_zeros(len(ids) - x.shape[0], *x.shape[1:])])
        x = x[rows]  # this CP rank's tokens
        if style == "replicated" and shape.sp:
            n = len(rows) // shape.tp
            x = x[t * n:(t + 1) * n]
        return x.unsqueeze(1)  # [s, b=1, ...]

    dump("input_ids", ids[rows].unsqueeze(0))
    if tokens == "position_ids":
        dump("position_ids", (rows + lo).unsqueeze(0))
    elif tokens == "thd":
        cu = torch.tensor([0, len(ids)], dtype=torch.int32)  # global lengths (THD with CP: the full sequence)
        dump("cu_seqlens_q", cu)
        dump("cu_seqlens_kv", cu)
        dump("qkv_format", "thd")
    per_stage = len(per_layer) // shape.pp
    if p == 0:
        dump(f"non_intrusive__{_PREFIX}embedding.output", sbh(model["embedding"], "replicated"))
    for local in range(per_stage):
        g = p * per_stage + local
        base = f"{_PREFIX}decoder.layers.{local}"
        for rel, value, style, inp in per_layer[g]:
            mod = f"{base}.{rel}" if rel else base
            tag = None if rel == "" else g  # the dumper clears the layer context before the layer's own output
            if inp is not None:
                dump(f"non_intrusive__{mod}.inputs.0", sbh(inp, "replicated"), tag)
            if style == "qkv":
                out = _groups(*value, shape.groups, shape.tp, t)
            elif style == "fc1":
                out = torch.cat([_columns(v, shape.tp, t, mod) for v in value], dim=-1)
            elif style == "column":
                out = _columns(value, shape.tp, t, mod)
            else:
                out = value
            dump(f"non_intrusive__{mod}.output", sbh(out, style if style == "replicated" else "column"), tag)
    if p == shape.pp - 1:
        dump(f"non_intrusive__{_PREFIX}decoder.final_layernorm.output", sbh(model["final"], "replicated"))
        dump(f"non_intrusive__{_PREFIX}decoder.output", sbh(model["final"], "replicated"))
        logits = model["logits"]
        step = shape.vocab_multiple * shape.tp
        padded = -(-logits.shape[-1] // step) * step
        logits = torch.cat([logits, logits.new_zeros(logits.shape[0], padded - logits.shape[-1])], dim=-1)
        shard = _columns(logits, shape.tp, t, "output_layer")
        dump(f"non_intrusive__{_PREFIX}output_layer.output", sbh(shard, "column"))
        dump(f"non_intrusive__{_PREFIX[:-1]}.output", sbh(shard, "column").transpose(0, 1))  # GPTModel: [b, s, vocab/tp]
    else:
        last = per_layer[(p + 1) * per_stage - 1][-1][1]
        dump(f"non_intrusive__{_PREFIX}decoder.output", sbh(last, "replicated"))


__all__ = ["write_megatron_dump"]
