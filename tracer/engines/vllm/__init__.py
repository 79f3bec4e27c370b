"""vLLM in-process: a ``vllm.LLM`` built from the weights HF loads, its modules captured under HF names."""
