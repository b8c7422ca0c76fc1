"""asyncllm.kv."""
