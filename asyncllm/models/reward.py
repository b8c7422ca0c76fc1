"""Qwen2's reward models (``Qwen2ForRewardModel``: Qwen2.5-Math-RM; ``Qwen2ForProcessRewardModel``: Qwen2.5-Math-PRM):
the Qwen2 decoder (weights ``model.*``) and a reward head on every prompt row.

The checkpoints' own (remote) code defines the head as ``score = Sequential(Linear(hidden, hidden), ReLU,
Linear(hidden, num_labels))``, both with biases (``score.0.*``, ``score.2.*``); vLLM serves them with one label
for the reward model and two for the process reward model whatever config.json says, and so does asyncllm. A
request is a reward request (``token_classify``, pooling type STEP: asyncllm/engine/pooling_model.py): the worker's
pooler runs `classify` on every prompt row it gathered, then STEP's rows and columns and the activation
(workers/pooler.py). The head is small: every tensor-parallel rank keeps all of it. No LM head is kept (an
``lm_head.*`` in the checkpoint is skipped, as vLLM skips it).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from asyncllm.models.classifier import HeadOnDecoder
from asyncllm.models.layers import LoadedWeight, new_param

__all__ = ["REWARD_LABELS", "RewardHead", "RewardModel", "qwen2_process_reward_model", "qwen2_reward_model"]

REWARD_LABELS = {"Qwen2ForRewardModel": 1, "Qwen2ForProcessRewardModel": 2}
"""The head's outputs per architecture, as vLLM sets ``num_labels`` for them."""


class RewardHead(nn.Module):
    """``[..., hidden] -> [..., num_labels]``: dense, ReLU, dense (both with biases), replicated on every rank."""

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense_weight = new_param(hidden_size, hidden_size, dtype=dtype)
        self.dense_bias = new_param(hidden_size, dtype=dtype)
        self.out_weight = new_param(num_labels, hidden_size, dtype=dtype)
        self.out_bias = new_param(num_labels, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(hidden, self.dense_weight, self.dense_bias)), self.out_weight, self.out_bias)

    def parameter_of(self, ckpt_name: str) -> nn.Parameter | None:
        """``score.0.weight`` & co. -> the parameter; None for another name."""
        return {"score.0.weight": self.dense_weight, "score.0.bias": self.dense_bias,
                "score.2.weight": self.out_weight, "score.2.bias": self.out_bias}.get(ckpt_name)


class RewardModel(HeadOnDecoder):
    """Mixed in before a causal LM class: its decoder, no LM head, and the reward head ``score``."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        labels = REWARD_LABELS[type(self).__name__]
        self.score = RewardHead(hf_config.hidden_size, labels, kwargs["dtype"])

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[..., hidden]`` -> float32 rewards ``[..., num_labels]`` (computed in the model's
        dtype, as the checkpoints' code computes them)."""
        return self.score(hidden).float()

    def checkpoint_weight_names(self) -> set[str]:
        names = {name for name in super().checkpoint_weight_names()  # type: ignore[misc]
                 if not name.startswith(("score.", "model.score."))}
        return names | {"score.0.weight", "score.0.bias", "score.2.weight", "score.2.bias"}

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The decoder's weights as the causal LM loads them, ``score.*`` into the head; ``lm_head.*`` skipped."""
        head: set[str] = set()

        def decoder_weights() -> Iterable[tuple[str, LoadedWeight]]:
            for name, weight in weights:
                param = self.score.parameter_of(name)
                if param is not None:
                    self._load_one(param, name, weight, None)  # type: ignore[attr-defined]
                    head.add(name)
                elif not name.startswith("lm_head."):
                    yield name, weight

        return super().load_weights(decoder_weights()) | head  # type: ignore[misc]


def _named(name: str, causal_lm: type) -> type:
    return type(name, (RewardModel, causal_lm), {})


def qwen2_reward_model(causal_lm: type) -> type:
    """``Qwen2ForRewardModel`` over `causal_lm`'s (Qwen2's) decoder."""
    return _named("Qwen2ForRewardModel", causal_lm)


def qwen2_process_reward_model(causal_lm: type) -> type:
    """``Qwen2ForProcessRewardModel`` over `causal_lm`'s (Qwen2's) decoder."""
    return _named("Qwen2ForProcessRewardModel", causal_lm)
