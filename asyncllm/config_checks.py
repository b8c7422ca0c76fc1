"""The value checks of `EngineConfig`'s sections (asyncllm/config.py, asyncllm/config_model.py): each raises
`ConfigError` naming the field, the value and what is allowed."""

from __future__ import annotations

import json
from typing import TypeGuard

from asyncllm.errors import ConfigError

__all__ = ["check_bool", "check_choice", "check_float", "check_heads_split", "check_int", "check_json_dict",
           "check_registry", "check_sampling_fields", "is_int"]


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (JSON's true is not a count; numpy's ints are not ints either)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_choice(name: str, value: object, allowed: tuple) -> None:
    """`value` is one of `allowed`, names or ints (a bool, float or numpy int equal to one, ``True``, ``16.0``, is
    not: the workers and the wire take ints)."""
    if not (isinstance(value, str) or is_int(value)) or value not in allowed:
        raise ConfigError(name, value, f"one of {', '.join(map(repr, allowed))}")


def check_int(name: str, value: object, lo: int, hi: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = is_int(value) and value >= lo and (hi is None or value <= hi)
    if not ok:
        bound = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ConfigError(name, value, bound + (" or None" if optional else ""))


def check_json_dict(name: str, value: object) -> None:
    """None, or a dict with str keys that JSON can write."""
    if value is None:
        return
    try:
        ok = isinstance(value, dict) and all(isinstance(key, str) for key in value) and bool(json.dumps(value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(name, value, "a dict of config.json keys and JSON values, or None")


def check_sampling_fields(name: str, value: object) -> None:
    """None, or a dict of SamplingParams field names (checked by building one); a field's None (vLLM's "no default":
    `default_sampling_fields` drops it) is not checked."""
    if value is None:
        return
    from asyncllm.sampling import SamplingParams

    if not isinstance(value, dict):
        raise ConfigError(name, value, "a dict of SamplingParams fields, or None")
    try:
        SamplingParams(**{key: item for key, item in value.items() if item is not None}).validate()
    except ConfigError:  # a variable `validate` reads (ASYNCLLM_MAX_NUM_BAD_WORDS): its own error, not the field's
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(name, value, f"SamplingParams fields with valid values ({exc})") from None


def check_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > lo if lo_open else value >= lo) and value <= hi  # type: ignore[operator]
    if not ok:
        raise ConfigError(name, value, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")


def check_registry(name: str, value: object) -> None:
    from prometheus_client import CollectorRegistry  # only when a registry is given: import asyncllm stays cheap

    if not isinstance(value, CollectorRegistry):
        raise ConfigError(name, value, "a prometheus_client.CollectorRegistry, or None for a private one")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, value, "True or False")


def check_heads_split(tensor_parallel_size: int, text_config: object) -> None:
    """The workers' `ConfigError` for attention heads that do not split over `tensor_parallel_size`, raised by the
    host before anything is spawned (asyncllm/engine/prepare.py), as vLLM's `ModelConfig.verify_with_parallel_config`
    checks the decoder config's total ``num_attention_heads`` there (none named, an attention-free model: 0, as
    vLLM's). The rest (KV heads, MLP and expert widths: each family's own) the workers check as they build the
    model (`models.registry.check_tensor_parallel`)."""
    heads = getattr(text_config, "num_attention_heads", None) or 0
    if tensor_parallel_size > 1 and is_int(heads) and heads % tensor_parallel_size:
        raise ConfigError("tensor_parallel_size", tensor_parallel_size,
                          f"a size that divides the model's num_attention_heads={heads}")
