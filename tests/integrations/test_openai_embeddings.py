"""``POST /v1/embeddings``: the embeddings equal transformers' (the last prompt token's final hidden state, normalized)
for every input shape, base64, ``dimensions``, ``normalize``, chat ``messages``; errors, limits, a client that leaves;
and the official `openai` client on a real socket."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import struct
import time

import httpx
import openai
import pytest

from asyncllm.integrations.openai_protocol import ServerLimits
from asyncllm.integrations.openai_server import create_app

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
HIDDEN_SIZE = 192  # the bundled model's
TOLERANCE = 1e-5
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 12]


@functools.lru_cache(maxsize=1)
def _hf_base():
    import torch
    from transformers import AutoModel

    from asyncllm.bundled import bundled_model_path

    return AutoModel.from_pretrained(bundled_model_path(), dtype=torch.float32).eval()


def _reference(token_ids: list[int], normalize: bool = True, dimensions: int | None = None) -> list[float]:
    """transformers' last hidden state of the prompt's last token, truncated to `dimensions`, then normalized."""
    import torch

    with torch.no_grad():
        hidden = _hf_base()(torch.tensor([token_ids])).last_hidden_state[0, -1, :dimensions]
    return (torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden).tolist()


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < TOLERANCE


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def _embed(app, **body) -> dict:
    async with _client(app) as client:
        response = await client.post("/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _usage(tokens: int) -> dict:
    """vLLM's ``UsageInfo`` of an embeddings response (its ``completion_tokens`` and ``prompt_tokens_details`` too)."""
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


async def test_string_and_token_ids_equal_transformers(app, bundled_tokenizer) -> None:
    text = "def add(a, b):"
    ids = bundled_tokenizer(text).input_ids
    from_text = await _embed(app, input=text)
    from_ids = await _embed(app, input=TOKENS, user="someone")
    assert from_text["object"] == "list" and from_text["model"] == MODEL
    assert [{k: v for k, v in item.items() if k != "embedding"} for item in from_text["data"]] == [
        {"object": "embedding", "index": 0}]
    assert _close(from_text["data"][0]["embedding"], _reference(ids))
    assert from_text["usage"] == _usage(len(ids))
    assert _close(from_ids["data"][0]["embedding"], _reference(TOKENS))
    assert from_ids["usage"] == _usage(len(TOKENS))


async def test_base64_is_the_float32_bytes(app) -> None:
    floats = (await _embed(app, input=TOKENS))["data"][0]["embedding"]
    encoded = (await _embed(app, input=TOKENS, encoding_format="base64"))["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert len(raw) == 4 * HIDDEN_SIZE
    assert list(struct.unpack(f"<{HIDDEN_SIZE}f", raw)) == pytest.approx(floats, abs=1e-7)


async def test_dimensions_and_normalize(app, monkeypatch) -> None:
    from asyncllm.engine.pooling_model import Matryoshka

    checked = []
    monkeypatch.setattr(Matryoshka, "check", lambda self, dimensions: checked.append(dimensions))
    short = (await _embed(app, input=TOKENS, dimensions=16))["data"][0]["embedding"]
    assert checked == [16]  # once, by the engine: the server names the served model in its refusal (no check of its own)
    raw = (await _embed(app, input=TOKENS, normalize=False))["data"][0]["embedding"]
    short_raw = (await _embed(app, input=TOKENS, dimensions=16, normalize=False))["data"][0]["embedding"]
    assert _close(short, _reference(TOKENS, dimensions=16))  # truncated, then normalized
    assert abs(sum(x * x for x in short) - 1.0) < 1e-5
    assert _close(raw, _reference(TOKENS, normalize=False))
    assert abs(sum(x * x for x in raw) - 1.0) > 1e-2  # really not normalized
    assert _close(short_raw, raw[:16])


async def test_batch_inputs_in_order_with_usage_summed(app, bundled_tokenizer) -> None:
    texts = ["import os\n", "class A:", "x = 1"]
    id_lists = [TOKENS, TOKENS[:4], [300, 301]]
    by_text = await _embed(app, input=texts)
    by_ids = await _embed(app, input=id_lists)
    text_ids = [bundled_tokenizer(t).input_ids for t in texts]
    for body, prompts in ((by_text, text_ids), (by_ids, id_lists)):
        assert [item["index"] for item in body["data"]] == [0, 1, 2]
        assert all(_close(item["embedding"], _reference(p)) for item, p in zip(body["data"], prompts))
        total = sum(len(p) for p in prompts)
        assert body["usage"] == _usage(total)


async def test_truncate_prompt_tokens(app) -> None:
    body = await _embed(app, input=TOKENS, truncate_prompt_tokens=4)
    assert _close(body["data"][0]["embedding"], _reference(TOKENS[-4:]))
    assert body["usage"]["prompt_tokens"] == 4


async def test_chat_messages_rendered_with_the_template(app, bundled_tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    body = await _embed(app, messages=messages)
    prompted = await _embed(app, messages=messages[:1], add_generation_prompt=True)
    ids = bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=False)
    ids_prompted = bundled_tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
    assert len(body["data"]) == 1 and _close(body["data"][0]["embedding"], _reference(list(ids)))
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert _close(prompted["data"][0]["embedding"], _reference(list(ids_prompted)))


async def test_chat_add_special_tokens_and_request_id(app, bundled_tokenizer) -> None:
    """vLLM's chat request: ``add_special_tokens`` true adds the tokenizer's special tokens on top of the template's
    (false or left out: none); a pooling request's ``request_id`` names the response (the header's over it)."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = bundled_tokenizer.apply_chat_template(messages, tokenize=False)
    special = bundled_tokenizer(text, add_special_tokens=True).input_ids
    plain = bundled_tokenizer(text, add_special_tokens=False).input_ids
    added = await _embed(app, messages=messages, add_special_tokens=True, request_id="r1")
    left = await _embed(app, messages=messages, add_special_tokens=False)
    async with _client(app) as client:
        headed = (await client.post("/v1/embeddings", json={"input": TOKENS, "request_id": "body"},
                                    headers={"X-Request-Id": "head"})).json()
    assert special != plain  # the bundled tokenizer adds BOS
    assert added["usage"]["prompt_tokens"] == len(special) and _close(added["data"][0]["embedding"], _reference(special))
    assert left["usage"]["prompt_tokens"] == len(plain) and _close(left["data"][0]["embedding"], _reference(plain))
    assert (added["id"], headed["id"]) == ("embd-r1", "embd-head")


async def test_chat_messages_cut_keep_their_first_tokens(app, bundled_tokenizer) -> None:
    """vLLM's ``_preprocess_chat``: the rendered chat is tokenized with ``truncation=True, max_length=k`` (on the
    right), as a text input is cut; token ids given as input keep their last k instead."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    ids = list(bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                     return_dict=False))
    body = await _embed(app, messages=messages, truncate_prompt_tokens=4)
    assert _close(body["data"][0]["embedding"], _reference(ids[:4])) and body["usage"]["prompt_tokens"] == 4


