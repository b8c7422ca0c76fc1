"""A reward model's pooling, read from its config on the host: `RewardPooling` (torch-free).

vLLM's per-token reward models serve ``token_classify`` only: ``convert="reward"`` (its ``as_reward_model``: every
prompt token's final hidden state) and the reward architectures with their own head (``Qwen2ForRewardModel``,
``Qwen2ForProcessRewardModel``: asyncllm/models/reward.py). ``pooler_config`` chooses ALL or STEP pooling, STEP's
``step_tag_id`` and ``returned_token_ids``, and ``use_activation``'s default; the worker applies them
(workers/pooler.py `Pooler._reward`); docs/pooling.md#reward-models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.pooling import PoolingParams

__all__ = ["RewardPooling"]


@dataclass(frozen=True)
class RewardPooling:
    """A reward model's pooling (``convert="reward"``, vLLM's ``as_reward_model``): ``token_classify`` only, each
    prompt row the token's final hidden state (ALL), or STEP's rows and columns; through vLLM's activation (softmax
    over each row, sigmoid for one column) unless ``use_activation`` is False. From ``pooler_config``."""

    pooling_type: str = "ALL"
    step_tag_id: int | None = None
    """STEP: the rows of the prompt tokens with this id (None: every row)."""
    returned_token_ids: tuple[int, ...] | None = None
    """STEP: these columns of each row (None: every column)."""
    use_activation: bool = True
    """A request's ``use_activation`` when it leaves it None (vLLM's default True, ``pooler_config``'s)."""
    width: int | None = None
    """The rows' width (the hidden size; a reward head's outputs): ``returned_token_ids`` index its columns."""

    @classmethod
    def of(cls, architecture: str, pooler: dict[str, Any] | None, hidden_size: int | None) -> RewardPooling:
        """From ``pooler_config`` (checked as a reward model's: asyncllm/pooling.py) over the architecture's defaults
        (vLLM's: as_reward_model ALL; Qwen2ForRewardModel ALL without activation; Qwen2ForProcessRewardModel STEP
        on token 151651); a `ConfigError` for a column past the rows' width."""
        pooler = pooler or {}
        default = _REWARD_DEFAULTS.get(architecture, cls(width=hidden_size))
        columns = pooler.get("returned_token_ids")
        kind = pooler.get("pooling_type") or default.pooling_type
        step = kind == "STEP" and "step_tag_id" not in pooler
        reward = cls(kind, default.step_tag_id if step else pooler.get("step_tag_id"),
                     None if columns is None else tuple(int(c) for c in columns),
                     default.use_activation if pooler.get("use_activation") is None else pooler["use_activation"],
                     default.width)
        if reward.out_of_range(columns):
            raise ConfigError("pooler_config", pooler, f"returned_token_ids below {default.width}, the width of the "
                                                       "rows (the hidden size; a reward head's outputs)")
        return reward

    def out_of_range(self, columns: Any) -> bool:
        return bool(columns) and self.width is not None and max(columns) >= self.width

    def num_rows(self, params: PoolingParams, prompt_token_ids: list[int]) -> int:
        """How many rows the worker returns for a request with these (applied) params."""
        tag = params.step_tag_id
        return len(prompt_token_ids) if tag is None else sum(1 for token in prompt_token_ids if token == tag)


_REWARD_DEFAULTS = {"Qwen2ForRewardModel": RewardPooling("ALL", None, None, False, 1),
                    "Qwen2ForProcessRewardModel": RewardPooling("STEP", 151651, None, True, 2)}
"""vLLM's defaults for its reward architectures (its ``Qwen2ForRewardModelConfig`` and
``Qwen2ForProcessRewardModelConfig``); the rows' width is the head's outputs."""
