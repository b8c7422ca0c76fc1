"""`AsyncEngine.score` on an embedding model: the pairs' cosine similarities are computed vectorized
(`scoring.cosine_scores`: each norm once, one matrix-vector product for 1:N) off the event loop, and equal an
independent reference (torch's ``cosine_similarity``, and the plain float64 sums the engine used before), zero
vectors scoring 0.0. Against transformers' embeddings: tests/integrations/test_openai_score.py."""

from __future__ import annotations

import math
import threading
import types

import pytest
import torch

from asyncllm.engine import scoring
from asyncllm.engine.stream import RequestOptions


def _vectors(count: int, width: int, zero: tuple[int, ...] = ()) -> list[list[float]]:
    """Random float32 values as lists (the collectors' form), rows `zero` all zeros."""
    rows = torch.randn(count, width, generator=torch.Generator().manual_seed(count * width), dtype=torch.float32)
    rows[list(zero)] = 0.0
    return rows.tolist()


def _reference(vectors: list[list[float]], firsts: list[int], seconds: list[int]) -> list[float]:
    matrix = torch.tensor(vectors, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(matrix[firsts], matrix[seconds], dim=1).tolist()


def _python_sums(a: list[float], b: list[float]) -> float:
    """The pure-Python cosine `score` used before (0.0 where a norm is 0)."""
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / norms if norms else 0.0


@pytest.mark.parametrize("firsts, seconds", [
    ([0] * 9, list(range(1, 10))),  # 1:N: one query against every other vector (two of them zeros)
    ([0] * 3, [4, 4, 0]),  # 1:N with a repeated document and the query against itself
    ([1, 2, 3, 4, 5], [6, 7, 8, 9, 0]),  # N:N
    ([3, 7, 2], [3, 7, 3]),  # N:N, zeros against themselves and others
    ([5], [5]),  # 1:1
])
def test_cosine_scores_equal_the_references(firsts: list[int], seconds: list[int]) -> None:
    vectors = _vectors(10, 257, zero=(3, 7))
    got = scoring.cosine_scores(vectors, firsts, seconds)
    assert got == pytest.approx(_reference(vectors, firsts, seconds), rel=1e-12, abs=1e-12)
    assert got == pytest.approx([_python_sums(vectors[i], vectors[j]) for i, j in zip(firsts, seconds)],
                                rel=1e-12, abs=1e-12)
    assert all(got[k] == 0.0 for k, (i, j) in enumerate(zip(firsts, seconds)) if {i, j} & {3, 7})


def test_cosine_scores_of_a_wide_batch() -> None:
    """A rerank's shape (a query, many documents, an embedding model's width) in one call."""
    vectors = _vectors(257, 1024, zero=(100,))
    firsts, seconds = [0] * 256, list(range(1, 257))
    got = scoring.cosine_scores(vectors, firsts, seconds)
    assert got == pytest.approx(_reference(vectors, firsts, seconds), rel=1e-12, abs=1e-12)
    assert got[99] == 0.0 and len(got) == 256


class _StubEngine:
    """What `score` reads of an engine with an embedding model (no classifier head): `_pool` answers each text's
    collector with a fixed embedding."""

    def __init__(self, embeddings: dict[str, list[float]]) -> None:
        self.embeddings = embeddings
        self.pooling_model = types.SimpleNamespace(classifier=None, late_interaction=False)

    async def start(self) -> None:
        pass

    async def _pool(self, text: str, options: RequestOptions, truncate: int | None) -> types.SimpleNamespace:
        return types.SimpleNamespace(embedding=self.embeddings[text], prompt_token_ids=[len(text)],
                                     request_id=f"id-{text}")


async def test_score_runs_the_vectorized_cosine_off_the_loop(monkeypatch) -> None:
    texts = ["q", "a", "b", "zero", "c"]
    vectors = _vectors(len(texts), 64, zero=(3,))
    engine = _StubEngine(dict(zip(texts, vectors)))
    threads: list[threading.Thread] = []
    vectorized = scoring.cosine_scores

    def spy(*args):
        threads.append(threading.current_thread())
        return vectorized(*args)

    monkeypatch.setattr(scoring, "cosine_scores", spy)
    one_to_n = await scoring.score(engine, "q", texts[1:], RequestOptions(), None)
    n_to_n = await scoring.score(engine, ["a", "zero"], ["c", "q"], RequestOptions(), None)
    assert [out.score for out in one_to_n] == pytest.approx(_reference(vectors, [0] * 4, [1, 2, 3, 4]), abs=1e-12)
    assert [out.score for out in n_to_n] == pytest.approx([_python_sums(vectors[1], vectors[4]), 0.0], abs=1e-12)
    assert [(out.prompt_token_ids, out.request_id) for out in n_to_n] == [([1, 1], "id-a_id-c"),
                                                                           ([4, 1], "id-zero_id-q")]
    assert len(threads) == 2 and threading.main_thread() not in threads
