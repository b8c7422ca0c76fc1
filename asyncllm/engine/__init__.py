"""asyncllm.engine."""
