"""The engine core's KV-cache budget at startup: max_model_len ``auto`` (-1) fitted to the cache, the check that
the cache holds one whole sequence, and the swap space's blocks under ``preemption_mode="swap"``."""

from __future__ import annotations

import json
import logging

from asyncllm import errors
from asyncllm.config import EngineConfig
from asyncllm.models.rope_config import is_longrope
from asyncllm.sched.admission import kv_size_fields

__all__ = ["check_kv_fits", "fit_max_model_len", "kv_capacity", "longrope_original", "served_config", "swap_blocks"]

logger = logging.getLogger("asyncllm.engine.core")


def kv_capacity(config: EngineConfig, num_gpu_blocks: int) -> int:
    """Tokens of the longest sequence the KV cache holds: all its blocks. Every layer, sliding-window ones too,
    keeps a block per `block_size` tokens of a sequence (no block is freed behind a window), and a hybrid model's
    recurrent states lie outside the blocks, so one count holds for every model."""
    return num_gpu_blocks * config.block_size


def served_config(config: EngineConfig, num_gpu_blocks: int, auto_max_model_len: bool,
                  hf_config_json: str | None = None, kv_budget_field: str = "") -> EngineConfig:
    """The config the core serves once the KV cache is sized: `auto_max_model_len` (the user's max_model_len -1)
    fitted to the cache (`fit_max_model_len`), then checked to hold one whole sequence (`check_kv_fits`). The
    workers keep the model's maximum they were started with (a restart loads the model as the first start did,
    LongRoPE's factors included); the scheduler and the hosts (`protocol.Ready`) get this one. `kv_budget_field`:
    what sized the workers' KV cache (`protocol.WorkerReady.kv_budget_field`), the advice when it is too small."""
    if auto_max_model_len:
        config = fit_max_model_len(config, num_gpu_blocks, longrope_original(hf_config_json))
    check_kv_fits(config, num_gpu_blocks, kv_budget_field)
    return config


def fit_max_model_len(config: EngineConfig, num_gpu_blocks: int, longrope_original: int | None = None
                      ) -> EngineConfig:
    """vLLM's max_model_len -1 (``auto``): `config` (its max_model_len the model's own maximum, as the host derived
    it) with max_model_len lowered to the KV cache's capacity when that holds fewer tokens; logged either way.
    `longrope_original`: a LongRoPE model's original_max_position_embeddings, warned about when the fit falls
    within it (the workers keep the long factors of the model's maximum, as vLLM's)."""
    capacity = kv_capacity(config, num_gpu_blocks)
    if capacity >= config.max_model_len:
        logger.info("max_model_len auto: %d, the model's maximum (the KV cache holds %d tokens)",
                    config.max_model_len, capacity)
        return config
    logger.info("max_model_len auto: %d, the KV cache's %d blocks of %d tokens (the model's maximum is %d)",
                capacity, num_gpu_blocks, config.block_size, config.max_model_len)
    if longrope_original is not None and capacity <= longrope_original < config.max_model_len:
        logger.warning("max_model_len auto: %d is within LongRoPE's original_max_position_embeddings (%d), but the "
                       "workers rotate with the long factors of the model's maximum (%d), as vLLM's do: outputs "
                       "differ from transformers', which uses the short factors at this length; set max_model_len "
                       "to at most %d explicitly for the short factors (docs/phi3.md)",
                       capacity, longrope_original, config.max_model_len, longrope_original)
    return config.replace(max_model_len=capacity)


def longrope_original(hf_config_json: str | None) -> int | None:
    """A LongRoPE model's original_max_position_embeddings (where transformers' short factors end), read from the
    checkpoint's config as the host sent it (its text config's for a multimodal one); None for any other rope."""
    if hf_config_json is None:
        return None
    top = json.loads(hf_config_json)
    for part in (top, top.get("text_config") or {}):
        params = part.get("rope_parameters") or part.get("rope_scaling") or {}
        if is_longrope(params):
            return params.get("original_max_position_embeddings") or part.get("original_max_position_embeddings")
    return None


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
