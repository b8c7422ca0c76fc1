"""asyncllm.models."""
