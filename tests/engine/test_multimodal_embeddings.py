"""Embeddings of multimodal inputs (vLLM's ``LLM.embed`` with ``multi_modal_data``, its pooling routes' chat
``messages`` with ``image_url`` parts) on a tiny LLaVA and Qwen2-VL, against transformers' final hidden states."""

from __future__ import annotations

import base64
import io
import logging

import numpy as np
import pytest
import pytest_asyncio
from asgi_helpers import asgi_client
from mm_utils import make_image, make_tiny_llava
from qwen_vl_utils import IMAGE_PLACEHOLDER, hf_qwen_vl_inputs, make_tiny_qwen_vl

from asyncllm import AsyncEngine, PoolingParams
from asyncllm.integrations.openai_request_log import RequestLogger
from asyncllm.integrations.openai_server import create_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

BUDGET = 6
"""max_num_batched_tokens: fewer than an image's 16 placeholders, so every image is split across steps."""
RAW = PoolingParams(normalize=False)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llava: str):
    async with AsyncEngine(tiny_llava, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True, dtype="float32") as engine:
        yield engine


def hf_hidden(path: str, images: list[bytes], text: str | None = None, messages: list | None = None):
    """transformers' (prompt ids, final hidden states) of LLaVA for a text with ``<image>`` markers or chat
    messages (rendered by its processor, as the engine renders a chat)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    if messages is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    pil = [Image.open(io.BytesIO(image)) for image in images]
    inputs = processor(text=text, images=pil, return_tensors="pt", add_special_tokens=messages is None)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state[0]
    return inputs["input_ids"][0].tolist(), hidden.numpy().astype(np.float64)


def unit(vector) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float64)
    return vector / np.linalg.norm(vector)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_chat(url: str, text: str = "what is ") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


HF_CHAT = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image"}]}]


async def test_embed_with_multi_modal_data_is_transformers_last_hidden_state(engine, tiny_llava):
    """vLLM's prompt dict: the last token's final hidden state, the image split across prefill chunks; the same
    prompt again (its blocks cached) and a text prompt alongside give the same vectors."""
    image = make_image(40, 30, seed=1)
    text = "Describe <image> please"
    ids, hidden = hf_hidden(tiny_llava, [image], text)
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    raw, normalized, plain = [await engine.embed(prompt, RAW), await engine.embed(prompt),
                              await engine.embed("Describe please")]
    assert raw.prompt_token_ids == ids and ids.count(512) > BUDGET
    np.testing.assert_allclose(raw.embedding, hidden[-1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(normalized.embedding, unit(hidden[-1]), rtol=0, atol=1e-6)
    again = await engine.embed(prompt, RAW)
    assert again.num_cached_tokens > 0
    np.testing.assert_allclose(again.embedding, hidden[-1], rtol=0, atol=1e-5)
    assert not np.allclose(plain.embedding, normalized.embedding, atol=1e-3)  # the image counts


async def test_mean_pooling_of_a_qwen2_vl_image_prompt_is_transformers_mean(tmp_path):
    """``pooler_config`` MEAN on Qwen2-VL (M-RoPE positions, native-resolution images): every row of the prompt,
    the image's placeholders included, split across prefill chunks, as transformers' mean."""
    import torch
    from transformers import AutoModelForImageTextToText

    path = make_tiny_qwen_vl(tmp_path / "qwen2_vl", version="2")
    image, text = make_image(120, 90, seed=2), f"Describe {IMAGE_PLACEHOLDER} please"
    inputs = hf_qwen_vl_inputs(path, text, [image])
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state[0].numpy().astype(np.float64)
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=8, max_num_seqs=2,
                           dtype="float32", pooler_config={"pooling_type": "MEAN"}) as engine:
        out = await engine.embed({"prompt": text, "multi_modal_data": {"image": image}}, RAW)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist() and len(out.prompt_token_ids) > 8
    np.testing.assert_allclose(out.embedding, hidden.mean(0), rtol=0, atol=1e-5)


async def test_v1_embeddings_and_pooling_of_chat_messages_with_an_image_url(engine, tiny_llava, caplog):
    """vLLM's chat embedding request with an ``image_url`` part (a data: URL): rendered with the image by the
    engine, as a chat completion's, and pooled; /pooling gives the same vector, usage counts the placeholders; the
    request log shows the part's type, not its data."""
    caplog.set_level(logging.DEBUG, logger="asyncllm.integrations.openai.requests")
    image = make_image(50, 40, seed=5)
    ids, hidden = hf_hidden(tiny_llava, [image], messages=HF_CHAT)
    body = {"messages": image_chat(data_url(image)), "normalize": False}
    app = create_app(engine, manage_engine=False, request_logger=RequestLogger())
    async with asgi_client(app) as client:
        embedded = await client.post("/v1/embeddings", json=body)
        pooled = await client.post("/pooling", json={**body, "task": "embed"})
        normalized = await client.post("/v1/embeddings", json={"messages": body["messages"]})
        per_token = await client.post("/pooling", json={**body, "task": "token_embed"})  # not built with media
    assert embedded.status_code == pooled.status_code == normalized.status_code == 200, embedded.text
    np.testing.assert_allclose(embedded.json()["data"][0]["embedding"], hidden[-1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(pooled.json()["data"][0]["data"], hidden[-1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(normalized.json()["data"][0]["embedding"], unit(hidden[-1]), rtol=0, atol=1e-6)
    assert embedded.json()["usage"]["prompt_tokens"] == len(ids)
    assert per_token.status_code == 400 and per_token.json()["error"]["param"] == "messages", per_token.text
    assert "'token_embed' with media parts in messages is not built" in per_token.json()["error"]["message"]
    logged = [r.getMessage() for r in caplog.records if "prompt:" in r.getMessage()]
    assert len(logged) == 4  # the refused token_embed request is logged too
    assert all('{"type": "image_url"}' in line and "base64" not in line for line in logged)


@pytest.mark.parametrize("change, param, words", [
    ({"url": "data:image/png;base64,AA=="}, "messages[0].content[1]", ""),
    ({"url": "file:///etc/hostname"}, "messages[0].content[1]", "allowed-local-media-path"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens", "images"),
    ({"add_special_tokens": True}, "add_special_tokens", "images"),
])
async def test_media_errors_on_the_pooling_routes_are_400s_naming_the_field(engine, change, param, words):
    url = change.get("url", data_url(make_image(20, 20, seed=3)))
    body = {"messages": image_chat(url), **{k: v for k, v in change.items() if k != "url"}}
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        for path in ("/v1/embeddings", "/pooling"):
            response = await client.post(path, json=body)
            error = response.json()["error"]
            assert response.status_code == 400 and (error["type"], error["param"]) == ("invalid_request_error",
                                                                                       param), error
            assert words in error["message"]
        refused = await client.post("/classify", json=body)  # LLaVA has no classification head: that, or the url
    assert refused.status_code == 400 and refused.json()["error"]["param"] in ("model", param), refused.text


async def test_classify_of_an_image_chat_on_a_model_without_a_head_is_a_400(engine):
    body = {"messages": image_chat(data_url(make_image(20, 20, seed=4)))}
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        response = await client.post("/classify", json=body)
    assert response.status_code == 400 and "classification head" in response.json()["error"]["message"]
