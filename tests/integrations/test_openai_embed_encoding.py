"""vLLM's pooling request fields on /v1/embeddings, /pooling, /classify, /score and /rerank: ``embed_dtype`` and
``endianness`` of base64 results (torch's cast of the float32 values, bit for bit), ``encoding_format`` ``"bytes"``
(the vectors' bytes one after the other, vLLM's ``metadata`` header) and ``"bytes_only"`` (no header);
``add_special_tokens`` false with ``input`` (the text's tokens alone: no BOS on the bundled model, no [CLS] / [SEP]
on a BERT classifier); ``mm_processor_kwargs`` taken with ``messages`` (no media there: it changes nothing) and by
/score and /rerank, a 400 naming it with ``input``."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest
import pytest_asyncio
import torch

from asgi_helpers import asgi_client
from encoder_utils import make_tiny_encoder

from asyncllm import AsyncEngine
from asyncllm.integrations.openai_server import create_app

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
HIDDEN_SIZE = 192  # the bundled model's
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 12]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _vector(seed: int) -> list[float]:
    """A float32 vector of every range the dtypes treat apart: small and subnormal for fp8 and float16, past
    bfloat16's precision, past e4m3's largest finite value (448) and e5m2's (57344), past float16's range."""
    rng = np.random.default_rng(seed)
    scales = np.array([1e-6, 1e-3, 1.0, 300.0, 1e5])[rng.integers(0, 5, HIDDEN_SIZE)]
    values = (rng.standard_normal(HIDDEN_SIZE) * scales).astype(np.float32)
    values[:6] = [470.0, -465.0, 6e4, 2.0 ** -10, 1.5 * 2.0 ** -17, 1e-30]
    return values.tolist()


@pytest.fixture
def fixed_vectors(bundled_engine, monkeypatch) -> None:
    """The engine's embeddings replaced by `_vector` of the prompt's length, so that requests for the same inputs
    answer the same float32 values (a prefix-cache hit computes them in another order) and every range is met."""
    embed = bundled_engine.embed

    async def fixed(prompt, pooling_params=None, **options):
        out = await embed(prompt, pooling_params, **options)
        out.embedding = _vector(len(out.prompt_token_ids))
        return out

    monkeypatch.setattr(bundled_engine, "embed", fixed)


def _torch_bytes(floats: list[float], embed_dtype: str, endianness: str) -> bytes:
    """vLLM's ``tensor2binary``: the float32 tensor cast to the dtype, its bytes in the byte order asked for."""
    dtype = DTYPES[embed_dtype]
    raw = torch.tensor(floats, dtype=torch.float32).to(dtype).view({1: torch.uint8, 2: torch.int16,
                                                                    4: torch.int32}[dtype.itemsize]).numpy()
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    return raw.astype(raw.dtype.newbyteorder(order)).tobytes()


async def _post(app, path: str, body: dict, status: int = 200):
    async with asgi_client(app) as client:
        response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    return response


async def _json(app, path: str, body: dict, status: int = 200) -> dict:
    return (await _post(app, path, body, status)).json()


@pytest.mark.usefixtures("fixed_vectors")
@pytest.mark.parametrize("path, key", [("/v1/embeddings", "embedding"), ("/pooling", "data")])
async def test_base64_in_every_dtype_and_byte_order(app, path: str, key: str) -> None:
    """Vectors in each of vLLM's dtypes and byte orders are torch's cast of the float32 numbers ``"float"`` answers
    (`fixed_vectors`: every range); the float answer ignores both fields, as vLLM's."""
    body = {"model": MODEL, "input": [TOKENS, TOKENS[:4]]}
    floats = [item[key] for item in (await _json(app, path, body))["data"]]
    assert floats == [_vector(len(TOKENS)), _vector(4)]
    ignored = await _json(app, path, {**body, "embed_dtype": "fp8_e4m3", "endianness": "big"})
    assert [item[key] for item in ignored["data"]] == floats
    for embed_dtype in DTYPES:
        for endianness in ("native", "little", "big"):
            encoded = await _json(app, path, {**body, "encoding_format": "base64", "embed_dtype": embed_dtype,
                                              "endianness": endianness})
            got = [base64.b64decode(item[key]) for item in encoded["data"]]
            assert got == [_torch_bytes(vector, embed_dtype, endianness) for vector in floats], (embed_dtype,
                                                                                                 endianness)
            assert len(got[0]) == HIDDEN_SIZE * DTYPES[embed_dtype].itemsize


