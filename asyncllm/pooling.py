"""Pooling: `PoolingParams` and the results of `AsyncEngine.embed`, `classify` and `score` (torch-free).

An embedding request runs as a one-token generation whose prompt's last token's
final hidden state (after the model's last norm) is the embedding: last-token
pooling, what decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral)
use; MEAN (all prompt rows averaged) and CLS (the first row) when the model's
``pooler_config`` or sentence-transformers config says so. The worker truncates
it to `dimensions` (Matryoshka), normalizes it (L2) when asked, and returns it
with the step's output; the sampled token is dropped. docs/embeddings.md has the details. A classification request
(``task="classify"``) runs the same way, and the worker applies the model's
``score`` head to that hidden state instead (docs/pooling.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from asyncllm.config_checks import is_int
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.outputs import RequestMetrics

__all__ = ["PoolingParams", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "POOLING_TASKS",
           "POOLING_TYPES", "check_pooler_config"]

POOLING_TASKS = ("embed", "classify")
"""What a pooling request returns: ``embed`` the hidden state, ``classify`` a classification model's logits."""


POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""How an embedding is made from the prompt's final hidden states: the last token's row, the mean of all rows, or
the first token's row (docs/embeddings.md)."""

_UNBUILT_POOLING_TYPES = ("ALL", "STEP")
_POOLER_KEYS = ("pooling_type", "normalize")
_UNBUILT_POOLER_KEYS = ("dimensions", "enable_chunked_processing", "max_embed_len", "activation", "softmax",
                        "step_tag_id", "returned_token_ids", "logit_bias", "use_activation")


def check_pooler_config(value: Any) -> None:
    """`ConfigError` unless ``value`` is None or a dict of vLLM ``PoolerConfig`` fields asyncllm applies
    (``pooling_type`` one of `POOLING_TYPES`, ``normalize`` a bool); `NotBuiltError` for those it does not."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError("pooler_config", value, "a dict of PoolerConfig fields (pooling_type, normalize), or None")
    for key, item in value.items():
        if key in _UNBUILT_POOLER_KEYS:
            raise NotBuiltError("pooler_config", value, f"the pooler_config field {key!r} (built: "
                                                        f"{', '.join(_POOLER_KEYS)})")
        if key not in _POOLER_KEYS:
            raise ConfigError("pooler_config", value, f"PoolerConfig fields ({', '.join(_POOLER_KEYS)}); "
                                                      f"{key!r} is not one")
    kind = value.get("pooling_type")
    if kind is not None:
        if kind in _UNBUILT_POOLING_TYPES:
            raise NotBuiltError("pooler_config", value, f"{kind} pooling (built: {', '.join(POOLING_TYPES)})")
        if kind not in POOLING_TYPES:
            raise ConfigError("pooler_config", value, f"pooling_type one of {', '.join(POOLING_TYPES)}")
    if "normalize" in value and not isinstance(value["normalize"], bool):
        raise ConfigError("pooler_config", value, "normalize True or False")


class PoolingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """How an embedding is made from the last prompt token's hidden state (vLLM's ``PoolingParams``)."""

    normalize: bool | None = None
    """Divide by the L2 norm (after truncating to `dimensions`); None: the model's default (``pooler_config``'s
    ``normalize``, else True)."""
    dimensions: int | None = None
    """Keep the first this many features (Matryoshka embeddings); None: all ``hidden_size``."""
    task: str = "embed"
    """``"embed"``; ``"classify"`` (what `AsyncEngine.classify` and `score` send): the model's ``score`` head
    applied to the hidden state, raw logits (``normalize`` and ``dimensions`` do not apply)."""
    pooling_type: str = "LAST"
    """Set by the engine from the model's pooling (`POOLING_TYPES`; ``pooler_config`` or the checkpoint's
    sentence-transformers config), not by callers: which prompt rows make the embedding."""
    token_type_start: int | None = None
    """Set by the engine for a `score` pair, not by callers: the prompt index where the tokenizer's
    ``token_type_ids`` turn 1 (the second text; vLLM's ``compressed_token_type_ids``). None: every token type 0."""

    def validate(self, hidden_size: int | None = None) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be a bool or None, got {self.normalize!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError("pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got "
                                                      f"{self.pooling_type!r}")
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.task == "classify" and self.dimensions is not None:
            raise InvalidRequestError("dimensions", "applies to embeddings, not to classification")
        if self.dimensions is None:
            return
        if not is_int(self.dimensions) or self.dimensions < 1:
            raise InvalidRequestError("dimensions", f"must be a positive int, got {self.dimensions!r}")
        if hidden_size is not None and self.dimensions > hidden_size:
            raise InvalidRequestError("dimensions", f"is {self.dimensions}, but the model's embeddings have "
                                                    f"{hidden_size} features")


class _FlatOutputs:
    """vLLM's pooling results nest the result in ``.outputs`` (``out.outputs.embedding``); asyncllm's are flat
    (``out.embedding``), and ``.outputs`` is the result itself, so vLLM's spelling reads the same field."""

    __slots__ = ()

    @property
    def outputs(self) -> Any:
        return self


@dataclass(slots=True)
class EmbeddingOutput(_FlatOutputs):
    """The result of `AsyncEngine.embed` (vLLM's ``EmbeddingRequestOutput``, flattened)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    metrics: RequestMetrics
    num_cached_tokens: int = 0


@dataclass(slots=True)
class ClassificationOutput(_FlatOutputs):
    """The result of `AsyncEngine.classify` (vLLM's ``ClassificationOutput``, flattened)."""

    request_id: str
    prompt_token_ids: list[int]
    probs: list[float]
    """The logits through the model's activation: softmax over the labels (sigmoid for one label; docs/pooling.md)."""
    logits: list[float]
    """The ``score`` head's raw output, one per label."""
    label: str
    """The name (``id2label``) of the label with the highest probability."""
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput(_FlatOutputs):
    """One pair's result of `AsyncEngine.score` (vLLM's ``ScoringRequestOutput``, flattened)."""

    score: float
    """A cross-encoder's activated logit (sigmoid by default), or the cosine similarity of two embeddings."""
    prompt_token_ids: list[int]
    """The tokens the pair ran as: a cross-encoder's one prompt, or the two texts' tokens one after the other."""
    request_id: str
    """The request's id; for an embedding model the two embeddings' ids joined by ``_``."""
