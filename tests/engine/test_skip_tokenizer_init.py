"""``skip_tokenizer_init=True`` (vLLM's): no tokenizer loaded; token ids in, token ids out, the rest refused by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, BeamSearchParams, InvalidRequestError, SamplingParams, StructuredOutputs
from asgi_helpers import asgi_client
from hf_reference import hf_greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [1, 45, 499, 173, 170, 299, 43, 172]


@pytest.fixture(scope="module")
def no_tokenizer_model(tiny_llama: str, tmp_path_factory) -> str:
    """The tiny checkpoint without its tokenizer files (loading one would fail), config.json's EOS changed."""
    path = str(tmp_path_factory.mktemp("no_tokenizer"))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_llama, name), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "eos_token_id": 7}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, 9]}, f)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(no_tokenizer_model: str):
    async with AsyncEngine(no_tokenizer_model, skip_tokenizer_init=True, disable_log_stats=True,
                           max_model_len=256) as engine:
        yield engine


async def test_token_ids_in_and_out_equal_transformers(engine: AsyncEngine, no_tokenizer_model: str) -> None:
    assert engine.tokenizer is None and engine.eos_token_ids == [7, 1, 9]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = await engine.generate(PROMPT, params)
    assert out.token_ids == hf_greedy(no_tokenizer_model, PROMPT, 12)
    assert out.text == "" and out.prompt_token_ids == PROMPT
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    deltas = [d async for d in engine.stream({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=5,
                                                                                          ignore_eos=True))]
    assert [t for d in deltas for t in d.token_ids] == out.token_ids[:5] and all(d.text == "" for d in deltas)


@pytest.mark.parametrize("call, field", [
    (lambda e: e.generate("text", SamplingParams(max_tokens=2)), "prompt"),
    (lambda e: e.generate({"prompt": "text"}, SamplingParams(max_tokens=2)), "prompt"),
    (lambda e: e.generate(PROMPT, SamplingParams(max_tokens=2, stop=["x"])), "stop"),
    (lambda e: e.generate(PROMPT, SamplingParams(max_tokens=2, bad_words=["x"])), "bad_words"),
    (lambda e: e.generate(PROMPT, SamplingParams(max_tokens=2, structured=StructuredOutputs(regex="a+"))),
     "structured"),
    (lambda e: e.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2)).__anext__(), "messages"),
    (lambda e: e.beam_search("text", BeamSearchParams(beam_width=2, max_tokens=2)), "prompt"),
], ids=["text", "text-prompt-dict", "stop", "bad_words", "structured", "chat", "beam_search"])
async def test_what_needs_a_tokenizer_is_refused_by_name(engine: AsyncEngine, call, field: str) -> None:
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init") as raised:
        await call(engine)
    assert raised.value.field == field
    out = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3


async def test_beam_search_on_ids_and_the_server(engine: AsyncEngine) -> None:
    beams = await engine.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(beams.sequences) == 2 and all(b.text == "" for b in beams.sequences)
    from asyncllm.integrations.openai_server import create_app

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = (await engine.generate(PROMPT, greedy)).token_ids
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        done = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0,
                                                          "ignore_eos": True, "logprobs": 1, "echo": True})
        text = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        tokenize = await client.post("/tokenize", json={"prompt": "hi"})
    choice = done.json()["choices"][0]
    assert choice["text"] == "" and choice["logprobs"]["tokens"][-4:] == [f"token_id:{t}" for t in expected]
    assert (text.status_code, text.json()["error"]["param"]) == (400, "prompt")
    assert (tokenize.status_code, tokenize.json()["error"]["param"]) == (400, "tokenizer")


async def test_images_and_tokens_looked_up_by_name_need_the_tokenizer(tmp_path, tiny_llama: str) -> None:
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import ConfigError
    from mm_utils import make_tiny_llava

    llava = make_tiny_llava(tmp_path / "llava")
    with pytest.raises(ConfigError, match="skip_tokenizer_init"):
        prepare(EngineConfig.create(llava, skip_tokenizer_init=True))
    reranker = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["a", "b"]}
    with pytest.raises(ConfigError, match="classifier_from_token"):
        prepare(EngineConfig.create(tiny_llama, skip_tokenizer_init=True, hf_overrides=reranker))
