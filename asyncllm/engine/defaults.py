"""Default sampling parameters from the model's ``generation_config.json`` (vLLM's ``--generation-config``).

Model authors put their recommended sampling there (Qwen3: temperature 0.6,
top_p 0.95, top_k 20). As vLLM does by default, a request that brings no
`SamplingParams` (and a server request that leaves a field unset) uses them;
``generation_config="vllm"`` turns that off, a folder reads that folder's file,
and ``override_generation_config`` sets fields on top. The file is read on the host,
once (asyncllm/generation_config.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from asyncllm.config_checks import check_sampling_fields
from asyncllm.errors import ConfigError

__all__ = ["default_sampling_fields", "sampling_overrides", "GENERATION_CONFIG_FIELDS"]

logger = logging.getLogger("asyncllm.engine")

GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> the `SamplingParams` field it defaults (vLLM's set)."""
_DEFAULTED = frozenset(GENERATION_CONFIG_FIELDS.values())
"""The `SamplingParams` fields a generation config defaults."""


def sampling_overrides(name: str, overrides: object) -> object:
    """``override_generation_config`` with generation_config.json's keys as the `SamplingParams` fields they
    default (``max_new_tokens`` -> ``max_tokens``, as vLLM maps them; ``max_tokens`` too). Only those six: vLLM's
    ``get_diff_sampling_param`` reads no other key (its server defaults no other field), so another one is a
    `ConfigError` naming it rather than a default that only `AsyncEngine.generate` would apply. Anything but a
    dict is returned for the config's own check to refuse."""
    if not isinstance(overrides, dict):
        return overrides
    unknown = [key for key in overrides if key not in GENERATION_CONFIG_FIELDS and key not in _DEFAULTED]
    if unknown:
        raise ConfigError(name, overrides, f"only the keys vLLM's generation config defaults "
                                           f"({', '.join(GENERATION_CONFIG_FIELDS)}, or max_tokens); {unknown[0]!r} "
                                           f"is not one: set it per request")
    fields = {GENERATION_CONFIG_FIELDS.get(key, key): value for key, value in overrides.items()}
    if len(fields) < len(overrides):
        raise ConfigError(name, overrides, "one value per SamplingParams field (max_new_tokens is max_tokens)")
    return fields


def default_sampling_fields(generation: Mapping[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `SamplingParams` fields the model's generation config (`read_generation_config`'s keys) and the
    overrides set; an override of None removes the file's default (vLLM's ``get_diff_sampling_param`` drops None).
    ``do_sample`` is not read: as vLLM's ``get_diff_sampling_param``, a ``do_sample: false`` file's
    temperature, top_p, top_k and min_p are defaults too (transformers would decode greedily)."""
    fields = {field: generation[key] for key, field in GENERATION_CONFIG_FIELDS.items()
              if generation.get(key) is not None}
    fields.update(overrides or {})
    fields = {field: value for field, value in fields.items() if value is not None}  # an override's null: no default
    check_sampling_fields("generation_config", fields)  # a bad file's value: refused at start, not every request
    if fields:
        logger.info("default sampling parameters from the model's generation config: %s "
                    "(generation_config='vllm' turns them off)", fields)
    return fields
