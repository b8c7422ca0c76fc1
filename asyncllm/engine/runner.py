"""``runner``, ``convert`` and the deprecated ``task`` resolved for the served architecture, as vLLM's
``ModelConfig`` resolves them (``_get_runner_type``, ``_get_convert_type``, its ``task`` mapping), on the host
before anything is spawned (asyncllm/engine/prepare.py). The resolved values go into the engine's config, which the
core checks requests against too (asyncllm/engine/validation.py `served_tasks`); docs/pooling.md#runner-and-convert.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from asyncllm.config_runner import POOLING_CONVERTS
from asyncllm.errors import ConfigError
from asyncllm.models.architectures import (
    CLASSIFICATION_ARCHITECTURES,
    EMBEDDING_ARCHITECTURES,
    REWARD_ARCHITECTURES,
    serves_as_encoder,
)

__all__ = ["TASK_DEPRECATION", "resolve_runner", "task_runner"]

logger = logging.getLogger("asyncllm.engine")

TASK_DEPRECATION = ("The 'task' option has been deprecated and will be removed in v0.13.0 or v1.0, whichever comes "
                    "first.")
"""vLLM's warning for ``--task`` (its ``msg_prefix``); a hint follows it, as vLLM's."""
_GENERATE_TASKS = ("generate", "transcription")
_POOLING_TASKS = ("embedding", "embed", "classify", "score", "reward")


def task_runner(task: str, arch: str) -> tuple[str, str, str]:
    """vLLM's mapping of a deprecated ``task`` onto (runner, convert) for a model of ``arch``, and its hint. asyncllm's
    architectures are each generative (a causal LM) or pooling (no LM head), never both, so vLLM's branch for
    models that are both does not arise."""
    if task in _GENERATE_TASKS:
        return "generate", "auto", "Please remove this option"
    if task in _POOLING_TASKS:
        convert = {"embedding": "embed", "score": "classify" if arch in CLASSIFICATION_ARCHITECTURES else "embed"}
        convert_type = convert.get(task, task)
        return "pooling", convert_type, (f"Please replace this option with `--convert {convert_type}` to continue "
                                         "using this model as a pooling model.")
    return "auto", "auto", "Please remove this option."  # task="auto"


def resolve_runner(config: Any, arch: str, hf_config: Any = None) -> dict[str, Any]:
    """The fields ``runner``, ``convert`` and ``task`` (None) for a model of ``arch`` (its ``hf_config``: whether it
    is an encoder, `serves_as_encoder`); a `ConfigError` naming the field for a runner or convert it cannot take."""
    runner, convert, task = config.runner, config.convert, config.task
    field = "runner"
    if task is not None:
        runner, convert, hint = task_runner(task, arch)
        message = f"{TASK_DEPRECATION} {hint}"
        logger.warning("%s", message)
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        field = "task"
    classifier = arch in CLASSIFICATION_ARCHITECTURES
    pooling_model = classifier or arch in EMBEDDING_ARCHITECTURES or arch in REWARD_ARCHITECTURES
    if runner == "auto" and (pooling_model or convert in POOLING_CONVERTS):
        runner = "pooling"
        logger.info("Resolved `--runner auto` to `--runner pooling`. Pass the value explicitly to silence this "
                    "message.")
    if runner == "generate" and pooling_model:
        raise ConfigError(field, config.task or runner, f"runner 'pooling' or 'auto' for {arch}: it has no LM head "
                                                        "(vLLM: This model does not support `--runner generate`)")
    if runner == "pooling" and not pooling_model and convert == "none":
        raise ConfigError("convert", convert, f"one of {', '.join(POOLING_CONVERTS[:2])} with runner='pooling' for "
                                              f"{arch} (vLLM: This model does not support `--runner pooling`. You "
                                              "can pass `--convert <embed|classify|reward>` to adapt it into a "
                                              "pooling model.)")
    if convert == "classify" and not classifier:
        raise ConfigError(field if field == "task" else "convert", config.task or convert,
                          f"a model with a classification head: {arch} has none, and asyncllm does not build vLLM's "
                          "as_seq_cls_model on it; serve a *ForSequenceClassification checkpoint, or this one "
                          "with hf_overrides {'architectures': ['<Family>ForSequenceClassification'], "
                          "'classifier_from_token': [...]} (docs/pooling.md)")
    if convert == "reward" and (classifier or serves_as_encoder(arch, hf_config)):
        raise ConfigError(field if field == "task" else "convert", config.task or convert,
                          f"'auto' or 'none' for {arch}: it pools with its own head or pooler (vLLM's as_reward_model "
                          "leaves such a model unchanged); convert='reward' adapts a causal LM or a bare decoder "
                          "(docs/pooling.md#reward-models)")
    if convert in ("embed", "classify") and arch in REWARD_ARCHITECTURES:
        raise ConfigError(field if field == "task" else "convert", config.task or convert,
                          f"'auto', 'none' or 'reward' for {arch}: a reward model serves token_classify only "
                          "(docs/pooling.md#reward-models)")
    if convert == "embed" and classifier:
        raise ConfigError(field if field == "task" else "convert", config.task or convert,
                          f"'auto', 'none' or 'classify' for {arch}: a classifier serves classification and scores, "
                          "not embeddings")
    if runner == "pooling" and convert == "auto":
        convert = "none" if pooling_model else "embed"  # vLLM's _get_default_convert_type
        if convert == "embed":
            logger.info("Resolved `--convert auto` to `--convert embed`. Pass the value explicitly to silence this "
                        "message.")
    elif runner == "generate" and convert == "auto":
        convert = "none"
    return {"runner": runner, "convert": convert, "task": None}
