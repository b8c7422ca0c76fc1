"""Embeddings: `PoolingParams` and the result of `AsyncEngine.embed` (torch-free).

An embedding request runs as a one-token generation whose prompt's last token's
final hidden state (after the model's last norm) is the embedding: last-token
pooling, what decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral)
use. The worker truncates it to `dimensions` (Matryoshka), normalizes it
(L2) when asked, and returns it with the step's output; the sampled token is
dropped. docs/embeddings.md has the details.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import RequestMetrics

__all__ = ["PoolingParams", "EmbeddingOutput"]


class PoolingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """How an embedding is made from the last prompt token's hidden state (vLLM's ``PoolingParams``)."""

    normalize: bool = True
    """Divide by the L2 norm (after truncating to `dimensions`)."""
    dimensions: int | None = None
    """Keep the first this many features (Matryoshka embeddings); None: all ``hidden_size``."""

    def validate(self, hidden_size: int | None = None) -> None:
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be a bool, got {self.normalize!r}")
        if self.dimensions is None:
            return
        if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
            raise InvalidRequestError("dimensions", f"must be a positive int, got {self.dimensions!r}")
        if hidden_size is not None and self.dimensions > hidden_size:
            raise InvalidRequestError("dimensions", f"is {self.dimensions}, but the model's embeddings have "
                                                    f"{hidden_size} features")


@dataclass(slots=True)
class EmbeddingOutput:
    """The result of `AsyncEngine.embed`."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
