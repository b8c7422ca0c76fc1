"""`AsyncEngine.classify` and `AsyncEngine.score` (vLLM's ``LLM.classify`` and ``LLM.score``) over the pooling path.

A classification request is an embedding request whose `PoolingParams.task`
is ``"classify"``: the worker applies the model's score head to the last
token's hidden row and returns the logits; the activation and the label names
are applied here, on the host (asyncllm/engine/pooling_model.py).

`score` pairs ``text_1`` with each text of ``text_2`` (1:1, 1:N or N:N, as
vLLM). A cross-encoder (a classifier with one label) reads a pair as one
prompt (``tokenizer(text_1, text_2)``, tokenized on the processor thread) and
scores the activated logit; a late-interaction model (ColBERT) token-embeds each
distinct text once and scores the MaxSim of two texts' token embeddings; any other
model embeds each distinct text once and scores the cosine similarity of two
embeddings. docs/pooling.md has the details.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import numpy as np

from asyncllm.engine.admission import admission_group
from asyncllm.engine.pooling_model import ClassifierHead, activate
from asyncllm.engine.stream import RequestOptions
from asyncllm.errors import InvalidRequestError
from asyncllm.pooling import ClassificationOutput, PoolingParams, ScoringOutput

if TYPE_CHECKING:
    import torch

    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.collector import RequestCollector

__all__ = ["classify", "score", "score_pairs", "cosine_scores", "maxsim_scores"]

_CLASSIFY = PoolingParams(task="classify")
_EMBED = PoolingParams()
_TOKEN_EMBED = PoolingParams(task="token_embed")
T = TypeVar("T")


async def classify(engine: AsyncEngine, prompt: Any, options: RequestOptions,
                   truncate_prompt_tokens: int | None, chat: bool = False) -> ClassificationOutput:
    """`AsyncEngine.classify`; `chat`: `prompt` is chat messages (`AsyncEngine._pool`'s)."""
    collector = await engine._pool(prompt, dataclasses.replace(options, pooling=_CLASSIFY), truncate_prompt_tokens,
                                   chat)
    head = _classifier(engine)
    logits = collector.embedding or []
    probs = activate(logits, head.classify_activation)
    top = max(range(len(probs)), key=probs.__getitem__)
    return ClassificationOutput(collector.request_id, collector.prompt_token_ids, probs, logits, head.labels[top],
                                collector.metrics, collector.num_cached_tokens)


async def score(engine: AsyncEngine, text_1: Any, text_2: Any, options: RequestOptions,
                truncate_prompt_tokens: int | None, activated: bool = True) -> list[ScoringOutput]:
    firsts, seconds = score_pairs(text_1, text_2)
    await engine.start()
    assert engine.pooling_model is not None, "set by start"
    head = engine.pooling_model.classifier
    if head is None:
        if not activated:
            raise InvalidRequestError("use_activation", "false reads a cross-encoder's raw logit; this model scores by "
                                                        "the similarity of embeddings (cosine; a late-interaction "
                                                        "model's MaxSim), which has no activation")
        return await _embedding_scores(engine, firsts, seconds, options, truncate_prompt_tokens,
                                       engine.pooling_model.late_interaction)
    engine.pooling_model.check(_CLASSIFY)  # a token classifier (token_classify only) refused by name
    if head.num_labels != 1:
        raise InvalidRequestError("model", f"score needs a cross-encoder (a classification model with one label); "
                                           f"this one has {head.num_labels}: use classify()")
    pairs = [_cross_encode(engine, head if activated else None, first, second, options, truncate_prompt_tokens)
             for first, second in zip(firsts, seconds)]
    return await _gather(pairs)


def score_pairs(text_1: Any, text_2: Any) -> tuple[list[str], list[str]]:
    """The pairs to score: ``text_1`` repeated for every ``text_2`` (1:N) or zipped with it (N:N)."""
    firsts, seconds = _texts("text_1", text_1), _texts("text_2", text_2)
    if len(firsts) == 1:
        return firsts * len(seconds), seconds
    if len(firsts) != len(seconds):
        raise InvalidRequestError("text_2", f"has {len(seconds)} texts for the {len(firsts)} of text_1: give one "
                                            "text_1 for all of them (1:N) or one per text (N:N)")
    return firsts, seconds


def cosine_scores(vectors: Sequence[Sequence[float] | None], firsts: Sequence[int],
                  seconds: Sequence[int]) -> list[float]:
    """The cosine similarity of ``vectors[firsts[i]]`` and ``vectors[seconds[i]]`` for each pair i (0.0 where either
    is all zeros, or missing), vectorized: each vector's norm once, and for one query against many (1:N) a single
    matrix-vector product. In float64, as the Python sums it replaces (the vectors are float32 values)."""
    import torch  # loaded by then (the engine's start imports it); not by importing this module

    matrix = _stack(vectors)
    norms = torch.linalg.vector_norm(matrix, dim=1)
    first, second = torch.tensor(firsts, dtype=torch.long), torch.tensor(seconds, dtype=torch.long)
    if len(set(firsts)) == 1:  # 1:N: every vector against the query, then the pairs' picked
        dots = (matrix @ matrix[firsts[0]])[second]
    else:
        dots = torch.linalg.vecdot(matrix[first], matrix[second])
    denominators = norms[first] * norms[second]
    return torch.where(denominators == 0, 0.0, dots / denominators).tolist()


def maxsim_scores(embeddings: Sequence[Sequence[float]], num_tokens: Sequence[int], firsts: Sequence[int],
                  seconds: Sequence[int]) -> list[float]:
    """Late interaction's MaxSim of ``embeddings[firsts[i]]`` (the query's token rows) against
    ``embeddings[seconds[i]]`` (the document's) for each pair i: the sum over the query's tokens of the largest dot
    product with any document token (vLLM's ``compute_maxsim_score``). ``embeddings[k]`` is a text's ``token_embed``
    floats, ``num_tokens[k]`` rows laid end to end; each text's matrix is built once, then one matrix product per
    pair. In float64, as `cosine_scores` (the rows are float32 values; vLLM sums them in float32)."""
    import torch

    matrices: dict[int, torch.Tensor] = {}

    def rows(k: int) -> torch.Tensor:
        if k not in matrices:
            flat = np.asarray(embeddings[k], dtype=np.float64)
            matrices[k] = torch.from_numpy(flat.reshape(num_tokens[k], -1))
        return matrices[k]

    return [(rows(i) @ rows(j).T).amax(dim=1).sum().item() for i, j in zip(firsts, seconds)]


def _stack(vectors: Sequence[Sequence[float] | None]) -> torch.Tensor:
    """The vectors as the rows of one float64 matrix (a missing one all zeros), filled a row at a time: run off the
    event loop, each row is a point where the loop's thread can take the GIL back."""
    import torch

    width = max((len(vector) for vector in vectors if vector), default=0)
    matrix = np.zeros((len(vectors), width), dtype=np.float64)
    for row, vector in zip(matrix, vectors):
        if vector:
            row[:] = vector
    return torch.from_numpy(matrix)


async def _cross_encode(engine: AsyncEngine, head: ClassifierHead | None, text_1: str, text_2: str,
                        options: RequestOptions, truncate_prompt_tokens: int | None) -> ScoringOutput:
    """A pair's score: its logit through ``head``'s score activation (None: the raw logit, vLLM's
    ``use_activation=False``)."""
    pair = dataclasses.replace(options, pooling=_CLASSIFY, text_pair=text_2)
    collector = await engine._pool(text_1, pair, truncate_prompt_tokens)
    logits = collector.embedding or []
    value = (logits if head is None else activate(logits, head.score_activation))[0]
    return ScoringOutput(value, collector.prompt_token_ids, collector.request_id)


async def _embedding_scores(engine: AsyncEngine, firsts: list[str], seconds: list[str], options: RequestOptions,
                            truncate_prompt_tokens: int | None, late: bool = False) -> list[ScoringOutput]:
    """Cosine scores of embeddings; `late`: MaxSim scores of token embeddings (a late-interaction model's)."""
    texts = list(dict.fromkeys([*firsts, *seconds]))  # each distinct text is embedded once (a 1:N query too)
    embed = dataclasses.replace(options, pooling=_TOKEN_EMBED if late else _EMBED)
    pooled = await _gather([engine._pool(text, embed, truncate_prompt_tokens) for text in texts])
    index = {text: i for i, text in enumerate(texts)}
    pairs = [(index[first], index[second]) for first, second in zip(firsts, seconds)]
    vectors = [collector.embedding for collector in pooled]
    firsts_at, seconds_at = [i for i, _ in pairs], [j for _, j in pairs]
    # off the event loop: the lists' conversion is most of the time (4096 x 2048 floats: a fraction of a second)
    if late:
        values = await anyio.to_thread.run_sync(maxsim_scores, vectors, [len(c.prompt_token_ids) for c in pooled],
                                                firsts_at, seconds_at, abandon_on_cancel=True)
    else:
        values = await anyio.to_thread.run_sync(cosine_scores, vectors, firsts_at, seconds_at, abandon_on_cancel=True)
    return [_embedding_score(pooled[i], pooled[j], value) for (i, j), value in zip(pairs, values)]


def _embedding_score(first: RequestCollector, second: RequestCollector, value: float) -> ScoringOutput:
    return ScoringOutput(value, first.prompt_token_ids + second.prompt_token_ids,
                         f"{first.request_id}_{second.request_id}")


def _texts(field: str, value: Any) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise InvalidRequestError(field, f"must be a str or a non-empty list of str, got {value!r:.80}")
    if not all(texts):
        raise InvalidRequestError(field, "has an empty text: there is nothing to score")
    return texts


def _classifier(engine: AsyncEngine) -> ClassifierHead:
    model = engine.pooling_model
    assert model is not None and model.classifier is not None, "the processor refuses classify on other models"
    return model.classifier


async def _gather(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """All at once, results in order, in one admission group (an idle engine takes them all, whatever its queue
    limits); the first error cancels the others (each aborts its request) and is raised."""
    with admission_group(len(awaitables)):  # the tasks inherit the group
        tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
