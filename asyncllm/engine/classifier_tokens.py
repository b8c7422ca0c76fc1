"""vLLM's ``classifier_from_token`` (``hf_overrides``): a causal LM's checkpoint served as a classifier whose head is
its LM head's rows of these tokens (rerankers trained as causal LMs: Qwen3-Reranker, mxbai-rerank-v2,
bge-reranker-v2-gemma). The host resolves the tokens' ids and the head's form; the workers build the head from them
as the checkpoint is read (asyncllm/models/classifier.py). docs/pooling.md."""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.models.architectures import CLASSIFICATION_ARCHITECTURES, ENCODER_ARCHITECTURES

__all__ = ["METHODS", "classifier_from_tokens"]

METHODS = ("from_2_way_softmax", "no_post_processing")
"""vLLM's ``method`` values: one label, the second token's row less the first's (its sigmoid is the softmax
probability of the second token over the two); or one label per token, the rows as they are."""


def classifier_from_tokens(hf_config: Any, arch: str, tokenizer: Any) -> None:
    """Resolve ``classifier_from_token`` (with ``method``, or Qwen3-Reranker's ``is_original_qwen3_reranker``, which
    means ``from_2_way_softmax``) into the config the workers read: ``classifier_from_token_ids``,
    ``classifier_token_difference`` and ``num_labels``; a `ConfigError` naming ``hf_overrides`` otherwise."""
    tokens = hf_config.classifier_from_token
    field_value = f"classifier_from_token={tokens!r}"
    if arch not in CLASSIFICATION_ARCHITECTURES or arch in ENCODER_ARCHITECTURES:
        raise ConfigError("hf_overrides", field_value, "a decoder served as *ForSequenceClassification (set "
                                                       "'architectures' too, e.g. ['Qwen3ForSequenceClassification'])")
    method = getattr(hf_config, "method", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False) and method in (None, METHODS[0]):
        method = METHODS[0]
    elif method is not None and method not in METHODS:
        raise ConfigError("hf_overrides", f"method={method!r}", f"one of {', '.join(METHODS)} with "
                                                                 "classifier_from_token (vLLM's)")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens] if isinstance(tokens, list) else []
    unknown = [t for t, i in zip(tokens, ids) if not isinstance(i, int) or i == tokenizer.unk_token_id]
    difference = method == METHODS[0]
    if not ids or unknown or (difference and len(ids) != 2):
        missing = f"; unknown: {', '.join(map(repr, unknown))}" if unknown else ""
        raise ConfigError("hf_overrides", field_value, f"a list of tokens of the vocabulary (two with {METHODS[0]} "
                                                       f"or is_original_qwen3_reranker){missing}")
    hf_config.classifier_from_token_ids = ids
    hf_config.classifier_token_difference = difference
    hf_config.num_labels = 1 if difference else len(ids)
