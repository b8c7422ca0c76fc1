"""Issue 3 end to end on a real engine: prefix caching with cache_salt, timeouts wherever the request
is, admission control on the host and in the core, and KV-cache sizing errors at start."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, ConfigError, EngineOverloadedError, InvalidRequestError, SamplingParams
from asyncllm.beam_search import BeamSearchParams
from asyncllm.engine.admission import admission_group
from asyncllm.integrations.openai_server import create_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    engine = AsyncEngine(
        tiny_llama, disable_log_stats=True, max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=16,
        max_num_queued_requests=2, max_num_queued_tokens=100,
    )
    async with engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def step_s(engine: AsyncEngine) -> float:
    """Seconds per decode step on this machine now (timeouts below are multiples of it)."""
    await engine.generate([5, 6, 7], GREEDY)
    start = time.perf_counter()
    await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    return (time.perf_counter() - start) / 40


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [3 + (i * 7 + offset) % 500 for i in range(n)]


async def _wait_for(engine: AsyncEngine, predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(engine.stats()):
        assert time.monotonic() < deadline, f"engine state not reached: {engine.stats()}"
        await asyncio.sleep(0.01)


async def _wait_idle(engine: AsyncEngine) -> None:
    await _wait_for(engine, lambda s: s.num_requests_running == s.num_requests_waiting == s.num_used_blocks == 0)


def _counts_nothing_of_its_own(engine: AsyncEngine) -> bool:
    """Idle, the host's estimate is the core's snapshot alone: each request it counted left the count, as a snapshot's
    `host_samples_queued` passed it or as it failed (asyncllm/engine/admission.py)."""
    replica = engine._replicas.replicas[0]
    return replica.admission.num_waiting(replica.observer.stats.scheduler) == 0


async def _start_long(engine: AsyncEngine):
    """A request that keeps the only seat (max_num_seqs=1) busy; returns its stream after the first token."""
    stream = engine.stream([9, 10, 11], LONG)
    await stream.__anext__()
    return stream


# ------------------------------------------------------------------ prefix caching and cache_salt
async def test_a_second_identical_600_token_prompt_hits_the_prefix_cache(engine: AsyncEngine) -> None:
    prompt = _prompt(600)

    async def run(salt: str | None) -> tuple[list[int], int]:
        before = engine.stats().prefix_cache_hits
        out = await engine.generate(prompt, GREEDY, cache_salt=salt)
        await _wait_idle(engine)
        return out.token_ids, engine.stats().prefix_cache_hits - before

    first, hits = await run(None)
    assert hits == 0
    second, hits = await run(None)
    assert hits == 592 >= 576 and second == first  # 37 full blocks; the last token is always recomputed
    salted, hits = await run("tenant-b")
    assert hits == 0 and salted == first  # another salt never shares blocks
    salted_again, hits = await run("tenant-b")
    assert hits == 592 and salted_again == first


async def test_a_prompt_dicts_cache_salt_is_the_requests_salt(engine: AsyncEngine) -> None:
    """vLLM's TextPrompt / TokensPrompt ``cache_salt``, for generate, stream and embed: the argument's salt."""
    ids, one = _prompt(32, offset=11), SamplingParams(temperature=0.0, max_tokens=1)  # 1 full block cached

    def salted(salt: str) -> dict:
        return {"prompt_token_ids": ids, "cache_salt": salt}

    first = await engine.generate(salted("dict-a"), one)
    other = await engine.generate(salted("dict-b"), one)
    stream = engine.stream(salted("dict-a"), one)
    again = [delta async for delta in stream]
    as_argument = await engine.generate(ids, one, cache_salt="dict-b")
    embedded = await engine.embed(salted("dict-b"))
    assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 0)  # two salts share nothing
    assert stream.collector.num_cached_tokens == as_argument.num_cached_tokens == embedded.num_cached_tokens == 16
    assert again[-1].token_ids == other.token_ids == first.token_ids
    with pytest.raises(InvalidRequestError) as info:
        await engine.generate(salted("dict-a"), one, cache_salt="dict-b")
    assert info.value.field == "prompt.cache_salt"


# ------------------------------------------------------------------ timeouts
async def test_a_request_times_out_while_waiting(engine: AsyncEngine, step_s: float) -> None:
    long = await _start_long(engine)
    out = await engine.generate([5, 6, 7], GREEDY, timeout=max(0.2, 20 * step_s))
    assert (out.finish_reason, out.token_ids) == ("timeout", [])
    assert out.metrics.queued_time is not None and out.metrics.first_scheduled_time is None  # never ran
    await long.aclose()
    await _wait_idle(engine)


async def test_a_request_times_out_while_prefilling(engine: AsyncEngine, step_s: float) -> None:
    """2000 prompt tokens at 16 per step: 125 prefill steps; the timeout comes after about 40 (`step_s` is measured
    once: one measured in a load spike is long, so a prefill that outran it is tried again with half, a new prompt)."""
    timeout = max(0.1, 40 * step_s)
    for attempt in range(4):
        stream = engine.stream(_prompt(2000, offset=1 + attempt), GREEDY, timeout=timeout)
        deltas = [delta async for delta in stream]
        if not any(d.token_ids for d in deltas):
            break
        timeout /= 2
        await _wait_idle(engine)
    assert [(d.finish_reason, d.token_ids) for d in deltas] == [("timeout", [])]
    assert stream.collector.metrics.first_scheduled_time is not None  # it was admitted, and sampled nothing
    await _wait_idle(engine)


async def test_a_request_times_out_while_decoding(engine: AsyncEngine, step_s: float) -> None:
    out = await engine.generate([5, 6, 7], LONG, timeout=max(0.5, 100 * step_s))
    assert out.finish_reason == "timeout" and 0 < len(out.token_ids) < LONG.max_tokens
    await _wait_idle(engine)


# ------------------------------------------------------------------ admission control
async def test_the_host_refuses_past_max_num_queued_requests_before_tokenizing(engine: AsyncEngine) -> None:
    long = await _start_long(engine)
    waiting = [asyncio.ensure_future(engine.generate([5, 6], GREEDY)) for _ in range(2)]
    await asyncio.sleep(0)  # both admitted: counted by the host until a snapshot counts them (whenever it was taken)
    # "about": the host's estimate refused it in _submit, before the processor thread saw it
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=2: about 2 requests"):
        await engine.generate("never tokenized", GREEDY)
    await long.aclose()
    assert [len(o.token_ids) for o in await asyncio.gather(*waiting)] == [8, 8]
    await _wait_idle(engine)


async def test_the_core_refuses_past_max_num_queued_tokens(engine: AsyncEngine) -> None:
    long = await _start_long(engine)
    queued = asyncio.ensure_future(engine.generate(_prompt(80), GREEDY))
    await _wait_for(engine, lambda s: s.num_requests_waiting == 1)
    # 62 characters: the host estimates 15 tokens (80 + 15 <= 100); the tokenizer makes 58 of them
    text = "zq xv kj wp zq xv kj wp zq xv kj wp zq xv kj wp zq xv kj wp zq"
    with pytest.raises(EngineOverloadedError, match="80 tokens are already waiting and this prompt has 58") as info:
        await engine.generate(text, GREEDY)
    assert "about" not in str(info.value)  # the core's wording, not the host's estimate
    await long.aclose()
    assert len((await queued).token_ids) == 8
    await _wait_idle(engine)
    assert _counts_nothing_of_its_own(engine)  # the refused one too


async def test_an_idle_engine_takes_n_samples_past_max_num_queued_requests(engine: AsyncEngine) -> None:
    """The host sends sample 0 of an n > 1 request as counting for all n (`AddRequest.num_samples`): an empty queue
    takes them all, where a check per sample refused the third as if two requests were already waiting."""
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, n=4)
    assert [len(o.token_ids) for o in (await engine.generate([5, 6, 7], params)).outputs] == [2, 2, 2, 2]
    await _wait_idle(engine)
    assert _counts_nothing_of_its_own(engine)  # its 4 samples, counted at once by the core as by the host


async def test_requests_the_host_refuses_leave_an_idle_engine_admitting(engine: AsyncEngine) -> None:
    """Refused on the processor thread, they never reached the core, so no snapshot follows them: each is un-counted
    from the host's estimate when it fails, not when the next snapshot comes (an idle core sends none)."""
    await _wait_idle(engine)
    for bad in ([5] * 3000, [10**6], [5] * 3000):  # past max_model_len (and max_num_queued_tokens), out of vocab
        with pytest.raises(InvalidRequestError):  # never EngineOverloadedError: the queue is empty
            await engine.generate(bad, GREEDY)
    assert len((await engine.generate([5, 6], GREEDY)).token_ids) == 8
    await _wait_idle(engine)


