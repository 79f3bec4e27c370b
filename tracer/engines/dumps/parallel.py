"""The parallel layout of a dumper folder: which rank wrote each file, and which tokens its rows hold.

SGLang's dumper (``python/sglang/srt/debug_utils/dumper.py``) writes the same files from an SGLang
server and from a Megatron-LM trainer: Miles registers it on the Megatron model chunk
(``miles/utils/dumper_utils.py``, ``DumperMegatronUtil``: exp names ``fwd_only`` / ``fwd_bwd``,
files from effective DP rank 0 only). The static meta of every file says which framework ran:

- ``sglang_parallel_info``: ``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``, ``moe_*``, ``attn_*``;
- ``megatron_parallel_info``: ``tp_*``, ``pp_*``, ``dp_*``, ``cp_*``, ``vpp_*``, ``ep_*``, ``etp_*``
  and, with ``--sequence-parallel``, ``sp_rank``/``sp_size`` (the TP group).

A Megatron process with SGLang installed also writes an ``sglang_parallel_info`` holding only
error flags (SGLang's groups are not initialised there); the dict that has ``tp_rank`` is the
framework's. Token bookkeeping differs too: SGLang dumps the core fields ``input_ids`` and
``positions`` of each forward pass; Megatron the model's ``input_ids`` (``[b, s]``) and, when given,
``position_ids``, or a ``PackedSeqParams`` as ``cu_seqlens_q``/``cu_seqlens_kv``/``qkv_format``
(THD packing: positions restart at each sequence). Under context parallelism (CP) each CP rank
holds two of the ``2 × cp`` chunks of every sequence (Megatron's load-balanced "zigzag" split:
chunks ``r`` and ``2·cp − 1 − r``), its own ``input_ids`` and activations; tracer keeps each
(step, DP rank, CP rank) as its own part and places its rows by their positions. Under pipeline
parallelism (PP) Megatron numbers the layers of a stage from 0 (``decoder.layers.0`` on every
stage); the dumper tags the modules inside a layer with the global ``layer_id``, from which each
stage's offset is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tracer.errors import TracerError
from tracer.engines.dumps.namemap import tensor_digest as digest  # re-exported: the reader fingerprints inputs

#: the meta keys of the frameworks' parallel info (SGLang's comparator reads the same two)
PARALLEL_INFO_KEYS = ("sglang_parallel_info", "megatron_parallel_info")
#: Megatron's token bookkeeping (the dumper's core fields when it runs in a Megatron process)
MEGATRON_FIELDS = ("position_ids", "cu_seqlens_q", "cu_seqlens_kv", "qkv_format")
_LAYER_IN_PATH = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class Rank:
    """Where one dump file comes from.

    Attributes:
        framework: ``sglang``, ``megatron`` or ``""`` (no parallel info).
        tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size, dp_rank, dp_size: the process's ranks.
        sp: Megatron sequence parallelism (activations outside the TP regions split along the sequence).
        vpp_size: virtual pipeline stages (None or 1: none).
    """

    framework: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    sp: bool = False
    vpp_size: int | None = None


def meta_int(meta: dict, key: str, where: Any, default: int | None = None, lo: int = 0) -> int:
    """An integer field of a dump file's meta (``step``, ``tp_rank``, ...): an int (or a string of
    digits, as tags in file names are) of at least ``lo``.

    Raises:
        TracerError: missing without a default, or not such a number (naming the file and key).
    """
    v = meta.get(key)
    v = default if v is None else v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        v = int(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < 2**40:
        raise TracerError(f"{where}: meta {key} = {str(v)[:40]!r} is not an integer >= {lo}; "
                          "the dumper writes ints there")
    return v


def rank_of(meta: dict[str, Any], where: Any = "") -> Rank:
    """The :class:`Rank` of a dumper file's meta (its ``*_parallel_info``, else plain ``tp_rank`` keys).

    Raises:
        TracerError: both frameworks' parallel info carry ranks (a dump mixing two processes' meta); a
            rank or size that is not an integer, or a rank not below its size.
    """
    found = [(k.split("_")[0], meta[k]) for k in PARALLEL_INFO_KEYS if isinstance(meta.get(k), dict) and "tp_rank" in meta[k]]
    if len(found) > 1:
        raise TracerError(f"a file's meta carries both {PARALLEL_INFO_KEYS[0]} and {PARALLEL_INFO_KEYS[1]} with ranks; "
                          "dump one framework per folder")
    if not found:
        rank = Rank(tp_rank=meta_int(meta, "tp_rank", where, 0), tp_size=meta_int(meta, "tp_size", where, 1, 1),
                    pp_rank=meta_int(meta, "pp_rank", where, 0))
    else:
        framework, info = found[0]
        vpp = info.get("vpp_size")
        rank = Rank(framework=framework,
                    tp_rank=meta_int(info, "tp_rank", where, 0), tp_size=meta_int(info, "tp_size", where, 1, 1),
                    pp_rank=meta_int(info, "pp_rank", where, 0), pp_size=meta_int(info, "pp_size", where, 1, 1),
                    cp_rank=meta_int(info, "cp_rank", where, 0), cp_size=meta_int(info, "cp_size", where, 1, 1),
                    dp_rank=meta_int(info, "dp_rank", where, 0), dp_size=meta_int(info, "dp_size", where, 1, 1),
                    sp=meta_int(info, "sp_size", where, 1, 1) > 1,
                    vpp_size=None if vpp is None else meta_int(info, "vpp_size", where, 1, 1))
    for what in ("tp", "pp", "cp", "dp"):
        r, n = getattr(rank, f"{what}_rank"), getattr(rank, f"{what}_size")
        if r >= n:
            raise TracerError(f"{where}: meta says {what.upper()} rank {r} of {what}_size {n}; the dump is inconsistent")
    return rank


def check_supported(rank: Rank, file: str) -> None:
    """Refuse layouts tracer cannot join.

    Raises:
        TracerError: virtual pipeline parallelism (model chunks interleaved over stages).
    """
    if rank.vpp_size is not None and rank.vpp_size > 1:
        raise TracerError(f"{file}: virtual pipeline parallelism (vpp_size {rank.vpp_size}) is not supported; "
                          "dump a run without --num-layers-per-virtual-pipeline-stage (Miles' dumper refuses it too)")


def part_steps(keys: Iterable[tuple[int, int, int]]) -> dict[tuple[int, int, int], int]:
    """``(step, dp_rank, cp_rank)`` → the step number tracer uses: the step itself when every file
    is of one DP and CP rank, else ``step × parts + part`` (each DP × CP part of a forward pass
    holds its own tokens, so it is aligned on its own)."""
    keys = sorted(set(keys))
    parts = sorted({(dp, cp) for _s, dp, cp in keys})
    if len(parts) == 1:
        return {k: k[0] for k in keys}
    return {(s, dp, cp): s * len(parts) + parts.index((dp, cp)) for s, dp, cp in keys}


def _zigzag(length: int, cp_size: int, cp_rank: int, what: str) -> torch.Tensor:
    """Positions CP rank ``cp_rank`` holds of one sequence of ``length`` tokens (chunks r and 2·cp−1−r)."""
    if length % (2 * cp_size):
        raise TracerError(f"{what}: a sequence of {length} tokens does not split into {2 * cp_size} CP chunks "
                          "(Megatron pads each sequence to a multiple of 2 x cp); the dump's cu_seqlens are inconsistent")
    c = length // (2 * cp_size)
    r = cp_rank
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp_size - 1 - r) * c, (2 * cp_size - r) * c)])


def infer_positions(slot: dict[str, Any], rank: Rank, what: str) -> torch.Tensor | None:
    """The positions of a Megatron step's tokens when it dumped no ``position_ids``.

    THD packing (``cu_seqlens_q``): positions restart at every sequence; BSHD (``input_ids`` of
    shape ``[b, s]``): ``0..s-1`` per row. Under CP the lengths are the global ones and each rank
    holds its two zigzag chunks of every sequence. Returns None when nothing tells (a plain 1-D
    ``input_ids``, CP 1: the ids are then located in the reference prompt).

    Raises:
        TracerError: lengths that do not add up to the step's tokens.
    """
    n = len(slot["input_ids"])
    cu = slot.get("cu_seqlens_q")
    if cu is not None:
        lens = [int(x) for x in (cu[1:] - cu[:-1]).tolist()]
        parts = [_zigzag(L, rank.cp_size, rank.cp_rank, what) if rank.cp_size > 1 else torch.arange(L) for L in lens]
    elif slot.get("shape") is not None:
        b, s = slot["shape"]
        one = _zigzag(s * rank.cp_size, rank.cp_size, rank.cp_rank, what) if rank.cp_size > 1 else torch.arange(s)
        parts = [one] * b
    elif rank.cp_size > 1:
        raise TracerError(f"{what}: a CP rank's tokens without position_ids, cu_seqlens_q or a [b, s] input_ids; "
                          "tracer cannot tell which positions it holds")
    else:
        return None
    pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    if len(pos) != n:
        raise TracerError(f"{what}: cu_seqlens_q / input_ids say {len(pos)} tokens on this rank but input_ids holds {n}; "
                          "the dump's token bookkeeping is inconsistent")
    return pos.to(torch.long)


def layer_offsets(tags: Iterable[tuple[int, str, int]], pp_size: int, folder: str) -> dict[int, int]:
    """PP stage → its first global layer number, from ``(pp_rank, module path, layer_id tag)``
    of the modules inside layers (Megatron numbers a stage's layers from 0; the dumper's
    ``layer_id`` is global). Stages without a tag get offset 0 when ``pp_size`` is 1.

    Raises:
        TracerError: two offsets on one stage; a PP dump with a stage whose layers carry no tag.
    """
    offsets: dict[int, int] = {}
    for pp, module, layer_id in tags:
        m = _LAYER_IN_PATH.search(module)
        if m is None:
            continue
        off = int(layer_id) - int(m.group(2))
        if offsets.setdefault(pp, off) != off:
            raise TracerError(f"{folder}: PP stage {pp} has layers numbered with two offsets ({offsets[pp]}, {off}) "
                              "between module paths and layer_id tags; the dump is inconsistent")
    return offsets


def renumber(module: str, offset: int) -> str:
    """``decoder.layers.1.mlp`` with offset 4 → ``decoder.layers.5.mlp``."""
    if not offset:
        return module
    return _LAYER_IN_PATH.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + offset}", module, count=1)


def has_layer(module: str) -> bool:
    """Whether a module path lies inside a numbered layer list."""
    return _LAYER_IN_PATH.search(module) is not None


__all__ = ["Rank", "rank_of", "check_supported", "part_steps", "infer_positions", "layer_offsets", "renumber",
           "has_layer", "digest", "PARALLEL_INFO_KEYS", "MEGATRON_FIELDS"]
