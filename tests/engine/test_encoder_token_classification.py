"""Token classification on encoders (docs/pooling.md, "Token classifiers"):
``BertForTokenClassification`` and ``ModernBertForTokenClassification`` (NER-style taggers) serve ``token_classify``
only, one row of label probabilities per prompt token (vLLM's ``LLM.encode(..., pooling_task="token_classify")`` and
``/pooling``); the encoder sequence classifiers serve it too, with vLLM's per-row heads. References: tiny random
transformers models saved with ``save_pretrained``. Encoders take each prompt whole in one step (no chunked prefill:
asyncllm/engine/prepare.py), so the long prompt here fills ``max_model_len`` in one step beside shorter ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from asgi_helpers import asgi_client
from encoder_utils import _tokenizer, make_tiny_encoder

from asyncllm import AsyncEngine, InvalidRequestError, PoolingParams, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.integrations.openai_server import create_app

TEXTS = ["what is paged attention?", "the engine", "a query of a document: 42 tokens, then more words!"]
LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}


def _make_token_classifier(folder: Path, kind: str) -> str:
    """A random ``BertForTokenClassification`` or ``ModernBertForTokenClassification`` with five NER labels."""
    from transformers import BertConfig, BertForTokenClassification, ModernBertConfig, ModernBertForTokenClassification

    tokenizer = _tokenizer(token_types=kind == "bert")
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=66, id2label=LABELS,
                 label2id={v: k for k, v in LABELS.items()}, pad_token_id=0)
    if kind == "bert":
        model = BertForTokenClassification(BertConfig(**shape))
    else:  # 8-token local windows in 2 of 3 layers: the long prompts reach past them
        model = ModernBertForTokenClassification(ModernBertConfig(
            **{**shape, "num_hidden_layers": 3}, local_attention=8, bos_token_id=2, eos_token_id=3, cls_token_id=2,
            sep_token_id=3))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = "LayerNorm" in name or "norm" in name
            # logits of a few units: float32's rounding of them stays under the 1e-5 the rows are checked to
            param.normal_(1.0 if norm and name.endswith("weight") else 0.0, 0.1 if norm or "classifier" in name else 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _hf_token_logits(folder: str, text: str) -> torch.Tensor:
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")).logits[0]


def _close(rows: list[list[float]], expected: torch.Tensor) -> bool:
    return tuple(expected.shape) == (len(rows), len(rows[0])) and (torch.tensor(rows) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("kind, tp", [("bert", 1), ("modernbert", 2)])
async def test_token_classifiers_equal_transformers(tmp_path, kind: str, tp: int) -> None:
    """Every token's probabilities (softmax over the labels, vLLM's token_classify activation) and, with
    ``use_activation=False``, transformers' logits, within 1e-5, for prompts sharing a step and one filling
    ``max_model_len``; /pooling's default task; everything else refused by name. ModernBERT over two
    tensor-parallel ranks (the encoder split, the head whole on each)."""
    path = _make_token_classifier(tmp_path / kind, kind)
    async with AsyncEngine(path, tensor_parallel_size=tp, disable_log_stats=True, max_worker_restarts=0) as engine:
        assert (engine.config.enable_chunked_prefill, engine.config.runner) == (False, "pooling")
        assert await engine.get_supported_tasks() == ("token_classify",)
        long = " ".join(["engine"] * (engine.config.max_model_len - 2))  # with [CLS] and [SEP]: max_model_len
        prompts = TEXTS + [long]
        probs = await asyncio.gather(*(engine.encode(p, pooling_task="token_classify") for p in prompts))
        raw = await asyncio.gather(*(engine.encode(p, PoolingParams(use_activation=False),
                                                   pooling_task="token_classify") for p in prompts))
        assert len(probs[-1].prompt_token_ids) == engine.config.max_model_len
        for prompt, activated, logits in zip(prompts, probs, raw):
            expected = _hf_token_logits(path, prompt)
            assert _close(logits.data, expected) and _close(activated.data, expected.softmax(-1)), prompt
            assert len(activated.data) == len(activated.prompt_token_ids) and activated.outputs.data == activated.data
        arch = {"bert": "BertForTokenClassification", "modernbert": "ModernBertForTokenClassification"}[kind]
        refusals = [("prompt", lambda: engine.generate(TEXTS[0], SamplingParams(max_tokens=2))),
                    ("model", lambda: engine.embed(TEXTS[0])), ("model", lambda: engine.classify(TEXTS[0])),
                    ("model", lambda: engine.score(TEXTS[0], TEXTS[1])),
                    ("model", lambda: engine.encode(TEXTS[0], pooling_task="token_embed"))]
        for field, call in refusals:
            with pytest.raises(InvalidRequestError, match=f"{arch}, a token classifier.*token_classify only") as info:
                await call()
            assert info.value.field == field
        with pytest.raises(InvalidRequestError) as info:  # vLLM's token_classify takes use_activation only
            await engine.encode(TEXTS[0], PoolingParams(dimensions=4), pooling_task="token_classify")
        assert info.value.field == "dimensions"
        async with asgi_client(create_app(engine, manage_engine=False)) as client:
            pooled = (await client.post("/pooling", json={"input": TEXTS[2]})).json()
            plain = (await client.post("/pooling", json={"input": TEXTS[2], "use_activation": False})).json()
            wrong = await client.post("/pooling", json={"input": TEXTS[2], "task": "embed"})
            others = [await client.post(route, json=body) for route, body in (
                ("/classify", {"input": TEXTS[2]}), ("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]}),
                ("/v1/embeddings", {"input": TEXTS[2]}), ("/v1/completions", {"prompt": TEXTS[2], "max_tokens": 1}))]
    expected = _hf_token_logits(path, TEXTS[2])
    assert _close(pooled["data"][0]["data"], expected.softmax(-1)) and _close(plain["data"][0]["data"], expected)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "task"
    assert "token_classify" in wrong.json()["error"]["message"]
    assert [other.status_code for other in others] == [400] * 4, [other.text for other in others]


def _vllm_seq_cls_token_rows(folder: str, text: str) -> torch.Tensor:
    """vLLM's token_classify on a sequence classifier (``DispatchPooler.for_seq_cls``): its ``classifier`` on every
    row's final hidden state: BERT's and ModernBERT's linear alone, RoBERTa's / XLM-R's whole head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model.base_model(**inputs).last_hidden_state[0]
        head = model.classifier
        if hasattr(head, "out_proj"):
            return head.out_proj(torch.tanh(head.dense(hidden)))
        return head(hidden)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "modernbert", "gte"])
