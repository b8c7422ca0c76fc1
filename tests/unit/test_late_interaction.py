"""Late interaction (ColBERT, ``HF_ColBERT``) without an engine: `scoring.maxsim_scores` against plain Python sums
(vLLM's MaxSim: for each query token the largest dot product with a document token, summed; text_1 the query), what
the host and the core serve for the architecture, and its dimension from the config. Against transformers and the
server's routes: tests/engine/test_colbert.py."""

from __future__ import annotations

import types

import pytest
import torch

from asyncllm.engine import scoring
from asyncllm.engine.pooling_model import pooling_model_of
from asyncllm.engine.validation import served_tasks
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.models.architectures import late_interaction_dim, serves_as_encoder
from asyncllm.pooling import PoolingParams


def _python_maxsim(query: list[list[float]], doc: list[list[float]]) -> float:
    return sum(max(sum(a * b for a, b in zip(q, d)) for d in doc) for q in query)


def test_maxsim_scores_equal_python_sums_and_are_asymmetric() -> None:
    generator = torch.Generator().manual_seed(3)
    lengths = [5, 3, 9, 1]
    texts = [torch.randn(n, 8, generator=generator, dtype=torch.float32) for n in lengths]
    flats = [rows.flatten().tolist() for rows in texts]
    firsts, seconds = [0, 0, 0, 1, 2, 3], [1, 2, 3, 0, 2, 0]
    got = scoring.maxsim_scores(flats, lengths, firsts, seconds)
    want = [_python_maxsim(texts[i].tolist(), texts[j].tolist()) for i, j in zip(firsts, seconds)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert got[0] != pytest.approx(got[3])  # query and document do not commute
    assert all(isinstance(value, float) for value in got)


def test_a_colbert_serves_token_embed_only() -> None:
    config = types.SimpleNamespace(architectures=["HF_ColBERT"], model_type="bert", dim=16)
    model = pooling_model_of("HF_ColBERT", config, runner="pooling")
    assert model.late_interaction and model.pooling_tasks == ("token_embed",) and not model.generates
    model.check(PoolingParams(task="token_embed"))
    for task in ("embed", "classify", "token_classify"):
        with pytest.raises(InvalidRequestError, match=f"late-interaction model.*token_embed only, not {task}"):
            model.check(PoolingParams(task=task))
    applied = model.apply(PoolingParams(task="token_embed"))
    assert applied is not None and (applied.pooling_type, applied.normalize) == ("ALL", True)
    assert served_tasks(["HF_ColBERT"], "pooling") == frozenset({"token_embed"})
    assert serves_as_encoder("HF_ColBERT", config)


def test_the_colbert_dimension_from_its_config() -> None:
    assert late_interaction_dim(types.SimpleNamespace(colbert_dim=96, dim=128)) == 96
    assert late_interaction_dim(types.SimpleNamespace(dim=128)) == 128
    assert late_interaction_dim(types.SimpleNamespace(projection_dim=64)) == 64
    with pytest.raises(ConfigError, match="colbert_dim, dim or projection_dim.*hf_overrides"):
        late_interaction_dim(types.SimpleNamespace(name_or_path="colbert"))
