"""BERT-family encoders (``BertModel``, ``XLMRobertaModel``) serving embeddings: each prompt whole in one step,
bidirectional attention, equal to transformers' sentence embeddings (docs/embeddings.md, "Encoder models")."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest
from asgi_helpers import asgi_client
from encoder_utils import hf_pair_logits, hf_sentence_embedding, make_tiny_encoder

from asyncllm import AsyncEngine, InvalidRequestError, PoolingParams, SamplingParams
from asyncllm.integrations.openai_server import create_app

TEXTS = ["what is paged attention?", "the engine", "a query of a document: 42 tokens, then more words!"]
"""The longest has 19 tokens: past ModernBERT's 4-token local reach."""


@pytest.mark.parametrize("kind, pooling, tp", [("bert", "mean", 1), ("modernbert", None, 1), ("nomic", "mean", 2),
                                               ("gte", None, 1)])
async def test_sentence_embeddings_equal_transformers(tmp_path, kind: str, pooling: str | None, tp: int) -> None:
    """MEAN from a sentence-transformers config (the heads and MLP split over ranks by the decoders' parallel
    linears, tested with them); CLS, the encoders' default
    without one, for ModernBERT (prompts past its local window). Prompts of different lengths share each step;
    XLM-R's positions (after pad_token_id) are held by its cross-encoder below."""
    path = make_tiny_encoder(tmp_path / kind, kind, pooling=pooling)
    async with AsyncEngine(path, tensor_parallel_size=tp, disable_log_stats=True,
                           max_worker_restarts=0) as engine:  # a worker's failure ends the engine: the test fails
        assert (engine.config.enable_chunked_prefill, engine.config.enable_prefix_caching) == (False, False)
        outs = await asyncio.gather(*(engine.embed(text) for text in TEXTS + TEXTS[:1]))
        for text, out in zip(TEXTS + TEXTS[:1], outs):
            expected = hf_sentence_embedding(path, text, pooling or "cls")
            assert np.abs(np.array(out.embedding) - np.array(expected)).max() < 1e-5, text
        assert outs[-1].num_cached_tokens == 0  # no prefix caching: a cached prefix would skip attended tokens
        with pytest.raises(InvalidRequestError):
            await engine.generate(TEXTS[0], SamplingParams(max_tokens=2))
        filling = " ".join(["engine"] * (engine.config.max_model_len - 2))  # with [CLS] and [SEP]: max_model_len
        full = await engine.embed(filling)  # a pooling prompt may fill it (as vLLM's): every position of the table
        assert len(full.prompt_token_ids) == engine.config.max_model_len
        expected = hf_sentence_embedding(path, filling, pooling or "cls")
        assert np.abs(np.array(full.embedding) - np.array(expected)).max() < 1e-5
        too_long = " ".join(["engine"] * (engine.config.max_model_len + 1))
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await engine.embed(too_long)
        cut = await engine.embed(TEXTS[2], truncate_prompt_tokens=6)  # vLLM's pooling tokenizer: cut on the right
        assert np.abs(np.array(cut.embedding) - np.array(hf_sentence_embedding(path, TEXTS[2], pooling or "cls",
                                                                               max_length=6))).max() < 1e-5
        assert len(cut.prompt_token_ids) == 6 and cut.prompt_token_ids[0] == 2  # [CLS] kept
        with pytest.raises(InvalidRequestError, match="adds 2 special tokens") as info:  # it would not be cut
            await engine.embed(TEXTS[2], truncate_prompt_tokens=1)
        assert info.value.field == "truncate_prompt_tokens"
        with pytest.raises(InvalidRequestError, match="does not support matryoshka") as info:
            await engine.embed(TEXTS[0], PoolingParams(dimensions=8))  # vLLM's: no is_matryoshka in the config
        assert info.value.field == "dimensions"
        await _served_as_the_docs_show(engine, path)
        again = (await engine.embed(TEXTS[1])).embedding  # served on after the refusals
        # alone in its step now: the products' shapes differ from the first batch's (which arrival timing decides),
        # so only the last bits may
        np.testing.assert_allclose(again, outs[1].embedding, rtol=0, atol=1e-6)


async def _served_as_the_docs_show(engine: AsyncEngine, path: str) -> None:
    """Over the OpenAI server, a model that is not Matryoshka (as the bundled one): docs/integrations/openai-server.md's
    /v1/embeddings example runs, and a refusal of ``dimensions`` names the served model (vLLM's
    ``served_model_name``), not the checkpoint's path."""
    doc = (Path(__file__).parents[2] / "docs" / "integrations" / "openai-server.md").read_text()
    example = json.loads(re.search(r"curl localhost:8000/v1/embeddings .*?-d '([^']*)'", doc, re.S).group(1))
    app = create_app(engine, manage_engine=False, model_name=[example["model"], "alias"])
    async with asgi_client(app) as client:
        served = await client.post("/v1/embeddings", json=example)
        refused = await client.post("/v1/embeddings", json={"model": "alias", "input": "x", "dimensions": 8})
    assert served.status_code == 200 and len(served.json()["data"]) == len(example["input"]), served.text
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    message = refused.json()["error"]["message"]
    assert f'Model "{example["model"]}" does not support matryoshka' in message and str(path) not in message


