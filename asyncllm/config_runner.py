"""vLLM's ``runner``, ``convert`` and deprecated ``task`` fields of `ModelConfig`: their values checked when the
config is built (the model not read yet); what they mean for a model is decided once its architecture is known
(asyncllm/engine/runner.py, docs/pooling.md#runner-and-convert)."""

from __future__ import annotations

from asyncllm.config_checks import check_choice
from asyncllm.errors import ConfigError

__all__ = ["CONVERTS", "POOLING_CONVERTS", "RUNNERS", "TASKS", "check_runner_fields"]

RUNNERS = ("auto", "generate", "pooling", "draft")
"""vLLM's ``--runner`` values; draft is refused (a draft model is the target's ``speculative_config``)."""
CONVERTS = ("auto", "none", "embed", "classify", "reward")
"""vLLM's ``--convert`` values (reward: vLLM's ``as_reward_model``, every prompt token's hidden state)."""
POOLING_CONVERTS = ("embed", "classify", "reward")
"""The converts that adapt a model for the pooling runner (vLLM's ``_RUNNER_CONVERTS["pooling"]``)."""
TASKS = ("auto", "generate", "embedding", "embed", "classify", "score", "reward", "transcription", "draft")
"""vLLM's deprecated ``--task`` values, mapped onto runner and convert as vLLM maps them
(asyncllm/engine/runner.py `task_runner`)."""

_DRAFT = ("a draft model runs inside its target's engine, configured through speculative_config "
          "({'model': 'path/or/hub-id', 'num_speculative_tokens': N}; docs/speculative.md)")


def check_runner_fields(runner: object, convert: object, task: object) -> None:
    """`ConfigError` naming the field for a value vLLM does not know, for runner='draft' and task='draft' (drafts are
    configured through speculative_config), for a convert the generate runner does not take, and for task given with
    runner or convert (task is vLLM's deprecated spelling of them)."""
    check_choice("runner", runner, RUNNERS)
    if runner == "draft":
        raise ConfigError("runner", runner, f"'auto', 'generate' or 'pooling': {_DRAFT}")
    check_choice("convert", convert, CONVERTS)
    if runner == "generate" and convert in POOLING_CONVERTS:
        raise ConfigError("convert", convert, "'auto' or 'none' with runner='generate' (embed, classify and reward "
                                              "adapt a model for runner='pooling', as vLLM's)")
    if task is None:
        return
    check_choice("task", task, TASKS)
    if task == "draft":
        raise ConfigError("task", task, f"another task: {_DRAFT}")
    if runner != "auto" or convert != "auto":
        raise ConfigError("task", task, f"None with runner={runner!r} / convert={convert!r}: task is vLLM's "
                                        "deprecated spelling of runner and convert; give those alone")
