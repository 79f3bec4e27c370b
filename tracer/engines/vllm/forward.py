"""Reading one forward pass of vLLM's model: what it computes, from what the pass itself receives.

:func:`read_step` takes the arguments of the root model's forward (``input_ids``, ``positions``)
and the forward context's attention metadata (``query_start_loc``, ``slot_mapping``, the block
table), copies them to the host in one transfer, and returns the step as a
:class:`~tracer.engines.vllm.requests.StepInputs`: nothing of the model runner is read (its
internals differ between the V1 and V2 runners and between releases), so a runner that tracer
cannot read is one line naming it and the vLLM version. The hooks that call it:
:class:`tracer.engines.vllm.capture.VllmCapture`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tracer.errors import TracerError
from tracer.engines.vllm.requests import StepInputs, boundaries_from_positions


def runner_name(runner: Any) -> str:
    """The name of vLLM's model runner for messages: ``runner`` itself when it is a str, else its
    class's ``module.Name``."""
    return runner if isinstance(runner, str) else f"{type(runner).__module__}.{type(runner).__name__}"


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only for a message
        return "?"


def read_step(args: tuple, kwargs: dict, runner: Any) -> StepInputs:
    """What one forward pass of vLLM's model computes, read from the pass itself: its token ids,
    positions, request boundaries (``query_start_loc`` of the forward context's attention metadata;
    derived from the positions and KV slots where the metadata has none, e.g. FlashInfer's) and KV
    slots, copied to the host in one transfer.

    Raises:
        TracerError: the pass has no ``input_ids``/1-D ``positions`` or no forward context
            (a runner tracer cannot read: named with the vLLM version), or micro-batched metadata.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    ids = kwargs.get("input_ids", args[0] if args else None)
    pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
    why = None
    if not isinstance(ids, torch.Tensor):
        why = "no input_ids (inputs_embeds only)"
    elif not isinstance(pos, torch.Tensor) or pos.dim() != 1:
        why = "no 1-D positions (M-RoPE or none)"
    elif not is_forward_context_available():
        why = "no forward context"
    if why is not None:
        raise TracerError(f"tracer cannot read the requests of vLLM {_vllm_version()}'s {runner_name(runner)}: its "
                          f"forward pass has {why}; tracer reads input_ids, positions and the attention metadata's "
                          "query_start_loc (text-only models, eager)")
    ctx = get_forward_context()
    md = ctx.attn_metadata
    if isinstance(md, list):
        raise TracerError(f"vLLM {_vllm_version()}'s {runner_name(runner)} runs this step as micro-batches (dual-batch "
                          "overlap); tracer reads one flattened batch per forward pass: turn micro-batching off")
    metas = list(md.values()) if isinstance(md, dict) else ([md] if md is not None else [])
    qsl = next((m.query_start_loc for m in metas if isinstance(getattr(m, "query_start_loc", None), torch.Tensor)), None)
    slots = next((m.slot_mapping for m in metas if isinstance(getattr(m, "slot_mapping", None), torch.Tensor)), None)
    if slots is None and isinstance(getattr(ctx, "slot_mapping", None), dict) and ctx.slot_mapping:
        slots = next(iter(ctx.slot_mapping.values()))
    table = next((getattr(m, k) for m in metas for k in ("block_table", "block_table_tensor")
                  if isinstance(getattr(m, k, None), torch.Tensor)), None)
    t = ids.shape[0]
    parts = [ids.reshape(-1), pos.reshape(-1)]
    if slots is not None:
        parts.append(slots.reshape(-1)[:t].to(ids.device))
    if qsl is not None:
        parts.append(qsl.reshape(-1).to(ids.device))
    host = torch.cat([p.to(torch.int64) for p in parts]).cpu().numpy()  # the step's one host copy
    h_ids, h_pos = host[:t], host[t:2 * t]
    rest = host[2 * t:]
    h_slots = None
    if slots is not None:
        h_slots, rest = rest[:min(t, slots.numel())], rest[min(t, slots.numel()):]
        if len(h_slots) < t:
            h_slots = None
    if qsl is not None:
        starts = np.minimum(rest, t)  # padded entries (V2 pads with the token count) are empty requests
        how = "query_start_loc"
    else:
        starts = boundaries_from_positions(h_pos, h_slots)
        how = "positions"

    def block_table() -> np.ndarray:
        return table.to(torch.int64).cpu().numpy()

    return StepInputs(ids=h_ids, positions=h_pos, starts=starts.astype(np.int64), slots=h_slots,
                      block_table=block_table if table is not None else None, boundaries=how)


__all__ = ["read_step", "runner_name"]
