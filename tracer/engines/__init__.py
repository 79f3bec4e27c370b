"""Engines: the ways tracer executes a run plan (HF in-process, real TP over torch.distributed,
vLLM in-process), one folder each, and the engine dumps tracer reads (``dumps/``)."""
