"""Pooling: `PoolingParams` and the results of `AsyncEngine.embed`, `classify` and `score` (torch-free).

An embedding request runs as a one-token generation whose prompt's last token's
final hidden state (after the model's last norm) is the embedding: last-token
pooling, what decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral)
use; MEAN (all prompt rows averaged) and CLS (the first row) when the model's
``pooler_config`` or sentence-transformers config says so. The worker truncates
it to `dimensions` (Matryoshka), normalizes it (L2) when asked, and returns it
with the step's output; the sampled token is dropped. docs/embeddings.md has the details. A classification request
(``task="classify"``) runs the same way, and the worker applies the model's
``score`` head to that hidden state instead (docs/pooling.md). A per-token embedding request
(``task="token_embed"``, vLLM's ALL pooling; `AsyncEngine.encode`) gets every prompt token's final hidden
state, each truncated and normalized as an embedding is (`PoolingOutput`); a per-token classification
(``task="token_classify"``) a classification model's ``score`` head applied to every prompt row; on a reward model
(``convert="reward"``, vLLM's ``as_reward_model``) every prompt row itself, or STEP pooling's rows and columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from asyncllm.config_checks import is_int
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.outputs import RequestMetrics

__all__ = ["PoolingParams", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "PoolingOutput",
           "POOLING_TASKS", "POOLING_TYPES", "PER_TOKEN_TASKS", "REWARD_POOLING_TYPES", "check_pooler_config",
           "check_step_fields", "encode_params", "token_rows"]

POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
"""What a pooling request returns: ``embed`` the hidden state, ``classify`` a classification model's logits,
``token_embed`` every prompt token's hidden state, ``token_classify`` every prompt token's logits (vLLM's per-token
tasks, its ALL pooling)."""

PER_TOKEN_TASKS = ("token_embed", "token_classify")
"""The tasks that pool every prompt row (``pooling_type`` ``"ALL"``)."""


POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""How an embedding is made from the prompt's final hidden states: the last token's row, the mean of all rows, or
the first token's row (docs/embeddings.md)."""

REWARD_POOLING_TYPES = ("ALL", "STEP")
"""A reward model's pooling (``convert="reward"``, vLLM's ``as_reward_model``): every prompt row (ALL), or the rows of
the step tag tokens, with the chosen columns (STEP: ``step_tag_id``, ``returned_token_ids``)."""
_POOLER_KEYS = ("pooling_type", "normalize")
_REWARD_POOLER_KEYS = ("step_tag_id", "returned_token_ids", "use_activation")
_UNBUILT_POOLER_KEYS = ("dimensions", "enable_chunked_processing", "max_embed_len", "activation", "softmax",
                        "logit_bias")


