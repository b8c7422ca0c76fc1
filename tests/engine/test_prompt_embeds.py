"""Prompts given as embeddings (``enable_prompt_embeds``, vLLM's ``{"prompt_embeds": tensor}``): greedy output equals
transformers' ``generate(inputs_embeds=...)``, chunked and batched with token prompts; a token prompt's embeddings
give its tokens; equal embeddings share prefix-cache blocks, other ones none; what reads the prompt's token ids, a
wrong width or dtype, and the engines without the option refuse them by name; the OpenAI server takes vLLM's
base64 ``prompt_embeds`` (``torch.load(weights_only=True)``: a pickle that would run code is refused)."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import pytest_asyncio
import torch

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.engine.prompt_embeds import embeds_salt, prompt_embeds_of
from asyncllm.errors import NotBuiltError
from hf_reference import hf_embeds_greedy, hf_greedy, hf_input_embeddings

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _random_embeds(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)) * 0.5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    async with AsyncEngine(tiny_llama, enable_prompt_embeds=True, max_num_batched_tokens=32, max_model_len=256,
                           disable_log_stats=True) as engine:
        yield engine


async def test_embeds_prompts_equal_transformers_chunked_and_beside_token_prompts(engine: AsyncEngine,
                                                                                 tiny_llama: str) -> None:
    ids = list(range(5, 75))
    embeds = [_random_embeds(70, seed=1), hf_input_embeddings(tiny_llama, ids), _random_embeds(9, seed=2)]
    prompts = [{"prompt_embeds": embeds[0]}, {"prompt_embeds": embeds[1].to(torch.bfloat16)}, ids,
               {"prompt_embeds": embeds[2][None]}]  # [1, tokens, hidden]: transformers' inputs_embeds, squeezed
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    assert outs[0].token_ids == hf_embeds_greedy(tiny_llama, embeds[0], MAX_TOKENS)
    assert outs[2].token_ids == hf_greedy(tiny_llama, ids, MAX_TOKENS, eos_token_id=None)
    assert outs[1].token_ids == hf_embeds_greedy(tiny_llama, embeds[1].to(torch.bfloat16), MAX_TOKENS)
    assert outs[3].token_ids == hf_embeds_greedy(tiny_llama, embeds[2], MAX_TOKENS)
    assert outs[0].prompt_token_ids == [0] * 70 and outs[0].token_ids != outs[3].token_ids
    assert outs[3].prompt_token_ids == [0] * 9
    exact = await engine.generate({"prompt_embeds": embeds[1]}, GREEDY)  # float32: a token prompt's own rows
    assert exact.token_ids == outs[2].token_ids
    cut = await engine.generate({"prompt_embeds": embeds[0]}, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, truncate_prompt_tokens=20))
    assert cut.token_ids == hf_embeds_greedy(tiny_llama, embeds[0][-20:], MAX_TOKENS)


async def test_equal_embeddings_share_cached_blocks_and_other_ones_none(engine: AsyncEngine,
                                                                        tiny_llama: str) -> None:
    embeds = _random_embeds(48, seed=3)
    first = await engine.generate({"prompt_embeds": embeds}, GREEDY)
    again = await engine.generate({"prompt_embeds": embeds.clone()}, GREEDY)
    changed = embeds.clone()
    changed[-1] += 1.0  # the same first blocks' rows: the whole prompt's digest differs
    other = await engine.generate({"prompt_embeds": changed}, GREEDY)
    tokens = await engine.generate([0] * 48, GREEDY)  # the placeholders as a token prompt: no embeddings' blocks
    packed = prompt_embeds_of({"prompt_embeds": embeds}, 64, GREEDY, 256)
    forged = await engine.generate([0] * 48, GREEDY, cache_salt=embeds_salt(None, packed))  # the salt they send
    assert again.num_cached_tokens >= 32 and again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0 and other.token_ids == hf_embeds_greedy(tiny_llama, changed, MAX_TOKENS)
    assert tokens.num_cached_tokens == forged.num_cached_tokens == 0
    salted = await engine.generate({"prompt_embeds": embeds}, GREEDY, cache_salt="")
    assert salted.num_cached_tokens == 0  # no salt and "" are two salts, as for token prompts
    in_dict = await engine.generate({"prompt_embeds": embeds, "cache_salt": "e"}, GREEDY)  # vLLM's EmbedsPrompt key
    as_argument = await engine.generate({"prompt_embeds": embeds}, GREEDY, cache_salt="e")
    assert in_dict.num_cached_tokens == 0 and as_argument.num_cached_tokens >= 32  # the argument's salt


@pytest.mark.parametrize("prompt, params, field", [
    ({"prompt_embeds": torch.zeros(4, 32)}, SamplingParams(), "prompt.prompt_embeds"),
    ({"prompt_embeds": torch.zeros(4, 64, dtype=torch.float64)}, SamplingParams(), "prompt.prompt_embeds"),
    ({"prompt_embeds": torch.full((4, 64), float("nan"))}, SamplingParams(), "prompt.prompt_embeds"),
    ({"prompt_embeds": torch.zeros(256, 64)}, SamplingParams(), "prompt.prompt_embeds"),
    ({"prompt_embeds": torch.zeros(4, 64), "prompt": "x"}, SamplingParams(), "prompt"),
    ({"prompt_embeds": [[0.0] * 64]}, SamplingParams(), "prompt.prompt_embeds"),
    ({"prompt_embeds": torch.zeros(4, 64).to_sparse()}, SamplingParams(), "prompt.prompt_embeds"),
    ({"prompt_embeds": torch.empty(4, 64, device="meta")}, SamplingParams(), "prompt.prompt_embeds"),
    ({"prompt_embeds": torch.zeros(4, 64)}, SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
    ({"prompt_embeds": torch.zeros(4, 64)}, SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
], ids=["width", "dtype", "nan", "too-long", "extra-key", "not-a-tensor", "sparse", "meta", "repetition-penalty",
        "prompt-logprobs"])
async def test_what_does_not_fit_is_refused_by_name(engine: AsyncEngine, prompt, params, field: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        await engine.generate(prompt, params)
    assert raised.value.field == field
    assert len((await engine.generate([5, 6, 7], GREEDY)).token_ids) == MAX_TOKENS


async def test_rows_past_the_context_are_refused_as_any_prompt_past_it() -> None:
    """In vLLM's words with code context_length_exceeded (clients detect overflow by it), the field naming the
    embeddings; a pooling request's rows may fill max_model_len (it generates nothing), truncated ones too."""
    from asyncllm.engine.prompt_embeds import prompt_embeds_of

    def rows_of(rows: int, operation: str | None = None, params: SamplingParams = SamplingParams()) -> int:
        return prompt_embeds_of({"prompt_embeds": torch.zeros(rows, 64)}, 64, params, 8, operation).shape[0]

    keep_all = SamplingParams(truncate_prompt_tokens=-1)
    assert (rows_of(8, "embedding generation"), rows_of(10, "score", keep_all), rows_of(10, None, keep_all)) == (8, 8, 7)
    for rows, operation, words in ((8, None, "your request has 8 input tokens"),
                                   (9, "embedding generation", "you requested 9 tokens in the input for embedding")):
        with pytest.raises(InvalidRequestError, match=f"maximum context length is 8 tokens. However, {words}") as info:
            rows_of(rows, operation)
        assert (info.value.field, info.value.code) == ("prompt.prompt_embeds", "context_length_exceeded")
    with pytest.raises(InvalidRequestError, match="no rows") as info:
        rows_of(0)
    assert info.value.code is None


