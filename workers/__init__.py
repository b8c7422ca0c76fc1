"""asyncllm.workers."""