@pytest.mark.usefixtures("fixed_vectors")
@pytest.mark.parametrize("path, prefix, key", [("/v1/embeddings", "embd", "embedding"), ("/pooling", "pool", "data")])
async def test_bytes_body_and_vllms_metadata_header(app, path: str, prefix: str, key: str) -> None:
    """``"bytes"``: an octet stream of the vectors' bytes in input order and vLLM's ``metadata`` header (its
    ``json.dumps``: id, created, model, each vector's dtype, byte order, byte range and shape, and usage);
    ``"bytes_only"``: the same body without the header."""
    body = {"model": MODEL, "input": [TOKENS, TOKENS[:4], TOKENS[:2]], "embed_dtype": "bfloat16",
            "endianness": "big"}
    floats = await _json(app, path, body)
    want = b"".join(_torch_bytes(item[key], "bfloat16", "big") for item in floats["data"])
    before = int(time.time())
    framed = await _post(app, path, {**body, "encoding_format": "bytes", "request_id": "b1"})
    bare = await _post(app, path, {**body, "encoding_format": "bytes_only"})
    assert framed.content == bare.content == want
    assert framed.headers["content-type"] == bare.headers["content-type"] == "application/octet-stream"
    assert "metadata" not in bare.headers
    metadata = json.loads(framed.headers["metadata"])
    size = 2 * HIDDEN_SIZE
    assert metadata == {"id": f"{prefix}-b1", "created": metadata["created"], "model": MODEL,
                        "data": [{"index": i, "embed_dtype": "bfloat16", "endianness": "big", "start": i * size,
                                  "end": (i + 1) * size, "shape": [HIDDEN_SIZE]} for i in range(3)],
                        "usage": {"prompt_tokens": 9 + 4 + 2, "total_tokens": 9 + 4 + 2}}
    assert framed.headers["metadata"] == json.dumps(metadata)  # vLLM's separators and key order
    assert before <= metadata["created"] <= time.time()


@pytest.mark.parametrize("path, key", [("/v1/embeddings", "embedding"), ("/pooling", "data")])
async def test_add_special_tokens_false_with_input(app, bundled_tokenizer, path: str, key: str) -> None:
    """vLLM's completion-form pooling request: ``add_special_tokens`` false embeds a text's own tokens (no BOS), as
    those token ids embed; true or left out adds them; token ids are run as given either way."""
    text = "def add(a, b):"
    plain = bundled_tokenizer(text, add_special_tokens=False).input_ids
    special = bundled_tokenizer(text).input_ids
    assert special != plain
    left_out = await _json(app, path, {"input": [text, "x"], "add_special_tokens": False})
    added = await _json(app, path, {"input": text, "add_special_tokens": True})
    ids = await _json(app, path, {"input": TOKENS, "add_special_tokens": False})
    by_ids = await _json(app, path, {"input": [plain, special, TOKENS]})
    assert left_out["data"][0][key] == pytest.approx(by_ids["data"][0][key], abs=1e-6)
    assert added["data"][0][key] == pytest.approx(by_ids["data"][1][key], abs=1e-6)
    assert ids["data"][0][key] == pytest.approx(by_ids["data"][2][key], abs=1e-6)
    x = bundled_tokenizer("x", add_special_tokens=False).input_ids
    assert left_out["usage"]["prompt_tokens"] == len(plain) + len(x)
    cut = await _json(app, path, {"input": text, "add_special_tokens": False, "truncate_prompt_tokens": 3})
    assert cut["data"][0][key] == pytest.approx((await _json(app, path, {"input": plain[:3]}))["data"][0][key],
                                                abs=1e-6)


