"""vLLM's `AsyncLLM` API on a real engine (the tiny Llama): `chat(sampling_params=...)`, `abort(request_id)`,
`get_tokenizer()`, an empty text prompt (its [BOS] generates, as vLLM's) and a list of prompts refused with the name of
the batch call. The SyncEngine's forms: tests/engine/test_sync_engine_vllm_api.py."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from asyncllm import AsyncEngine, InvalidRequestError, RequestAbortedError, RequestTimeoutError, SamplingParams
from engine_helpers import wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CHAT = [{"role": "user", "content": "hello"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    async with AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=1024) as engine:
        yield engine


async def test_chat_takes_vllms_sampling_params(engine: AsyncEngine) -> None:
    deltas = [d async for d in engine.chat(CHAT, sampling_params=SHORT)]
    assert sum(len(d.token_ids) for d in deltas) == 6 and deltas[-1].finish_reason == "length"
    with pytest.raises(InvalidRequestError) as info:
        engine.chat(CHAT, SHORT, sampling_params=SHORT)
    assert info.value.field == "sampling_params"


async def test_abort_ends_that_stream_and_others_run_on(engine: AsyncEngine) -> None:
    """vLLM's `abort(request_id)` from another task: that stream's last delta says "abort" and the core frees it; a
    concurrent request finishes whole; unknown and finished ids are no-ops."""
    aborted_before = engine.stats().request_success_total.get("abort", 0)
    other = asyncio.ensure_future(engine.generate("import os\n", SamplingParams(temperature=0.0, max_tokens=60,
                                                                                ignore_eos=True)))
    stream = engine.stream("def main():", LONG, request_id="victim")
    async with stream:
        first = await stream.__anext__()
        await asyncio.ensure_future(engine.abort("victim"))  # from another task
        rest = await asyncio.wait_for(_read(stream), 30)  # (the core's abort alone would leave it waiting)
    deltas = [first, *rest]
    assert deltas[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in deltas) < 400
    out = await other
    assert (len(out.token_ids), out.finish_reason) == (60, "length")
    await wait_idle(engine)
    assert engine.stats().request_success_total.get("abort", 0) == aborted_before + 1  # counted once, by the core
    await engine.abort("victim")  # finished now: a no-op
    await engine.abort(["no-such-request", "victim"])
    with pytest.raises(InvalidRequestError) as info:
        await engine.abort(["ok", 3])
    assert info.value.field == "request_id"


async def test_abort_of_a_generate_returns_its_output_so_far(engine: AsyncEngine) -> None:
    task = asyncio.ensure_future(engine.generate("x = 1\n", LONG, request_id="gen-victim"))
    await asyncio.wait_for(_submitted(engine, "gen-victim"), 30)
    await engine.abort(iter(["gen-victim"]))
    out = await asyncio.wait_for(task, 30)
    assert out.finish_reason == "abort" and len(out.token_ids) < 400


async def _submitted(engine: AsyncEngine, request_id: str) -> None:
    """Until the request's collector exists (a call that hands out no delta to wait on)."""
    while not any(c.request_id == request_id for c in engine._in_flight):
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("call", ["embed", "encode"])
async def test_abort_of_a_pooling_request_raises_request_aborted(engine: AsyncEngine, call: str) -> None:
    """A pooling request has no partial result: aborted, it raises `RequestAbortedError` (an AssertionError,
    before); the engine serves the next one."""
    prompt = "word " * 300
    run = engine.embed(prompt, request_id="pool-victim") if call == "embed" else \
        engine.encode(prompt, pooling_task="token_embed", request_id="pool-victim")
    task = asyncio.ensure_future(run)
    await asyncio.wait_for(_submitted(engine, "pool-victim"), 30)
    await engine.abort("pool-victim")
    with pytest.raises(RequestAbortedError, match="'pool-victim' was aborted"):
        await asyncio.wait_for(task, 30)
    assert len((await engine.embed("word " * 10)).embedding) == 64  # the tiny Llama's hidden size


