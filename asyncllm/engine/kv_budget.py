"""The engine core's KV-cache budget at startup: max_model_len ``auto`` (-1) fitted to the cache, the check that
the cache holds one whole sequence, and the swap space's blocks under ``preemption_mode="swap"``."""

from __future__ import annotations

import logging

from asyncllm import errors
from asyncllm.config import EngineConfig
from asyncllm.sched.admission import kv_size_fields

__all__ = ["check_kv_fits", "fit_max_model_len", "kv_capacity", "served_config", "swap_blocks"]

logger = logging.getLogger("asyncllm.engine.core")


def kv_capacity(config: EngineConfig, num_gpu_blocks: int) -> int:
    """Tokens of the longest sequence the KV cache holds: all its blocks. Every layer, sliding-window ones too,
    keeps a block per `block_size` tokens of a sequence (no block is freed behind a window), and a hybrid model's
    recurrent states lie outside the blocks, so one count holds for every model."""
    return num_gpu_blocks * config.block_size


def served_config(config: EngineConfig, num_gpu_blocks: int, auto_max_model_len: bool,
                  kv_budget_field: str = "") -> EngineConfig:
    """The config the core serves once the KV cache is sized: `auto_max_model_len` (the user's max_model_len -1)
    fitted to the cache (`fit_max_model_len`), then checked to hold one whole sequence (`check_kv_fits`). The
    workers keep the maximum they were started with (a restart loads the model as the first start did; a LongRoPE
    model's is its original_max_position_embeddings, so its short factors: asyncllm/engine/prepare.py); the
    scheduler and the hosts (`protocol.Ready`) get this one. `kv_budget_field`: what sized the workers' KV cache
    (`protocol.WorkerReady.kv_budget_field`), the advice when it is too small."""
    if auto_max_model_len:
        config = fit_max_model_len(config, num_gpu_blocks)
    check_kv_fits(config, num_gpu_blocks, kv_budget_field)
    return config


def fit_max_model_len(config: EngineConfig, num_gpu_blocks: int) -> EngineConfig:
    """vLLM's max_model_len -1 (``auto``): `config` (its max_model_len the model's own maximum as the host derived
    it: a LongRoPE model's original_max_position_embeddings, vLLM's default) with max_model_len lowered to the KV
    cache's capacity when that holds fewer tokens; logged either way. Lowered, a LongRoPE model keeps the short
    factors its workers were built with (transformers' at every length the fit allows)."""
    capacity = kv_capacity(config, num_gpu_blocks)
    if capacity >= config.max_model_len:
        logger.info("max_model_len auto: %d, the model's default maximum (the KV cache holds %d tokens)",
                    config.max_model_len, capacity)
        return config
    logger.info("max_model_len auto: %d, the KV cache's %d blocks of %d tokens (the model's default maximum is %d)",
                capacity, num_gpu_blocks, config.block_size, config.max_model_len)
    return config.replace(max_model_len=capacity)


def check_kv_fits(config: EngineConfig, num_gpu_blocks: int, kv_budget_field: str = "") -> None:
    """`ConfigError` when one sequence of `max_model_len` tokens does not fit in the KV cache's blocks; its advice
    names what sized the cache (`kv_budget_field`: on the CPU ASYNCLLM_CPU_KVCACHE_SPACE_GB, which ignores
    gpu_memory_utilization; "": unknown, gpu_memory_utilization)."""
    capacity = kv_capacity(config, num_gpu_blocks)
    if capacity < config.max_model_len:
        raise errors.ConfigError("max_model_len", config.max_model_len,
                                 f"at most {capacity} tokens fit in the KV cache ({num_gpu_blocks} blocks of "
                                 f"{config.block_size}); lower max_model_len (-1 / 'auto': the longest that fits), "
                                 f"or raise {kv_size_fields(config, kv_budget_field)}")


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
