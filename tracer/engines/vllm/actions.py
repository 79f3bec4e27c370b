"""The engine map's rules compiled for one vLLM module: which element(s) of its output become
which HF capture point(s), and how.

The engine map (``hooks/engine-llama.toml`` and ``hooks/engine-vllm.toml``, merged by
:func:`tracer.engines.dumps.rules.load_engine_map`) says, per vLLM module path, what its output
is in HF terms; :func:`compile_actions` turns the rules of one module into :class:`Action`
objects against the HF reference layout (a fused q/k/v or gate/up output split by the HF widths,
a ``(hidden, residual)`` pair summed in the HF dtype, one element taken, the logits rows), with
what one tensor-parallel rank holds of each (:func:`shard_of`). :func:`elements` and :func:`pick`
read a module's output as the rules name its parts. The hooks that apply them:
:class:`tracer.engines.vllm.capture.VllmCapture`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tracer.errors import TracerError
from tracer.engines.dumps.namemap import RefLayout, hf_name, locate

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass
class Action:
    """One rule of the engine map compiled for one hooked module: which output element(s) become
    which HF point(s)."""

    how: str  # take | sum | split | logits
    elements: tuple  # (element,) for take/split (None: the tensor itself); the summed elements for sum
    targets: tuple  # HF names (split: one per part)
    sizes: tuple = ()  # split: the HF widths
    dtype: torch.dtype | None = None  # sum: the HF dtype the pair is added in
    describe: str = ""
    shard: str | None = None  # TP > 1: "columns" (each rank a column shard) or "partial" (partial sums); None: whole


def elements(out: Any) -> dict[int | None, torch.Tensor]:
    """The tensors of a module's output by element: ``{None: out}`` for a tensor, ``{i: out[i]}``
    for the tensors of a tuple or list, ``{}`` otherwise."""
    if isinstance(out, torch.Tensor):
        return {None: out}
    if isinstance(out, (tuple, list)):
        return {i: v for i, v in enumerate(out) if isinstance(v, torch.Tensor)}
    return {}


def pick(els: dict[int | None, torch.Tensor], el: int | None, what: str) -> torch.Tensor | None:
    """Element ``el`` of a module's output (as :mod:`tracer.engines.dumps.namemap` reads a dump):
    None picks the tensor itself, or the only tensor of ``(output, None)``."""
    if el is None:
        if None in els:
            return els[None]
        if set(els) == {0}:
            return els[0]
        raise TracerError(f"{what} is a tuple of {len(els)} tensors; its map rule must pick an element "
                          "(element = 0) or add them (sum = [1, 0])")
    return els.get(el, els.get(None) if el == 0 else None)


def compile_actions(name: str, emap: dict[str, Any], ref: RefLayout, tp: int, module: nn.Module | None) -> list[Action]:
    """The rules of ``emap`` for the vLLM module at path ``name`` compiled against ``ref`` (rules
    whose HF points ``ref`` does not capture are left out; a logits rule is ``how="logits"``).
    ``tp``: vLLM's tensor-parallel size (split widths are the HF widths / ``tp``); ``module``: that
    vLLM module (its ``reduce_results`` says a row-parallel layer's shard, :func:`shard_of`).

    Raises:
        TracerError: a rule that is not one for vLLM's in-process modules (``qkv_groups``,
            ``identity``), or HF widths that ``tp`` ranks do not divide.
    """
    layer, rel = locate(name)
    rules = (emap["layer"] if layer is not None else emap["model"]).get(rel) or []
    actions = []
    for rule in rules:
        hf = [hf_name(t, layer, ref) for t in (rule["hf"] if isinstance(rule["hf"], list) else [rule["hf"]])]
        if rule.get("rows") == "last":
            if any(h is not None and h in ref.names for h in hf):
                actions.append(Action("logits", (), tuple(h for h in hf if h is not None)))
            continue
        if rule.get("split") in ("qkv_groups",) or rule.get("identity"):
            raise TracerError(f"engine map rule for {rel!r} ({rule}) is not one for vLLM's in-process modules")
        if rule.get("split"):
            if not all(h is not None and h in ref.names for h in hf):
                continue  # the reference did not capture the parts (e.g. layers granularity)
            sizes = tuple(ref.names[h][2][-1] if ref.names[h][2] else 1 for h in hf)
            if any(s % tp for s in sizes):
                raise TracerError(f"{name}: the HF widths {list(sizes)} of {', '.join(hf)} do not split over "
                                  f"{tp} TP ranks; run this model with a tensor_parallel_size that divides them")
            actions.append(Action("split", (rule.get("element"),), tuple(hf), tuple(s // tp for s in sizes),
                                  describe=f"fused {name.rsplit('.', 1)[-1]}, part {{i}} of {len(hf)}",
                                  shard=shard_of(rule, tp, module)))
        elif "sum" in rule:
            if hf[0] is None or hf[0] not in ref.names:
                continue
            dtype = _DTYPES.get(ref.names[hf[0]][3], torch.float32)
            actions.append(Action("sum", tuple(rule["sum"]), (hf[0],), dtype=dtype,
                                  describe="(hidden, residual) summed in the HF dtype"))
        elif hf[0] is not None and hf[0] in ref.names:
            el = rule.get("element")
            actions.append(Action("take", (el,), (hf[0],), describe=f"element {el} of a tuple" if el is not None else "",
                                  shard=shard_of(rule, tp, module)))
    return actions


def shard_of(rule: dict[str, Any], tp: int, module: nn.Module | None) -> str | None:
    """What one TP rank holds of a module's mapped output (None: the whole tensor, or TP 1): the
    map's ``shard = "columns"``; ``partial`` for a row-parallel layer built without its
    all-reduce (vLLM's ``reduce_results=False``: each rank's partial sum)."""
    if tp == 1:
        return None
    if rule.get("shard") == "columns":
        return "columns"
    return "partial" if getattr(module, "reduce_results", True) is False else None


__all__ = ["Action", "elements", "pick", "compile_actions", "shard_of"]