async def test_mm_processor_kwargs_with_messages_and_on_scores(app) -> None:
    """vLLM's chat pooling requests and score requests take ``mm_processor_kwargs``; no media reach these routes,
    so the answers are those without it. With ``input`` it is a 400 naming it (a chat field); a media part is still
    a 400 naming ``messages``."""
    kwargs = {"max_pixels": 1003520}
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        plain = await _json(app, path, {"messages": MESSAGES})
        given = await _json(app, path, {"messages": MESSAGES, "mm_processor_kwargs": kwargs})
        assert given["data"][0][key] == pytest.approx(plain["data"][0][key], abs=1e-6)
        error = (await _json(app, path, {"input": "x", "mm_processor_kwargs": kwargs}, status=400))["error"]
        assert error["param"] == "mm_processor_kwargs" and "messages only" in error["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    error = (await _json(app, "/v1/embeddings", {"messages": image, "mm_processor_kwargs": kwargs}, 400))["error"]
    assert error["param"] == "messages"
    scores = {"text_1": "def add(a, b):", "text_2": ["return a + b", "import os"]}
    rerank = {"query": "def add(a, b):", "documents": ["return a + b", "import os"]}
    for path, body, field in (("/score", scores, "data"), ("/rerank", rerank, "results")):
        plain = await _json(app, path, body)
        given = await _json(app, path, {**body, "mm_processor_kwargs": kwargs})
        assert [_score(item) for item in given[field]] == pytest.approx([_score(item) for item in plain[field]],
                                                                        abs=1e-6)  # a prefix-cache hit: not bitwise
        assert [_others(item) for item in given[field]] == [_others(item) for item in plain[field]]


def _score(item: dict) -> float:
    return item["score"] if "score" in item else item["relevance_score"]


def _others(item: dict) -> dict:
    return {key: value for key, value in item.items() if key not in ("score", "relevance_score")}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "x", "embed_dtype": "float64"}, "embed_dtype"),
    ("/v1/embeddings", {"input": "x", "endianness": "middle"}, "endianness"),
    ("/pooling", {"input": "x", "encoding_format": "bytes_all"}, "encoding_format"),
    ("/classify", {"input": "x", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
    ("/score", {"text_1": "a", "text_2": "b", "mm_processor_kwargs": 5}, "mm_processor_kwargs"),
])
async def test_bad_values_are_400s_naming_the_field(app, path: str, body: dict, param: str) -> None:
    error = (await _json(app, path, body, status=400))["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bert_classifier(tmp_path_factory):
    """A tiny ``BertForSequenceClassification`` (its tokenizer writes [CLS] ... [SEP]) and its app, which renders
    chats with `CHAT_TEMPLATE`."""
    path = make_tiny_encoder(tmp_path_factory.mktemp("bert-classifier"), "bert", num_labels=2, seed=5)
    async with AsyncEngine(path, disable_log_stats=True, max_worker_restarts=0) as engine:
        yield path, create_app(engine, manage_engine=False, chat_template=CHAT_TEMPLATE)


def _hf_logits(path: str, token_ids: list[int]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].tolist()


async def test_classify_add_special_tokens_and_mm_processor_kwargs(bert_classifier) -> None:
    """/classify and /pooling (task classify) with ``add_special_tokens`` false run the text without [CLS] and
    [SEP]: transformers' logits of those ids; left out, with them. A chat with ``mm_processor_kwargs`` classifies as
    without it."""
    from transformers import AutoTokenizer

    path, app = bert_classifier
    text = "what is paged attention?"
    tokenizer = AutoTokenizer.from_pretrained(path)
    plain, special = tokenizer(text, add_special_tokens=False).input_ids, tokenizer(text).input_ids
    assert special == [2, *plain, 3]
    bare = await _json(app, "/classify", {"input": text, "add_special_tokens": False, "use_activation": False})
    full = await _json(app, "/classify", {"input": text, "use_activation": False})
    pooled = await _json(app, "/pooling", {"input": text, "add_special_tokens": False, "use_activation": False})
    assert bare["data"][0]["probs"] == pytest.approx(_hf_logits(path, plain), abs=1e-5)
    assert full["data"][0]["probs"] == pytest.approx(_hf_logits(path, special), abs=1e-5)
    assert pooled["data"][0]["data"] == pytest.approx(bare["data"][0]["probs"], abs=1e-6)
    assert (bare["usage"]["prompt_tokens"], full["usage"]["prompt_tokens"]) == (len(plain), len(special))
    chat = [{"role": "user", "content": text}]
    without = await _json(app, "/classify", {"messages": chat})
    given = await _json(app, "/classify", {"messages": chat, "mm_processor_kwargs": {"max_pixels": 4}})
    assert given["data"] == without["data"]
