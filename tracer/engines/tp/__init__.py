"""Real tensor parallelism over torch.distributed: K ranks, each holding a shard of the model."""
