"""The numeric contract of a vLLM engine (:class:`~tracer.execute.records.EngineFacts`), read from its
LLM's configuration and its model: in this process, or from its worker when the engine core runs in
its own process."""

from __future__ import annotations

from typing import Any

import torch
import vllm

from tracer.engines.vllm.contract import op_facts
from tracer.execute.records import EngineFacts, Threads


def _config_facts(self: Any, cfg: Any) -> dict[str, Any]:
    """The facts read from the LLM's configuration (both readers: in this process or from a worker)."""
    kv_dtype = str(cfg.cache_config.cache_dtype)
    return dict(
        engine="vllm", version=vllm.__version__, device=str(cfg.device_config.device),
        attention_backend_setting=self.settings.attention_backend or "auto (vLLM's choice)",
        batch_invariant=bool(self.settings.batch_invariant), log=self.log,
        dtype=str(cfg.model_config.dtype).replace("torch.", ""), weights=str(self.folder),
        kv_cache_dtype=kv_dtype if kv_dtype != "auto" else self.kwargs["dtype"], kv_cache_dtype_setting=kv_dtype,
        block_size=int(cfg.cache_config.block_size), prefix_caching=bool(cfg.cache_config.enable_prefix_caching),
        max_num_batched_tokens=int(cfg.scheduler_config.max_num_batched_tokens),
        chunked_prefill=bool(cfg.scheduler_config.enable_chunked_prefill),
        max_model_len=int(cfg.model_config.max_model_len), enforce_eager=bool(cfg.model_config.enforce_eager),
        compilation_mode=int(cfg.compilation_config.mode or 0),
        tensor_parallel=int(getattr(cfg.parallel_config, "tensor_parallel_size", 1) or 1),
        cudagraph_mode=str(cfg.compilation_config.cudagraph_mode).rsplit(".", 1)[-1])


def read_facts(self: Any) -> dict[str, Any]:
    """The facts of a :class:`~tracer.engines.vllm.running.VllmEngine` (its ``facts``), read from its LLM
    and model (an engine core in its own process: from its worker)."""
    cfg = self.llm.llm_engine.vllm_config
    if self.remote:
        return read_remote_facts(self, cfg)
    attn = next((m for n, m in self.model.named_modules() if n.endswith("self_attn.attn")), None)
    backend = getattr(getattr(attn, "attn_backend", None), "get_name", lambda: "?")()
    impl = getattr(attn, "impl", None)
    device = str(cfg.device_config.device)
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") and torch.cuda.is_available() \
        else None
    return EngineFacts(
        **_config_facts(self, cfg), device_name=name,
        model_runner=f"{type(self.runner).__module__}.{type(self.runner).__name__}",
        model_class=type(self.model).__name__,
        attention_backend=backend, attention_impl=type(impl).__name__ if impl is not None else None,
        attention_isa=str(getattr(attn, "isa", None)) if getattr(attn, "isa", None) is not None else None,
        in_process=True, torch_threads=Threads(self.threads[0], self.threads[1]),
        **op_facts(self.model, self.kwargs["dtype"])).to_dict()


def read_remote_facts(self: Any, cfg: Any) -> dict[str, Any]:
    """:meth:`facts` of an engine core in its own process: the model's facts from its worker."""
    w = self.worker_facts()
    return EngineFacts(
        **_config_facts(self, cfg), device_name=None, model_runner=w["model_runner"], model_class=w["model_class"],
        attention_backend=w["attention_backend"], attention_impl=w["attention_impl"],
        attention_isa=w["attention_isa"],
        in_process=False, torch_threads=Threads(self.threads[0], w["torch_threads"]),
        **w["op_facts"]).to_dict()


__all__ = ["read_facts", "read_remote_facts"]