async def test_invocations_with_input_are_embeddings(app) -> None:
    async with _client(app) as client:
        via_sagemaker = await client.post("/invocations", json={"input": TOKENS})
    assert via_sagemaker.status_code == 200
    assert _close(via_sagemaker.json()["data"][0]["embedding"], _reference(TOKENS))


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": ["a", ""]}, 400, "input"),
    ({"input": ["a", [1, 2]]}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "input"),
    ({"input": "x", "dimensions": HIDDEN_SIZE + 1}, 400, "dimensions"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, 400, "chat_template"),
    ({"input": "x", "embed_dtype": "float64"}, 400, "embed_dtype"),
    ({"input": "x", "mm_processor_kwargs": {}}, 400, "mm_processor_kwargs"),  # for messages only
    ({"input": "x", "request_id": "r" * 1025}, 400, "request_id"),
    ({"input": [[5, 6], [999999]]}, 400, "input"),  # the engine's "prompt" named as the request's field
    ({"input": "x", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ({"input": "x", "model": "gpt-4"}, 404, "model"),
])
async def test_errors(app, body: dict, status: int, param: str) -> None:
    async with _client(app) as client:
        response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


async def test_at_most_max_prompts_inputs(bundled_engine) -> None:
    app = create_app(bundled_engine, manage_engine=False, limits=ServerLimits(max_prompts=2))
    async with _client(app) as client:
        too_many = await client.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
        two = await client.post("/v1/embeddings", json={"input": ["a", "b"]})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "input"
    assert "at most 2" in too_many.json()["error"]["message"]
    assert two.status_code == 200 and len(two.json()["data"]) == 2


async def test_client_disconnect_aborts_the_inputs(app, bundled_engine) -> None:
    """The client hangs up once the engine runs the inputs: the handler aborts them all."""
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(64)] for i in range(24)]  # more than max_num_seqs at once
    body = json.dumps({"input": prompts}).encode()
    aborted_before = bundled_engine.stats().request_success_total.get("abort", 0)
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        while not bundled_engine.stats().num_requests_running:
            await asyncio.sleep(0.001)
        return {"type": "http.disconnect"}

    messages = []

    async def send(message: dict) -> None:
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    await app(scope, receive, send)
    assert messages[0]["status"] == 499
    # the core applies the aborts between steps: a step of inputs admitted before they came runs to its end first,
    # seconds on a loaded machine (the stats show those inputs running meanwhile, never waiting)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = bundled_engine.stats()
        if stats.num_requests_running == 0 and stats.num_requests_waiting == 0:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"the engine still runs requests: {bundled_engine.stats()}")
    assert bundled_engine.stats().request_success_total.get("abort", 0) > aborted_before


async def test_official_client(base_url, bundled_tokenizer) -> None:
    """`client.embeddings.create` asks for base64 unless told otherwise and decodes it; both agree."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    texts = ["def f(x):", "return x"]
    default = await client.embeddings.create(model=MODEL, input=texts)
    floats = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float", dimensions=32)
    ids = [bundled_tokenizer(t).input_ids for t in texts]
    assert [item.index for item in default.data] == [0, 1] and default.model == MODEL
    assert all(_close(item.embedding, _reference(p)) for item, p in zip(default.data, ids))
    assert all(_close(item.embedding, _reference(p, dimensions=32)) for item, p in zip(floats.data, ids))
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(map(len, ids))
    with pytest.raises(openai.BadRequestError) as bad:
        await client.embeddings.create(model=MODEL, input="x", dimensions=HIDDEN_SIZE + 1)
    assert bad.value.status_code == 400 and "dimensions" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="text-embedding-3-small", input="x")