async def test_a_batch_of_one_is_squeezed_and_other_tensors_are_refused_saying_why() -> None:
    rows = torch.arange(3 * 64, dtype=torch.float32).reshape(3, 64)
    squeezed = prompt_embeds_of({"prompt_embeds": rows[None]}, 64, SamplingParams(), 8)
    assert squeezed == prompt_embeds_of({"prompt_embeds": rows}, 64, SamplingParams(), 8)
    for tensor, words in ((torch.zeros(2, 3, 64), r"\[1, tokens, 64\], got Tensor of shape \(2, 3, 64\) \(one"),
                          (rows.to_sparse(), "got a sparse_coo one"),
                          (torch.empty(3, 64, device="meta"), "meta tensor"),
                          (torch.nested.nested_tensor([rows, rows[:2]]), "got a nested one"),
                          (torch.nested.nested_tensor([rows], layout=torch.jagged), "got a nested one")):
        with pytest.raises(InvalidRequestError, match=words) as info:
            prompt_embeds_of({"prompt_embeds": tensor}, 64, SamplingParams(), 8)
        assert info.value.field == "prompt.prompt_embeds"


async def test_engines_without_the_option_or_with_what_it_is_not_built_with_refuse(tiny_llama: str) -> None:
    from asyncllm.engine.prepare import prepare
    from asyncllm.engine.prompt_embeds import prompt_embeds_of

    with pytest.raises(InvalidRequestError, match="enable_prompt_embeds=True"):
        prompt_embeds_of({"prompt_embeds": torch.zeros(4, 64)}, prepare(EngineConfig.create(tiny_llama)).embeds_width,
                         SamplingParams(), 64)
    draft = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2}
    with pytest.raises(NotBuiltError, match="prompts given as embeddings"):
        prepare(EngineConfig.create(tiny_llama, enable_prompt_embeds=True, speculative_config=draft))
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert prepare(EngineConfig.create(tiny_llama, enable_prompt_embeds=True, speculative_config=ngram)).embeds_width == 64


def _b64(value) -> str:
    """vLLM's wire form: a ``torch.save`` of the value, base64."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


async def test_the_openai_server_takes_vllms_base64_prompt_embeds(engine: AsyncEngine) -> None:
    import pickle

    from asgi_helpers import asgi_client
    from asyncllm.integrations.openai_server import create_app

    embeds = _random_embeds(20, seed=7)
    expected = await engine.generate({"prompt_embeds": embeds}, GREEDY)
    body = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}

    class Evil:  # a pickle that would run code: weights_only refuses it
        def __reduce__(self):
            return (print, ("ran",))

    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        ok = await client.post("/v1/completions", json={**body, "prompt_embeds": [_b64(embeds), _b64(embeds[None])]})
        refused = [await client.post("/v1/completions", json={**body, **extra}) for extra in (
            {"prompt_embeds": _b64(embeds), "prompt": "x"}, {"prompt_embeds": "not base64!"},
            {"prompt_embeds": _b64({"a": 1})}, {"prompt_embeds": base64.b64encode(pickle.dumps(Evil(), protocol=2)).decode()},
            {"prompt_embeds": _b64(embeds), "echo": True}, {"prompt_embeds": _b64(torch.zeros(3, 8))},
            {"prompt_embeds": _b64(torch.zeros(2, 3, 64))}, {})]
    choices = ok.json()["choices"]
    assert ok.status_code == 200 and [c["text"] for c in choices] == [expected.text] * 2
    assert ok.json()["usage"]["prompt_tokens"] == 40
    assert [(r.status_code, r.json()["error"]["param"]) for r in refused] == [
        (400, "prompt"), (400, "prompt_embeds"), (400, "prompt_embeds"), (400, "prompt_embeds"), (400, "echo"),
        (400, "prompt.prompt_embeds"), (400, "prompt.prompt_embeds"), (400, "prompt")]