async def test_an_idle_engine_admits_a_group_past_max_num_queued_requests(engine: AsyncEngine) -> None:
    """An admission group (prompts made in one `admission_group` of their count, a generate_many batch, a beam search
    step's beams) on an idle engine is accepted whole by the host and the core, each of 4 requests past max_num_queued_requests=2,
    where a check per request refused the third as if two were waiting (issue: 429 forever on an idle server)."""
    await _wait_idle(engine)
    with admission_group(4):
        outs = await asyncio.gather(*(engine.generate(_prompt(3, i), GREEDY) for i in range(4)))
    assert [len(o.token_ids) for o in outs] == [8] * 4
    batch = await engine.generate_many([_prompt(3, i) for i in range(4)], GREEDY, max_concurrency=4)
    assert [len(o.outputs[0].token_ids) for o in batch] == [8] * 4
    beams = await engine.beam_search(_prompt(3), BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True))
    assert [len(b.tokens) for b in beams.sequences] == [5] * 4
    await _wait_idle(engine)


async def test_a_busy_engine_refuses_a_group_past_max_num_queued_requests(engine: AsyncEngine) -> None:
    long = await _start_long(engine)
    waiting = asyncio.ensure_future(engine.generate([5, 6], GREEDY))
    await _wait_for(engine, lambda s: s.num_requests_waiting == 1)
    with admission_group():  # 1 waiting + the group's 2 requests pass the limit: refused (its second one)
        first, second = [asyncio.ensure_future(engine.generate(_prompt(3, i), GREEDY)) for i in range(2)]
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=2: about 2 requests"):
        await second
    await long.aclose()
    assert len((await first).token_ids) == len((await waiting).token_ids) == 8
    await _wait_idle(engine)