async def test_embeddinggemma_with_its_dense_projections_equals_transformers(tmp_path) -> None:
    """EmbeddingGemma's form: Gemma 3 layers attending both ways (within 4 positions in the sliding layers; the
    prompts are longer), mean pooling, two Dense projections (32 -> 48 -> 32), Matryoshka truncation after them;
    ``token_embed`` rows through the same projections (vLLM's TokenEmbeddingPoolerHead)."""
    path = make_tiny_encoder(tmp_path / "gemma", "embeddinggemma", pooling="mean", dense=(48, 32))
    async with AsyncEngine(path, disable_log_stats=True, hf_overrides={"matryoshka_dimensions": [16]}) as engine:
        assert (engine.config.enable_chunked_prefill, engine.config.enable_prefix_caching) == (False, False)
        outs = await asyncio.gather(*(engine.embed(text) for text in TEXTS), engine.embed(TEXTS[2], PoolingParams(dimensions=16)))
        for out, text, dims in zip(outs, TEXTS + TEXTS[2:], (None, None, None, 16)):
            expected = hf_sentence_embedding(path, text, "mean", dims)
            assert len(out.embedding) == (dims or 32)
            assert np.abs(np.array(out.embedding) - np.array(expected)).max() < 1e-5, text
        with pytest.raises(InvalidRequestError, match=r"only supports \[16\] matryoshka dimensions") as info:
            await engine.embed(TEXTS[0], PoolingParams(dimensions=8))  # vLLM's: only matryoshka_dimensions
        assert info.value.field == "dimensions"
        tokens = await engine.encode(TEXTS[2], PoolingParams(dimensions=16), pooling_task="token_embed")
        expected = hf_sentence_embedding(path, TEXTS[2], "all", 16)  # each row projected, cut, normalized
        assert len(tokens.data) == len(tokens.prompt_token_ids) == len(expected)
        assert np.abs(np.array(tokens.data) - np.array(expected)).max() < 1e-5


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "gte"])  # ModernBERT's head: tests/unit/test_bert_model.py
async def test_cross_encoders_score_and_classify_as_transformers(tmp_path, kind: str) -> None:
    """A one-logit cross-encoder (bge-reranker's form: XLM-R; ms-marco MiniLM's: BERT, whose pair's second text
    has token type 1; gte-multilingual-reranker's: GTE's pooler and classifier over rotary layers): `score` is the sigmoid of transformers' logit for each (query, document) pair, `classify`
    of one text its logit; ``token_classify`` served beside them (its rows:
    tests/engine/test_encoder_token_classification.py)."""
    path = make_tiny_encoder(tmp_path / kind, kind, num_labels=1)
    query, documents = TEXTS[0], TEXTS[1:] + ["paged attention is what the engine does"]
    async with AsyncEngine(path, disable_log_stats=True) as engine:
        scores = await engine.score(query, documents)
        single = await engine.classify(TEXTS[2])
        assert await engine.get_supported_tasks() == ("classify", "score", "token_classify")  # vLLM's for_seq_cls
    for document, out in zip(documents, scores):
        [logit] = hf_pair_logits(path, query, document)
        assert out.score == pytest.approx(1 / (1 + np.exp(-logit)), abs=1e-5), document
    assert single.logits == pytest.approx(hf_pair_logits(path, TEXTS[2]), abs=1e-5)


async def test_an_encoder_with_a_token_budget_below_max_model_len_is_refused_at_start(tmp_path) -> None:
    """Every encoder prompt runs whole in one step: a budget below max_model_len would refuse long prompts with
    advice that cannot be followed (chunked prefill), so the start is refused naming the field (as vLLM)."""
    from asyncllm import ConfigError

    path = make_tiny_encoder(tmp_path / "bert", "bert", pooling="mean")
    with pytest.raises(ConfigError, match="max_num_batched_tokens=16 .*at least max_model_len=40"):
        async with AsyncEngine(path, max_num_batched_tokens=16, max_model_len=40):
            pass


async def test_a_roberta_masked_lm_checkpoint_embeds_with_its_encoder(tmp_path) -> None:
    """vLLM serves ``RobertaForMaskedLM`` as an embedding model: the encoder's CLS row (positions after
    ``pad_token_id``), its LM head unread; generation refused."""
    path = make_tiny_encoder(tmp_path / "roberta", "roberta-mlm")
    assert json.loads((Path(path) / "config.json").read_text())["architectures"] == ["RobertaForMaskedLM"]
    async with AsyncEngine(path, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.embed(text) for text in TEXTS))
        with pytest.raises(InvalidRequestError):
            await engine.generate(TEXTS[0], SamplingParams(max_tokens=2))
    for text, out in zip(TEXTS, outs):
        np.testing.assert_allclose(out.embedding, hf_sentence_embedding(path, text, "cls"), rtol=0, atol=1e-5)