async def test_sequence_classifiers_serve_token_classify_as_vllm(tmp_path, kind: str) -> None:
    """An encoder ``*ForSequenceClassification`` serves token_classify beside classify and score, each row through
    vLLM's per-row head (not the CLS pooler's), softmaxed over its three labels."""
    path = make_tiny_encoder(tmp_path / kind, kind, num_labels=3)
    async with AsyncEngine(path, disable_log_stats=True, max_worker_restarts=0) as engine:
        assert await engine.get_supported_tasks() == ("classify", "score", "token_classify")
        outs = await asyncio.gather(*(engine.encode(t, pooling_task="token_classify") for t in TEXTS),
                                    engine.encode(TEXTS[2], PoolingParams(use_activation=False),
                                                  pooling_task="token_classify"))
    for text, out in zip(TEXTS, outs):
        assert _close(out.data, _vllm_seq_cls_token_rows(path, text).softmax(-1)), text
    assert _close(outs[-1].data, _vllm_seq_cls_token_rows(path, TEXTS[2]))


def test_the_core_serves_a_token_classifier_token_classify_only() -> None:
    """The core's own check (beside the host's): a token classifier's one task, as the workers serve it."""
    from asyncllm.engine.validation import served_tasks
    from asyncllm.models.architectures import architecture_of
    from asyncllm.models.registry import get_model_class

    assert served_tasks(["BertForTokenClassification"]) == frozenset({"token_classify"})
    assert served_tasks(["ModernBertForSequenceClassification"]) == frozenset({"classify"})  # token_classify with it
    from transformers import BertConfig

    config = BertConfig(architectures=["BertForTokenClassification"])
    assert architecture_of(config) == "BertForTokenClassification"
    assert get_model_class(config).__name__ == "BertForTokenClassification"


def test_token_classifier_checkpoint_names(tmp_path) -> None:
    """Older transformers saved ``BertForTokenClassification`` with BERT's ``pooler`` (transformers ignores it):
    such a checkpoint loads; a tensor the model has no place for is refused by name (the loader, no engine)."""
    from safetensors.torch import load_file, save_file

    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_hf_config, load_model

    path = _make_token_classifier(tmp_path / "bert", "bert")
    [file] = Path(path).glob("*.safetensors")
    weights = load_file(file)
    assert {"classifier.weight", "classifier.bias"} <= set(weights) and not any("pooler" in k for k in weights)

    def load() -> object:
        return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)

    save_file({**weights, "bert.pooler.dense.weight": torch.zeros(32, 32), "bert.pooler.dense.bias": torch.zeros(32)},
              file, metadata={"format": "pt"})
    assert torch.equal(load().classifier.weight, weights["classifier.weight"])
    save_file({**weights, "bert.extra.weight": torch.zeros(2)}, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="unexpected weights: bert.extra.weight") as info:
        load()
    assert info.value.field == "model"
