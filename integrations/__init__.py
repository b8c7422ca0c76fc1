"""asyncllm.integrations."""
