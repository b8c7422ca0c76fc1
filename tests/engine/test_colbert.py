"""ColBERT late-interaction models (``HF_ColBERT``; docs/pooling.md, "Late-interaction models (ColBERT)"): a BERT
encoder whose every token's final hidden state goes through a bias-free ``linear.weight`` [dim, hidden]; they serve
``token_embed`` only (normalized per token by default), and ``score`` / ``/score`` / ``/rerank`` are the MaxSim of two
texts' token embeddings, as vLLM's. The reference: transformers' ``BertModel``, the linear and the norm."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from asgi_helpers import asgi_client
from encoder_utils import _tokenizer

from asyncllm import AsyncEngine, InvalidRequestError, PoolingParams, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.integrations.openai_server import create_app

TOLERANCE = 1e-5
QUERY = "what is paged attention?"
DOCS = ["the engine", "a query of a document: 42 tokens, then more words!", "paged attention is the engine",
        "what a model of attention"]


def _make_colbert(folder: Path, dim: int | None = 16, projection: str = "linear.weight") -> str:
    """A random BERT (hidden 32) and ``projection`` [dim, 32], saved as colbert-ir saves ``HF_ColBERT``: the encoder's
    tensors under ``bert.``, the projection bare, config.json's ``dim`` (None: no dimension in the config)."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    tokenizer = _tokenizer(token_types=True)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=66, pad_token_id=0)
    torch.manual_seed(5)
    model = BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.1 if "LayerNorm" in name else 0.3)
    weights = {f"bert.{name}": tensor.contiguous() for name, tensor in model.state_dict().items()
               if "position_ids" not in name}
    weights[projection] = torch.randn(dim or 16, 32) * 32**-0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    data = {**config.to_dict(), "architectures": ["HF_ColBERT"], "model_type": "bert"}
    if dim is not None:
        data["dim"] = dim
    (folder / "config.json").write_text(json.dumps(data))
    tokenizer.save_pretrained(folder)
    return str(folder)


