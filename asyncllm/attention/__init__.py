"""asyncllm.attention."""
