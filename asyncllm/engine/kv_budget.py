"""The engine core's KV-cache budget checks at startup: the cache holds one whole sequence, and the swap space's
blocks under ``preemption_mode="swap"``."""

from __future__ import annotations

import logging

from asyncllm import errors
from asyncllm.config import EngineConfig

__all__ = ["check_kv_fits", "swap_blocks"]

logger = logging.getLogger("asyncllm.engine.core")


def check_kv_fits(config: EngineConfig, num_gpu_blocks: int) -> None:
    """`ConfigError` when one sequence of `max_model_len` tokens does not fit in the KV cache's blocks."""
    capacity = num_gpu_blocks * config.block_size
    if capacity < config.max_model_len:
        raise errors.ConfigError("max_model_len", config.max_model_len,
                                 f"at most {capacity} tokens fit in the KV cache ({num_gpu_blocks} blocks of "
                                 f"{config.block_size}); lower max_model_len, or raise gpu_memory_utilization / "
                                 "num_gpu_blocks_override")


def swap_blocks(config: EngineConfig, num_cpu_blocks: int) -> int:
    """CPU swap blocks for the scheduler: the workers' count under preemption_mode='swap', else 0."""
    if config.preemption_mode != "swap":
        return 0
    if num_cpu_blocks == 0:
        logger.warning(
            "preemption_mode='swap' but swap_space=%s GiB holds no KV block: every preemption will recompute; "
            "raise swap_space", config.swap_space,
        )
    return num_cpu_blocks
