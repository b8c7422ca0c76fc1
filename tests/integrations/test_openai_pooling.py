"""vLLM's ``POST /pooling`` over an embedding model (the bundled one): each item's ``data`` is what /v1/embeddings
answers for the same body (every input shape, chat ``messages``, ``dimensions`` and ``normalize``), base64 as its
float32 bytes, vLLM's response shape and ids; ``token_embed``'s row per prompt token;
tasks the model does not serve, tasks not built and parameters a task
does not take are 400s naming the field. (A classification model's /pooling: tests/engine/test_classification.py.)"""

from __future__ import annotations

import base64
import json
import struct

import pytest

from asgi_helpers import asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 12]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]


async def _post(app, path: str, body: dict, status: int = 200, headers: dict | None = None) -> dict:
    async with asgi_client(app) as client:
        response = await client.post(path, json=body, headers=headers)
    assert response.status_code == status, response.text
    return response.json()


@pytest.mark.parametrize("body", [
    {"input": "def add(a, b):"},
    {"input": ["import os\n", "class A:"], "task": "embed"},
    {"input": TOKENS, "dimensions": 16, "normalize": False},
    {"input": [TOKENS, TOKENS[:4]], "truncate_prompt_tokens": 3},
    {"messages": MESSAGES, "add_generation_prompt": True},
])
async def test_pooling_is_the_embeddings_of_the_same_body(app, body: dict) -> None:
    pooled = await _post(app, "/pooling", body, headers={"X-Request-Id": "p1"})
    embedded = await _post(app, "/v1/embeddings", {k: v for k, v in body.items() if k != "task"})
    assert {k: pooled[k] for k in ("id", "object", "model")} == {"id": "pool-p1", "object": "list",
                                                                "model": embedded["model"]}
    assert [{k: v for k, v in item.items() if k != "data"} for item in pooled["data"]] == [
        {"index": i, "object": "pooling"} for i in range(len(embedded["data"]))]
    for item, want in zip(pooled["data"], embedded["data"]):
        assert item["data"] == pytest.approx(want["embedding"], abs=1e-6)
    tokens = embedded["usage"]["prompt_tokens"]
    assert pooled["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                               "prompt_tokens_details": None}


async def test_chat_messages_cut_keep_their_first_tokens(app) -> None:
    """``truncate_prompt_tokens`` keeps a rendered chat's first k tokens (vLLM's ``_preprocess_chat``), not the last k
    of token ids."""
    ids = (await _post(app, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}))["tokens"]
    cut = (await _post(app, "/pooling", {"messages": MESSAGES, "truncate_prompt_tokens": 4}))["data"][0]["data"]
    first = (await _post(app, "/pooling", {"input": ids[:4]}))["data"][0]["data"]
    assert len(ids) > 4 and cut == pytest.approx(first, abs=1e-6)


async def test_base64_is_the_float32_bytes_and_request_id_names_the_response(app) -> None:
    floats = (await _post(app, "/pooling", {"input": TOKENS}))["data"][0]["data"]
    encoded = await _post(app, "/pooling", {"input": TOKENS, "encoding_format": "base64", "request_id": "r7"})
    assert encoded["id"] == "pool-r7"
    raw = base64.b64decode(encoded["data"][0]["data"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-7)
    assert len(floats) == 192  # the bundled model's hidden size


async def test_token_embed_is_one_embedding_per_prompt_token(app) -> None:
    """``task: "token_embed"`` (vLLM's ALL pooling): ``data`` holds a list per prompt token, normalized by default (the
    last one is ``embed``'s vector), cut and left raw as asked; base64 and ``bytes`` carry the rows one after the
    other (the ``bytes`` metadata's ``shape`` [tokens, dimensions], as vLLM's)."""
    rows = (await _post(app, "/pooling", {"input": TOKENS, "task": "token_embed"}))["data"][0]["data"]
    pooled = (await _post(app, "/pooling", {"input": TOKENS}))["data"][0]["data"]
    raw = (await _post(app, "/pooling", {"input": [TOKENS, TOKENS[:3]], "task": "token_embed", "dimensions": 16,
                                         "normalize": False}))["data"]
    assert len(rows) == len(TOKENS) and all(len(row) == 192 for row in rows)
    assert all(abs(sum(x * x for x in row) - 1.0) < 1e-5 for row in rows)
    assert rows[-1] == pytest.approx(pooled, abs=1e-6)
    assert [len(item["data"]) for item in raw] == [len(TOKENS), 3] and len(raw[0]["data"][0]) == 16
    assert all(abs(sum(x * x for x in row) - 1.0) > 1e-3 for row in raw[0]["data"])  # not normalized
    assert sum(raw[1]["data"], []) == pytest.approx(sum(raw[0]["data"][:3], []), abs=1e-5)  # causal: a prefix's rows
    encoded = (await _post(app, "/pooling", {"input": TOKENS, "task": "token_embed", "encoding_format": "base64"}))
    raw_bytes = base64.b64decode(encoded["data"][0]["data"])
    assert list(struct.unpack(f"<{len(raw_bytes) // 4}f", raw_bytes)) == pytest.approx(sum(rows, []), abs=1e-7)
    async with asgi_client(app) as client:
        response = await client.post("/pooling", json={"input": TOKENS, "task": "token_embed",
                                                       "encoding_format": "bytes"})
    assert response.status_code == 200 and json.loads(response.headers["metadata"])["data"][0]["shape"] == [9, 192]


@pytest.mark.parametrize("body, param, message", [
    ({"input": "a", "task": "classify"}, "task", "Task classify is not supported, it must be one of ('embed', "
                                                 "'token_embed')."),
    ({"input": "a", "task": "token_classify"}, "task", "Task token_classify is not supported, it must be one of "
                                                       "('embed', 'token_embed')."),
    ({"input": "a", "task": "token_embed", "use_activation": True}, "use_activation", "Task token_embed only "
                                                                                      "supports ['dimensions', "
                                                                                      "'normalize'] parameters"),
    ({"input": "a", "task": "encode"}, "task", "Invalid enum value 'encode'"),
    ({"input": "a", "use_activation": False}, "use_activation", "Task embed only supports ['dimensions', "
                                                                "'normalize'] parameters"),
    ({"input": "a", "softmax": True}, "softmax", "does not support ['softmax']"),
    ({"input": "", "task": "embed"}, "input", "empty string"),
    ({"input": "a", "messages": MESSAGES}, "input", "one of them"),
    ({"input": "a", "embed_dtype": "float64"}, "embed_dtype", "Invalid enum value 'float64'"),
])
async def test_refusals_are_400s_naming_the_field(app, body: dict, param: str, message: str) -> None:
    error = (await _post(app, "/pooling", body, status=400))["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert message.lower() in error["message"].lower(), error["message"]
