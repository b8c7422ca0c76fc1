"""asyncllm.kernels."""