async def test_a_group_on_a_busy_seat_passes_the_limit_by_its_size_only(engine: AsyncEngine) -> None:
    """A group that found the queue empty (the only seat busy) may pass max_num_queued_requests=2 by its size, 2:
    its fifth request is refused (however long the group lasts: a beam search, a long generate_many), and a request
    of no group is refused as ever once 2 wait."""
    long = await _start_long(engine)
    await _wait_for(engine, lambda s: s.num_requests_waiting == 0)
    with admission_group(2):
        tasks = [asyncio.ensure_future(engine.generate(_prompt(3, i), GREEDY)) for i in range(5)]
    with pytest.raises(EngineOverloadedError, match=r"=2 \(its admission group may pass it by 2\): about 4 requests"):
        await tasks[4]
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=2: about 4 requests"):
        await engine.generate([5, 6], GREEDY)
    await long.aclose()
    assert [len((await task).token_ids) for task in tasks[:4]] == [8] * 4
    await _wait_idle(engine)
    assert _counts_nothing_of_its_own(engine)


async def test_the_server_admits_a_requests_prompts_together(engine: AsyncEngine) -> None:
    """/v1/completions with 4 prompts on an idle server with max_num_queued_requests=2: one admission group."""
    await _wait_idle(engine)
    app = create_app(engine, model_name="tiny", manage_engine=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        reply = await client.post("/v1/completions", json={"model": "tiny", "prompt": [_prompt(3, i) for i in range(4)],
                                                           "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 4
    await _wait_idle(engine)


# ------------------------------------------------------------------ KV sizing
async def test_max_model_len_larger_than_the_kv_cache_fails_at_start(tiny_llama: str) -> None:
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, num_gpu_blocks_override=4, max_model_len=100)
    with pytest.raises(ConfigError) as info:
        await engine.start()
    await engine.aclose()
    assert info.value.field == "max_model_len"
    assert "at most 64 tokens fit in the KV cache (4 blocks of 16)" in str(info.value)
    assert "lower max_model_len" in str(info.value)


async def test_on_the_cpu_a_kv_cache_too_small_names_its_space_not_gpu_memory_utilization(
        tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU sizes its cache by ASYNCLLM_CPU_KVCACHE_SPACE_GB (the workers say so): the advice names it, not
    gpu_memory_utilization, which the CPU ignores."""
    monkeypatch.setenv("ASYNCLLM_CPU_KVCACHE_SPACE_GB", "0.0005")
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, device="cpu")
    with pytest.raises(ConfigError) as info:
        await engine.start()
    await engine.aclose()
    assert info.value.field == "max_model_len"
    assert str(info.value).endswith("or raise ASYNCLLM_CPU_KVCACHE_SPACE_GB / kv_cache_memory_bytes / "
                                    "num_gpu_blocks_override")


async def test_max_model_len_auto_fits_the_kv_cache(tiny_llama: str) -> None:
    """vLLM's max_model_len -1: the model's 2048 lowered to what the KV cache holds. 48 KiB (+100 bytes) hold 6
    blocks of 16 tokens (a block: 2 layers x K and V x 2 heads x 16 dims x 16 tokens x 4 bytes = 8 KiB), so 96."""
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=-1, kv_cache_memory_bytes=6 * 8192 + 100,
                         enable_chunked_prefill=False, max_num_seqs=2)
    async with engine:
        assert engine.config.max_model_len == 96  # the core's value, through its Ready
        assert engine.config.resolved_max_num_batched_tokens == 96  # no chunked prefill: a whole prompt a step
        with pytest.raises(InvalidRequestError, match="maximum context length is 96 tokens"):
            await engine.generate(_prompt(96), GREEDY)
        out = await engine.generate(_prompt(90), SamplingParams(temperature=0.0, ignore_eos=True))
        assert (len(out.token_ids), out.finish_reason) == (6, "length")  # runs to the fitted length
