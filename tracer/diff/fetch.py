"""One device-to-host transfer for a whole comparison.

The comparison's parts (:class:`~tracer.diff.batch.DiffBatch`, the per-position table
:class:`~tracer.diff.positions.PositionStats`, the logits' :class:`~tracer.diff.logits.LogitsAccumulator`)
keep their results on the model's device; :func:`fetch_together` moves all of them to the host at
once: on a GPU, the one host synchronisation of a comparison.
"""

from __future__ import annotations

import numpy as np
import torch


def fetch_together(*holders: object) -> None:
    """One device-to-host transfer (one per device) for everything the ``holders`` still hold on a
    device: each gives flat int64 tensors from ``pending_words()`` and gets their host copies, as
    numpy arrays in the same order, through ``take_words(list)`` (a holder with nothing pending
    gets an empty list). The one host synchronisation of a comparison on a GPU."""
    pending = [(h, h.pending_words()) for h in holders if h is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, words in pending:
        for w in words:
            by_device.setdefault(w.device, []).append(w)
    host: dict[int, np.ndarray] = {}
    for tensors in by_device.values():
        flat = (torch.cat(tensors) if len(tensors) > 1 else tensors[0]).cpu().numpy()
        at = 0
        for t in tensors:
            host[id(t)] = flat[at:at + t.numel()]
            at += t.numel()
    for h, words in pending:
        h.take_words([host[id(w)] for w in words])