async def test_pooling_deadlines_raise_request_timeout_and_a_drain_finishes_a_begun_score(tiny_llama: str) -> None:
    """A pooling request whose ``timeout`` passes before it is pooled raises `RequestTimeoutError` (it raised
    `RequestAbortedError`); ``aclose(drain=True)`` right after a ``score`` call began lets it finish (its texts'
    requests, submitted after its first await, were refused as new ones)."""
    async with AsyncEngine(tiny_llama, disable_log_stats=True, max_num_seqs=2, max_model_len=1024) as engine:
        prompts = [f"word {i} " * (40 + i) for i in range(40)]  # two at a time: the last ones wait past 20 ms
        outs = await asyncio.gather(*(engine.embed(p, timeout=0.02) for p in prompts), return_exceptions=True)
        failed = [out for out in outs if isinstance(out, BaseException)]
        assert failed and all(isinstance(out, RequestTimeoutError) for out in failed), failed[:3]
        assert len((await engine.embed("still here")).embedding) == 64
        task = asyncio.ensure_future(engine.score("a query", ["one text", "another text"]))
        await asyncio.sleep(0)  # the call has begun
        await engine.aclose(drain=True, timeout=30)
        assert len(await task) == 2


async def _read(stream) -> list:
    return [d async for d in stream]


async def test_get_tokenizer_starts_the_engine(tiny_llama: str) -> None:
    """Works on an engine just constructed, as vLLM's (whose engine is running once constructed)."""
    engine = AsyncEngine(tiny_llama, disable_log_stats=True)
    try:
        tokenizer = await engine.get_tokenizer()
        assert engine.started and tokenizer is engine.tokenizer
        assert tokenizer("def f():").input_ids == AutoTokenizer.from_pretrained(tiny_llama)("def f():").input_ids
    finally:
        await engine.aclose()


async def test_an_empty_text_prompt_generates_from_bos(engine: AsyncEngine) -> None:
    tokenizer = await engine.get_tokenizer()
    assert tokenizer("").input_ids == [tokenizer.bos_token_id]  # the tiny Llama's tokenizer adds BOS
    out = await engine.generate("", SHORT)
    assert out.prompt_token_ids == [tokenizer.bos_token_id] and len(out.token_ids) == 6
    with pytest.raises(InvalidRequestError, match="no tokens") as info:
        await engine.generate("", SHORT, add_special_tokens=False)  # no ids at all
    assert info.value.field == "prompt"


@pytest.mark.parametrize("prompts", [["def f():", "import os"], [{"prompt": "a"}], [[1, 2], [3, 4]], ("a", "b")])
async def test_a_list_of_prompts_names_the_batch_call(engine: AsyncEngine, prompts) -> None:
    with pytest.raises(InvalidRequestError, match="generate_many") as info:
        await engine.generate(prompts, SHORT)
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match=r"no batch embed call.*asyncio\.gather") as info:
        await engine.embed(prompts)
    assert info.value.field == "prompt" and "generate_many" not in str(info.value)


async def test_generate_many_refuses_a_bad_params_before_running_any_prompt(engine: AsyncEngine) -> None:
    """As vLLM's LLM.generate: a bad SamplingParams anywhere in the batch is refused before any prompt runs."""
    await wait_idle(engine)
    before = engine.stats().generation_tokens_total
    params = [SHORT] * 5 + [SamplingParams(max_tokens=4, temperature=-1.0)]
    with pytest.raises(InvalidRequestError) as info:
        await engine.generate_many([[1, 2 + i] for i in range(6)], params, max_concurrency=1)
    await asyncio.sleep(0.2)  # stats ride on outputs: any that ran would have counted by now
    assert info.value.field == "temperature" and engine.stats().generation_tokens_total == before
    with pytest.raises(InvalidRequestError, match="output_kind"):  # generate collects whole outputs, but a typo is
        await engine.generate([1, 2], SamplingParams(max_tokens=1, output_kind="bogus"))  # still refused


async def test_token_ids_stay_one_prompt(engine: AsyncEngine) -> None:
    out = await engine.generate([1, 5, 9], SHORT)
    assert out.prompt_token_ids == [1, 5, 9] and len(out.token_ids) == 6