def _reference(path: str, text: str, normalize: bool = True) -> torch.Tensor:
    """transformers' ``BertModel`` final hidden states through the checkpoint's linear, each row L2-normalized."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertConfig, BertModel

    weights = load_file(str(Path(path) / "model.safetensors"))
    model = BertModel(BertConfig.from_pretrained(path), add_pooling_layer=False).eval()
    model.load_state_dict({k.removeprefix("bert."): v for k, v in weights.items() if k.startswith("bert.")})
    with torch.no_grad():
        hidden = model(**AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")).last_hidden_state[0]
    rows = hidden @ weights["linear.weight"].T
    return torch.nn.functional.normalize(rows, dim=-1) if normalize else rows


def _maxsim(query: torch.Tensor, doc: torch.Tensor) -> float:
    return (query.double() @ doc.double().T).amax(dim=1).sum().item()


def _close(rows: list[list[float]], expected: torch.Tensor) -> bool:
    got = torch.tensor(rows)
    return got.shape == expected.shape and (got - expected).abs().max().item() < TOLERANCE


async def test_colbert_token_embeddings_and_maxsim_scores_equal_the_reference(tmp_path) -> None:
    """Token embeddings (normalized by default; ``normalize=False`` the raw projected rows) within 1e-5 for texts of
    different lengths sharing steps; ``score`` 1:N and N:N and ``/rerank``'s order and scores are the reference's
    MaxSim; ``/pooling``'s default task is token_embed; everything else refused by name."""
    path = _make_colbert(tmp_path / "colbert")
    texts = [QUERY, *DOCS]
    refs = {text: _reference(path, text) for text in texts}
    async with AsyncEngine(path, disable_log_stats=True, max_worker_restarts=0) as engine:
        assert (engine.config.enable_chunked_prefill, engine.config.runner) == (False, "pooling")
        assert await engine.get_supported_tasks() == ("token_embed",)
        outs = await asyncio.gather(*(engine.encode(text, pooling_task="token_embed") for text in texts))
        raw = await engine.encode(DOCS[1], PoolingParams(normalize=False), pooling_task="token_embed")
        scores = await engine.score(QUERY, DOCS)
        paired = await engine.score([QUERY, DOCS[0]], [DOCS[2], DOCS[3]])
        refusals = [("model", lambda: engine.embed(QUERY)), ("model", lambda: engine.classify(QUERY)),
                    ("prompt", lambda: engine.generate(QUERY, SamplingParams(max_tokens=2))),
                    ("model", lambda: engine.encode(QUERY, pooling_task="token_classify"))]
        for field, call in refusals:
            with pytest.raises(InvalidRequestError, match="HF_ColBERT, a late-interaction model.*token_embed only.*"
                                                          "score") as info:
                await call()
            assert info.value.field == field
        async with asgi_client(create_app(engine, manage_engine=False)) as client:
            reranked = (await client.post("/rerank", json={"query": QUERY, "documents": DOCS})).json()
            scored = (await client.post("/score", json={"text_1": QUERY, "text_2": DOCS[0]})).json()
            pooled = (await client.post("/pooling", json={"input": DOCS[0]})).json()
            refused = [await client.post("/v1/embeddings", json={"input": QUERY}),
                       await client.post("/pooling", json={"input": QUERY, "task": "embed"})]
    for text, out in zip(texts, outs):
        assert len(out.data) == len(out.prompt_token_ids) and _close(out.data, refs[text]), text
    assert _close(raw.data, _reference(path, DOCS[1], normalize=False))
    expected = [_maxsim(refs[QUERY], refs[doc]) for doc in DOCS]
    assert max(abs(out.score - want) for out, want in zip(scores, expected)) < TOLERANCE, (scores, expected)
    assert len(set(round(value, 3) for value in expected)) == len(DOCS)  # an order to check
    assert abs(paired[0].score - _maxsim(refs[QUERY], refs[DOCS[2]])) < TOLERANCE
    assert abs(paired[1].score - _maxsim(refs[DOCS[0]], refs[DOCS[3]])) < TOLERANCE
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert [result["index"] for result in reranked["results"]] == order, reranked
    assert all(abs(r["relevance_score"] - expected[r["index"]]) < TOLERANCE for r in reranked["results"])
    assert abs(scored["data"][0]["score"] - expected[0]) < TOLERANCE
    assert _close(pooled["data"][0]["data"], refs[DOCS[0]])
    assert [response.status_code for response in refused] == [400, 400], [r.text for r in refused]


def test_colbert_checkpoints_load_either_projection_name_and_need_a_dimension(tmp_path) -> None:
    """``colbert_linear.weight`` loads as ``linear.weight`` (the loader, no engine); a config without colbert_dim,
    dim or projection_dim is a ConfigError naming them and hf_overrides, on the host before anything is spawned."""
    from safetensors.torch import load_file

    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_hf_config, load_model

    path = _make_colbert(tmp_path / "other-name", projection="colbert_linear.weight")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert torch.equal(model.linear.weight, load_file(str(Path(path) / "model.safetensors"))["colbert_linear.weight"])
    from asyncllm.engine.prepare import prepare

    assert prepare(EngineConfig.create(path)).hidden_size == 16  # the rows' width: `dimensions` is checked by it
    bare = _make_colbert(tmp_path / "no-dim", dim=None)
    with pytest.raises(ConfigError, match="colbert_dim, dim or projection_dim.*hf_overrides") as info:
        prepare(EngineConfig.create(bare))  # what an engine's start runs first, on the host
    assert info.value.field == "model"
    assert prepare(EngineConfig.create(bare, hf_overrides={"dim": 16})).hidden_size == 16
    dense = _make_colbert(tmp_path / "with-dense")  # a sentence-transformers Dense after the 16-wide rows, made for
    (Path(dense) / "1_Dense").mkdir()  # the 32-wide hidden states: refused at start (the worker failed, before)
    (Path(dense) / "1_Dense" / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 8}))
    (Path(dense) / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type":
        "sentence_transformers.models.Transformer"}, {"idx": 1, "name": "1", "path": "1_Dense", "type":
        "sentence_transformers.models.Dense"}]))
    with pytest.raises(ConfigError, match="chain from the model's 16-wide rows; 1_Dense takes 32 features"):
        prepare(EngineConfig.create(dense))