def check_pooler_config(value: Any, reward: bool = False) -> None:
    """`ConfigError` unless ``value`` is None or a dict of vLLM ``PoolerConfig`` fields asyncllm applies
    (``pooling_type`` one of `POOLING_TYPES`, ``normalize`` a bool; for a reward model, ``reward``: ``pooling_type``
    ALL or STEP, ``step_tag_id``, ``returned_token_ids`` and ``use_activation``); `NotBuiltError` for those it does
    not."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError("pooler_config", value, "a dict of PoolerConfig fields (pooling_type, normalize), or None")
    built = (*_POOLER_KEYS, *_REWARD_POOLER_KEYS) if reward else _POOLER_KEYS
    for key in value:
        if key in _UNBUILT_POOLER_KEYS or key in _REWARD_POOLER_KEYS and not reward:
            raise NotBuiltError("pooler_config", value, f"the pooler_config field {key!r} (built: "
                                                        f"{', '.join(built)}; step_tag_id, returned_token_ids and "
                                                        "use_activation for convert='reward')")
        if key not in built:
            raise ConfigError("pooler_config", value, f"PoolerConfig fields ({', '.join(built)}); {key!r} is not one")
    kind = value.get("pooling_type")
    if reward:
        _check_reward_pooler(value)
    elif kind is not None:
        if kind in REWARD_POOLING_TYPES:
            raise NotBuiltError("pooler_config", value, f"{kind} pooling (built: {', '.join(POOLING_TYPES)}; ALL and "
                                                        "STEP for convert='reward')")
        if kind not in POOLING_TYPES:
            raise ConfigError("pooler_config", value, f"pooling_type one of {', '.join(POOLING_TYPES)}")
    if "normalize" in value and not isinstance(value["normalize"], bool):
        raise ConfigError("pooler_config", value, "normalize True or False")


def _check_reward_pooler(value: dict[str, Any]) -> None:
    kind = value.get("pooling_type")
    if kind is not None and kind not in REWARD_POOLING_TYPES:
        raise ConfigError("pooler_config", value, "pooling_type ALL or STEP for a reward model (convert='reward': "
                                                  "one result per prompt token)")
    if "normalize" in value:
        raise ConfigError("pooler_config", value, "no normalize for a reward model (its rows are not embeddings)")
    for key in ("step_tag_id", "returned_token_ids"):
        if value.get(key) is not None and kind != "STEP":
            raise ConfigError("pooler_config", value, f"{key} with pooling_type 'STEP' only (it picks the rows or "
                                                      "columns STEP pooling returns)")
    check_step_fields(value.get("step_tag_id"), value.get("returned_token_ids"),
                      lambda message: ConfigError("pooler_config", value, message))
    if value.get("use_activation") not in (None, True, False):
        raise ConfigError("pooler_config", value, "use_activation True or False")


def check_step_fields(step_tag_id: Any, returned_token_ids: Any, error: Any) -> None:
    """``step_tag_id`` a token id (int >= 0) or None, ``returned_token_ids`` a non-empty list of column indices or
    None, each below 2**63 (the wire's int64); ``error(message)`` the exception to raise."""
    if step_tag_id is not None and not _wire_index(step_tag_id):
        raise error(f"step_tag_id a token id (an int >= 0), got {step_tag_id!r}")
    if returned_token_ids is not None and (not isinstance(returned_token_ids, (list, tuple)) or not returned_token_ids
                                           or not all(_wire_index(i) for i in returned_token_ids)):
        raise error(f"returned_token_ids a non-empty list of ints >= 0, got {returned_token_ids!r}")


def _wire_index(value: Any) -> bool:
    """An int from 0 below 2**63: msgpack carries it to the core as an int64."""
    return is_int(value) and 0 <= value < 2**63


class PoolingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """How an embedding is made from the last prompt token's hidden state (vLLM's ``PoolingParams``)."""

    normalize: bool | None = None
    """Divide by the L2 norm (after truncating to `dimensions`); None: the model's default (``pooler_config``'s
    ``normalize``, else True)."""
    dimensions: int | None = None
    """Keep the first this many features (Matryoshka embeddings); None: all ``hidden_size``."""
    task: str = "embed"
    """``"embed"``; ``"classify"`` (what `AsyncEngine.classify` and `score` send): the model's ``score`` head
    applied to the hidden state, raw logits (``normalize`` and ``dimensions`` do not apply); ``"token_embed"``
    (what `AsyncEngine.encode` sends for it): one embedding per prompt token (``normalize`` and ``dimensions``
    apply to each); ``"token_classify"``: a classification model's raw logits per prompt token."""
    pooling_type: str = "LAST"
    """Set by the engine from the model's pooling (`POOLING_TYPES`; ``pooler_config`` or the checkpoint's
    sentence-transformers config), not by callers: which prompt rows make the embedding. ``"ALL"`` for the
    `PER_TOKEN_TASKS` (every row, vLLM's ALL pooling); ``"STEP"`` for a reward model's ``token_classify`` (every row,
    then ``step_tag_id`` / ``returned_token_ids`` and the activation in the worker: vLLM's StepPooler)."""
    token_type_start: int | None = None
    """Set by the engine for a `score` pair, not by callers: the prompt index where the tokenizer's
    ``token_type_ids`` turn 1 (the second text; vLLM's ``compressed_token_type_ids``). None: every token type 0."""
    use_activation: bool | None = None
    """``token_classify`` only (vLLM's): False returns the raw logits; None or True each token's through the model's
    activation (`classify`'s: softmax over the labels, sigmoid for one)."""
    step_tag_id: int | None = None
    """A reward model with STEP pooling only (vLLM's): keep the rows of the prompt tokens with this id; None: the
    model's ``pooler_config`` value (None there: every row)."""
    returned_token_ids: list[int] | None = None
    """A reward model with STEP pooling only (vLLM's): keep these columns of each row (e.g. a process reward model's
    good and bad tokens); None: the model's ``pooler_config`` value (None there: every column)."""

    def validate(self, hidden_size: int | None = None) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be a bool or None, got {self.normalize!r}")
        if self.pooling_type not in POOLING_TYPES and (self.pooling_type != "ALL" or self.task not in PER_TOKEN_TASKS) \
                and (self.pooling_type != "STEP" or self.task != "token_classify"):
            raise InvalidRequestError("pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got "
                                                      f"{self.pooling_type!r}")
        if type(self.task) is not str or self.task not in POOLING_TASKS:  # numpy's str_ equals one, but no wire
            raise InvalidRequestError("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.task in ("classify", "token_classify") and self.dimensions is not None:
            raise InvalidRequestError("dimensions", "applies to embeddings, not to classification")
        if self.task == "token_classify" and self.normalize is not None:
            raise InvalidRequestError("normalize", "applies to embeddings, not to classification")
        if self.use_activation is not None and (self.task != "token_classify" or
                                                not isinstance(self.use_activation, bool)):
            raise InvalidRequestError("use_activation", "is true, false or None, for task 'token_classify' only, got "
                                                        f"{self.use_activation!r} for task {self.task!r}")
        if self.step_tag_id is not None or self.returned_token_ids is not None:
            if self.task != "token_classify":
                raise InvalidRequestError("step_tag_id" if self.step_tag_id is not None else "returned_token_ids",
                                          f"is for a reward model's task 'token_classify', not {self.task!r}")
            check_step_fields(self.step_tag_id, self.returned_token_ids, _step_error)
        if self.dimensions is None:
            return
        if not is_int(self.dimensions) or self.dimensions < 1:
            raise InvalidRequestError("dimensions", f"must be a positive int, got {self.dimensions!r}")
        if hidden_size is not None and self.dimensions > hidden_size:
            raise InvalidRequestError("dimensions", f"is {self.dimensions}, but the model's embeddings have "
                                                    f"{hidden_size} features")


def _step_error(message: str) -> InvalidRequestError:
    field, text = message.split(" ", 1)
    return InvalidRequestError(field, f"must be {text}")


ENCODE_TASKS = ("embed", "token_embed", "token_classify")
"""The ``pooling_task`` values `AsyncEngine.encode` takes (vLLM's ``LLM.encode`` takes every ``PoolingTask``)."""


def encode_params(pooling_task: Any, pooling_params: PoolingParams | None) -> PoolingParams:
    """`AsyncEngine.encode`'s request: `pooling_params` (None: the defaults) with `pooling_task` as its task, as vLLM's
    ``LLM.encode`` sets it; `InvalidRequestError` naming ``pooling_task`` for a missing or unserved one."""
    if pooling_task is None:
        raise InvalidRequestError("pooling_task", f"is required for encode, one of {', '.join(ENCODE_TASKS)} (vLLM's "
                                                  "LLM.encode requires it too)")
    if pooling_task in ("classify", "score"):
        raise InvalidRequestError("pooling_task", f"{pooling_task!r}: use classify() or score() for it")
    if pooling_task not in ENCODE_TASKS:
        raise InvalidRequestError("pooling_task", f"must be one of {', '.join(ENCODE_TASKS)}, got {pooling_task!r}")
    if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
        raise InvalidRequestError("pooling_params", f"must be an asyncllm.PoolingParams, got {pooling_params!r}")
    return msgspec.structs.replace(pooling_params or PoolingParams(), task=pooling_task)


def token_rows(flat: list[float], num_tokens: int) -> list[list[float]]:
    """A ``token_embed`` result's embeddings, one per prompt token, from the worker's ``num_tokens`` rows of floats
    one after the other."""
    if num_tokens == 0:  # STEP pooling of a prompt without the step tag
        assert not flat, len(flat)
        return []
    width, extra = divmod(len(flat), num_tokens)
    assert not extra, (len(flat), num_tokens)
    return [flat[i * width : (i + 1) * width] for i in range(num_tokens)]


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
class PoolingOutput(_FlatOutputs):
    """The result of `AsyncEngine.encode` (vLLM's ``PoolingRequestOutput``, flattened: ``out.data`` is vLLM's
    ``out.outputs.data``, as lists of floats rather than a tensor)."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[list[float]] | list[float]
    """``token_embed``: one embedding per prompt token, in prompt order; ``token_classify``: one list of
    (activated) logits per prompt token; ``embed``: the prompt's embedding."""
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
