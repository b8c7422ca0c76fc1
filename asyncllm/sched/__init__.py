"""asyncllm.sched."""
