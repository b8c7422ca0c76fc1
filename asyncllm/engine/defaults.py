"""Default sampling parameters from the model's ``generation_config.json`` (vLLM's ``--generation-config``).

Model authors put their recommended sampling there (Qwen3: temperature 0.6,
top_p 0.95, top_k 20). As vLLM does by default, a request that brings no
`SamplingParams` (and a server request that leaves a field unset) uses them;
``generation_config="vllm"`` turns that off, a folder reads that folder's file,
and ``override_generation_config`` sets fields on top. Read on the host, once,
without torch.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from asyncllm.errors import ConfigError

__all__ = ["default_sampling_fields", "GENERATION_CONFIG_FIELDS"]

logger = logging.getLogger("asyncllm.engine")

GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> the `SamplingParams` field it defaults (vLLM's set)."""


def default_sampling_fields(generation_config: str, model_path: str,
                            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `SamplingParams` fields the model's generation config (and the overrides) set."""
    fields: dict[str, Any] = {}
    if generation_config != "vllm":
        folder = model_path if generation_config == "auto" else generation_config
        fields = _read(os.path.join(folder, "generation_config.json"), must_exist=generation_config != "auto")
    fields.update(overrides or {})
    if fields:
        logger.info("default sampling parameters from the model's generation config: %s "
                    "(generation_config='vllm' turns them off)", fields)
    return fields


def _read(path: str, must_exist: bool) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        if must_exist:
            raise ConfigError("generation_config", os.path.dirname(path), "'auto', 'vllm' or a folder holding a "
                                                                          "generation_config.json") from None
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError("generation_config", path, f"a readable generation_config.json ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError("generation_config", path, "a generation_config.json holding a JSON object")
    if raw.get("do_sample") is False:  # transformers' greedy: its temperature / top_p / top_k do not apply
        raw = {key: value for key, value in raw.items() if key not in ("temperature", "top_p", "top_k", "min_p")}
    return {field: raw[key] for key, field in GENERATION_CONFIG_FIELDS.items() if raw.get(key) is not None}
