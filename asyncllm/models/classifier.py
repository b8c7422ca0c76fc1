"""Sequence classification (``LlamaForSequenceClassification`` & co.): a decoder with a ``score`` head.

transformers' classifier is the bare decoder (weights ``model.*``) plus
``score = Linear(hidden, num_labels, bias=False)`` applied to the last token's
final hidden state. Here the decoder is the causal LM's, without its LM head: a
classification request runs like an embedding request (one prefill, one
dropped token: asyncllm/pooling.py), and the worker's pooler applies `classify`
to the row it would have embedded (workers/pooler.py). The head is small, so
every tensor-parallel rank keeps all of it (the final hidden state is whole on
every rank).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from asyncllm.models.layers import LoadedWeight, new_param, weight_narrow

__all__ = ["HeadOnDecoder", "ScoreHead", "SequenceClassification", "sequence_classifier"]


class ScoreHead(nn.Module):
    """``[..., hidden] -> [..., num_labels]`` logits, replicated on every rank."""

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(num_labels, hidden_size, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class HeadOnDecoder:
    """Mixed in before a causal LM class: its decoder and no LM head (a head of the subclass's reads the hidden
    states); a pooling request's one sampled token (dropped by the host) is id 0 (`compute_logits`)."""

    has_lm_head = False

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)  # type: ignore[call-arg]
        self.lm_head = None  # never loaded nor run: `compute_logits` below stands in for it
        self.vocab_size: int = hf_config.vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Zero logits: the request's one sampled token is id 0."""
        return hidden.new_zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)


class SequenceClassification(HeadOnDecoder):
    """Mixed in before a causal LM class: its decoder, no LM head, and a ``score`` head."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.score = ScoreHead(hf_config.hidden_size, hf_config.num_labels, kwargs["dtype"])
        self.from_tokens: list[int] | None = getattr(hf_config, "classifier_from_token_ids", None)
        """A causal LM served as a classifier (``hf_overrides`` ``classifier_from_token``; the host resolved the
        tokens' ids): the head is the LM head's rows of these tokens, read from the checkpoint."""
        self.token_difference = bool(getattr(hf_config, "classifier_token_difference", False))
        """vLLM's ``from_2_way_softmax`` (Qwen3-Reranker's): one label, the second token's row less the first's
        (sigmoid = softmax over the two); the host resolved it (asyncllm/engine/classifier_tokens.py)."""
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[..., hidden]`` -> float32 logits ``[..., num_labels]`` (in the model's dtype
        first, as transformers computes them)."""
        return self.score(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The decoder's weights as the causal LM loads them, and ``score.weight`` into the head."""
        head: set[str] = set()

        lm_head = "model.embed_tokens.weight" if self.tied else "lm_head.weight"

        def decoder_weights() -> Iterable[tuple[str, LoadedWeight]]:
            for name, weight in weights:
                if name == "score.weight" and self.from_tokens is None:
                    self._load_one(self.score.weight, name, weight, None)  # type: ignore[attr-defined]
                    head.add(name)
                elif name == lm_head and self.from_tokens is not None:
                    self._load_one(self.score.weight, "score.weight", self._token_rows(weight), None)  # type: ignore[attr-defined]
                    head.add("score.weight")
                    if self.tied:
                        yield name, weight  # the embedding, too
                else:
                    yield name, weight

        loaded = super().load_weights(decoder_weights())  # type: ignore[misc]
        return loaded | head


    def _token_rows(self, lm_head: LoadedWeight) -> torch.Tensor:
        """The score head from the LM head's rows of `from_tokens` (their difference for Qwen3-Reranker)."""
        assert self.from_tokens is not None
        rows = torch.cat([weight_narrow(lm_head, 0, token, 1) for token in self.from_tokens]).float()
        return (rows[1:2] - rows[0:1]) if self.token_difference else rows


def sequence_classifier(causal_lm: type) -> type:
    """The ``*ForSequenceClassification`` class over `causal_lm`'s decoder."""
    name = causal_lm.__name__.replace("ForCausalLM", "ForSequenceClassification")
    return type(name, (SequenceClassification, causal_lm), {})
