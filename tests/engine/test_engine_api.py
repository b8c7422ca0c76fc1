"""The public API on a real engine (core + worker processes) with a tiny model."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from asyncllm import AsyncEngine, EngineDeadError, EventLoopError, InvalidRequestError, SamplingParams
from asyncllm.engine.processor import Processor
from hf_reference import hf_greedy
from engine_helpers import wait_idle as _wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=1024)
    async with engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: str):
    return AutoTokenizer.from_pretrained(tiny_llama)


async def _take(stream, n: int) -> list:
    deltas = []
    async for delta in stream:
        deltas.append(delta)
        if len(deltas) == n:
            break
    return deltas


async def test_stream_text_equals_decode(engine: AsyncEngine, tokenizer) -> None:
    prompt = "def main():\n    print('héllo wörld ✓ 日本語 🙂')\n"
    deltas = [d async for d in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=40))]
    token_ids = [t for d in deltas for t in d.token_ids]
    assert deltas[-1].finish_reason in ("stop", "length")
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)
    expected = hf_greedy(engine.config.model, tokenizer(prompt).input_ids, 40)
    assert token_ids == expected[: len(token_ids)]


async def test_generate_output_fields(engine: AsyncEngine, tokenizer) -> None:
    out = await engine.generate("import os\n", SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.prompt_token_ids == tokenizer("import os\n").input_ids
    assert out.metrics.time_to_first_token is not None and out.metrics.e2e_latency >= out.metrics.time_to_first_token
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


async def test_break_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    deltas = await _take(engine.stream("class A:\n", LONG), 3)
    assert len(deltas) == 3 and engine.stats().num_used_blocks > 0
    del deltas
    await _wait_idle(engine)


async def test_an_id_used_again_right_after_its_abort_gets_none_of_the_old_tokens(engine: AsyncEngine) -> None:
    """The aborted request's outputs still on their way from the core belong to it alone (they joined the new
    request of the same id, before)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = (await engine.generate([5, 6, 7], greedy)).token_ids
    for _ in range(3):
        async with engine.stream("class A:\n", LONG, request_id="again") as stream:
            async for _ in stream:
                break
        out = await engine.generate([5, 6, 7], greedy, request_id="again")
        assert out.request_id == "again" and out.token_ids == expected


async def test_a_duplicate_id_left_before_its_refusal_leaves_the_original_running(engine: AsyncEngine) -> None:
    """A second request of an id in flight is refused on the processor thread; left before that refusal reached it
    (``asyncio.wait_for`` around its ``generate``, a client gone), its abort named the id only, and so aborted the
    original request in the core: the original's stream then waited forever for its next delta."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    original = engine.stream([1, 2, 3], params, request_id="dup")
    first = await original.__anext__()
    duplicate = engine.stream([4, 5, 6], params, request_id="dup")
    reader = asyncio.create_task(duplicate.__anext__())
    await asyncio.sleep(0)  # submitted (the engine is started: no await before the processor has it), not refused yet
    assert duplicate.collector is not None and not duplicate.collector.finished
    await duplicate.aclose()
    assert (await reader).finish_reason == "abort"
    rest = await asyncio.wait_for(_read(original), 10)
    assert rest[-1].finish_reason == "length" and len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 30
    await _wait_idle(engine)


async def test_a_second_concurrent_reader_is_refused_and_the_request_runs_once(engine: AsyncEngine) -> None:
    """Two tasks reading one stream at once (a prefetching ``anext`` beside an ``async for``): the second is refused
    with RuntimeError, as an async generator's, and the request is submitted once; closing it frees everything."""
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for started in (False, True):
        stream = engine.stream([1, 2, 3], params)
        if started:
            await stream.__anext__()
        results = await asyncio.gather(stream.__anext__(), stream.__anext__(), return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == ["RuntimeError", "StreamDelta"]
        await asyncio.sleep(0.1)
        assert engine.stats().num_requests_running == 1
        await stream.aclose()
        await _wait_idle(engine)


async def test_task_cancel_aborts(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.stream("for i in range(10):\n", LONG):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_idle(engine)


async def test_timeout_and_aclose_abort(engine: AsyncEngine) -> None:
    stream = engine.stream("while True:\n", LONG)
    await stream.__anext__()
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.05):
            async for _ in stream:
                pass
    await _wait_idle(engine)
    other = engine.stream("if x:\n", LONG)
    await other.__anext__()
    await other.aclose()
    await _wait_idle(engine)


async def _read(stream, deltas: list | None = None) -> list:
    deltas = [] if deltas is None else deltas
    async for delta in stream:
        deltas.append(delta)
    return deltas


@pytest.mark.parametrize(("n", "close"), [(1, "aclose"), (2, "aclose"), (1, "async with"), (2, "async with")])
async def test_a_stream_closed_in_another_task_ends_its_reader_with_abort_deltas(engine: AsyncEngine, n: int,
                                                                                close: str) -> None:
    """`aclose()` (or an ``async with`` exit) while another task reads: the reader's loop ends as `engine.aclose()`
    ends a stream, each unfinished sample's last delta with finish_reason "abort" (it waited forever, before)."""
    stream = engine.stream("class A:\n", SamplingParams(n=n, temperature=1.0, max_tokens=500, ignore_eos=True))
    deltas: list = []
    reader = asyncio.create_task(_read(stream, deltas))
    async with asyncio.timeout(30):
        while len({d.index for d in deltas}) < n:  # the reader waits for more, mid-generation
            await asyncio.sleep(0.005)
    if close == "aclose":
        await stream.aclose()
    else:
        async with stream:
            pass
    await asyncio.wait_for(reader, 5)
    for index in range(n):
        reasons = [d.finish_reason for d in deltas if d.index == index]
        assert reasons[-1] == "abort" and reasons[:-1] == [None] * (len(reasons) - 1)
    await _wait_idle(engine)


async def test_a_stream_closed_while_its_first_step_submits_aborts_the_request(engine: AsyncEngine,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`aclose()` from another task while the reader's first `__anext__` still submits (the engine starting, or
    waiting for a core restart): the request is aborted once submitted and the reader gets each sample's abort delta
    (it generated to its end unread, before), with logprobs asked a cumulative_logprob of 0.0, as `_fail_all`'s."""
    pick, entered, release = engine._replicas.pick, asyncio.Event(), asyncio.Event()

    async def slow_pick(*args):
        entered.set()
        await release.wait()
        return await pick(*args)

    monkeypatch.setattr(engine._replicas, "pick", slow_pick)
    stream = engine.stream("while True:\n", SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True, n=2,
                                                           logprobs=0))
    reader = asyncio.create_task(_read(stream))
    await asyncio.wait_for(entered.wait(), 10)
    await stream.aclose()
    release.set()
    deltas = await asyncio.wait_for(reader, 5)
    assert sorted((d.index, d.token_ids, d.finish_reason, d.cumulative_logprob) for d in deltas) == [
        (0, [], "abort", 0.0), (1, [], "abort", 0.0)]
    await _wait_idle(engine)


async def test_seeded_sampling_reproducible_in_any_batch(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = (await engine.generate("def f(x):", params)).token_ids
    noise = [engine.generate(f"x = {i}", SamplingParams(temperature=1.0, max_tokens=20)) for i in range(6)]
    busy = await asyncio.gather(engine.generate("def f(x):", params), *noise)
    assert busy[0].token_ids == alone
    other_seed = await engine.generate("def f(x):", SamplingParams(temperature=0.9, seed=99, max_tokens=20, ignore_eos=True))
    assert other_seed.token_ids != alone


async def test_stop_string_excluded_and_aborted(engine: AsyncEngine, tokenizer) -> None:
    full = await engine.generate("import sys\n", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = await engine.generate("import sys\n", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    await _wait_idle(engine)


async def test_stop_token_ids(engine: AsyncEngine) -> None:
    full = await engine.generate("x = [", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    target = full.token_ids[4]
    out = await engine.generate("x = [", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[target]))
    first = full.token_ids.index(target)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == target


async def test_chat_applies_template(engine: AsyncEngine, tokenizer) -> None:
    messages = [{"role": "user", "content": "hello"}]
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected_prompt, "keys"):  # transformers 5 returns a BatchEncoding
        expected_prompt = expected_prompt["input_ids"]
    deltas = [d async for d in engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))]
    token_ids = [t for d in deltas for t in d.token_ids]
    assert token_ids == hf_greedy(engine.config.model, list(expected_prompt), 5)


async def test_chat_template_kwargs_reach_the_template(engine: AsyncEngine, tokenizer) -> None:
    messages = [{"role": "user", "content": "hello"}]
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    if hasattr(expected_prompt, "keys"):  # transformers 5 returns a BatchEncoding
        expected_prompt = expected_prompt["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    stream = engine.chat(messages, params, chat_template_kwargs={"add_generation_prompt": False})
    token_ids = [t for d in [d async for d in stream] for t in d.token_ids]
    assert token_ids == hf_greedy(engine.config.model, list(expected_prompt), 5)
    for bad in ({"tokenize": False}, ["add_generation_prompt"], {1: True}):
        with pytest.raises(InvalidRequestError) as info:
            [d async for d in engine.chat(messages, params, chat_template_kwargs=bad)]
        assert info.value.field == "chat_template_kwargs"


async def test_vllm_prompt_dicts_are_their_plain_prompts(engine: AsyncEngine, tokenizer) -> None:
    """vLLM's TextPrompt / TokensPrompt dicts on a text model (a None media entry or uuid, empty mm_processor_kwargs:
    no media); a dict with media still says it takes none, naming the media it holds."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = tokenizer("def f(x):")["input_ids"]
    outs = await asyncio.gather(engine.generate("def f(x):", params), engine.generate({"prompt": "def f(x):"}, params),
                                engine.generate({"prompt_token_ids": ids}, params),
                                engine.generate({"prompt": "def f(x):", "multi_modal_data": {"image": None}}, params),
                                engine.generate({"prompt": "def f(x):", "mm_processor_kwargs": {}}, params),
                                engine.generate({"prompt": "def f(x):", "multi_modal_uuids": {"image": None},
                                                 "cache_salt": "t"}, params))  # every TextPrompt key
    assert len({tuple(out.token_ids) for out in outs}) == 1 and outs[2].prompt_token_ids == ids
    assert [out.prompt for out in outs[:3]] == ["def f(x):", "def f(x):", None]  # vLLM's: a TextPrompt's text
    for media, field in (({"multi_modal_data": {"image": b"png"}}, "prompt.images"),
                         ({"multi_modal_data": {"image": None, "video": ["v"]}}, "prompt.videos"),
                         ({"mm_processor_kwargs": {"fps": 2}}, "prompt.mm_processor_kwargs"),
                         ({"image_uuids": ["u"]}, "prompt.image_uuids")):  # uuids without media: never dropped
        with pytest.raises(InvalidRequestError, match="takes no images") as info:
            await engine.generate({"prompt": "x", **media}, params)
        assert info.value.field == field
    for bad, field, match in (({"prompt": "x", "bogus": 1}, "prompt", r"unknown keys \['bogus'\]"),
                              ({"prompt": 5}, "prompt", "must be a str, got int"), ({}, "prompt", "neither"),
                              ({"prompt_token_ids": "abc"}, "prompt.prompt_token_ids", "got str"),
                              ({"prompt": "x", "multi_modal_data": {"bogus": None}}, "prompt.multi_modal_data",
                               "image")):
        with pytest.raises(InvalidRequestError, match=match) as info:  # the dict's shape, before any media
            await engine.generate(bad, params)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="prompt_embeds.*enable_prompt_embeds=True"):  # vLLM's option, off
        await engine.generate({"prompt_embeds": [[0.0] * 8]}, params)


async def test_truncate_prompt_tokens_keeps_the_end(engine: AsyncEngine, tokenizer) -> None:
    text = "def area(r):\n    return 3.14 * r * r\n" * 60
    ids = tokenizer(text).input_ids
    assert len(ids) > 1024  # too long for this engine without truncation
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    cut = await engine.generate(text, SamplingParams(**greedy, truncate_prompt_tokens=100))
    kept = ids[:1] + ids[-99:]  # vLLM's: the tokenizer cuts the text on the left, BOS kept
    assert cut.prompt_token_ids == kept
    assert cut.token_ids == hf_greedy(engine.config.model, kept, 6)
    longest = await engine.generate(ids, SamplingParams(**greedy, truncate_prompt_tokens=-1))
    assert longest.prompt_token_ids == ids[-1023:]
    chat = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    stream = engine.chat(chat, SamplingParams(**greedy, truncate_prompt_tokens=50))
    async with stream:
        [d async for d in stream]
    assert stream.collector.prompt_token_ids == rendered[-50:]


async def test_a_chat_rendered_past_max_prompt_chars_is_refused_untokenized(engine: AsyncEngine, tokenizer,
                                                                            monkeypatch) -> None:
    """As a text prompt: a rendered chat longer than `max_prompt_chars` cannot fit, so it is never tokenized whole (the
    costly part, on the processor thread every request shares), and the error names ``messages``."""
    from asyncllm.engine import prompt_tokens
    from asyncllm.engine.validation import max_prompt_chars

    monkeypatch.setattr(prompt_tokens, "chat_token_ids", lambda *_: pytest.fail("tokenized"))
    chat = [{"role": "user", "content": [{"type": "text", "text": "ab"}] * max_prompt_chars(tokenizer, 1024)}]
    with pytest.raises(InvalidRequestError, match="characters") as info:
        [d async for d in engine.chat(chat, SamplingParams(max_tokens=2))]
    assert (info.value.field, info.value.code) == ("messages", "context_length_exceeded")


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([[1, 2], [3]], None, "prompt"),  # a list of prompts (generate_many's); "" is [BOS]: test_vllm_api_gaps.py
        ([], None, "prompt"),
        ([1, 2, 10**9], None, "prompt"),
        (12, None, "prompt"),
        ("hi", SamplingParams(temperature=-1.0), "temperature"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", {"max_tokens": 3}, "params"),
        ([5] * 2000, None, "prompt"),
        ("hi", SamplingParams(truncate_prompt_tokens=1024), "truncate_prompt_tokens"),
        ("hi", SamplingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ],
)
async def test_bad_requests_are_typed_and_engine_keeps_serving(engine: AsyncEngine, prompt, params, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await engine.generate(prompt, params)
    assert info.value.field == field
    out = await engine.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2


async def test_a_request_from_another_open_loop_is_refused_at_once(engine: AsyncEngine) -> None:
    """Its outputs would go to the engine's loop (a hang, before): a typed error that names the ways out."""
    def other_loop() -> None:
        asyncio.run(asyncio.wait_for(engine.generate("x", SamplingParams(max_tokens=2)), 10))

    with pytest.raises(EventLoopError, match="one engine per event loop"):
        await asyncio.to_thread(other_loop)
    assert len((await engine.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True))).token_ids) == 2
    # A stream read from another loop while it still runs: long enough that its first delta cannot be its last (with
    # 3 tokens a loaded box once coalesced all of them into the first delta; an ended stream only stops iterating).
    stream = engine.stream("x", SamplingParams(max_tokens=300, ignore_eos=True))
    first = await stream.__anext__()
    assert first.finish_reason is None, "the stream ended in its first delta: nothing left to refuse"
    with pytest.raises(EventLoopError, match="one engine per event loop"):
        await asyncio.to_thread(asyncio.run, stream.__anext__())
    assert len(first.token_ids) + sum(len(d.token_ids) for d in await _read(stream)) == 300  # its own loop reads on


async def test_lazy_start_on_first_request_then_a_later_asyncio_run(tiny_llama: str) -> None:
    """The first request starts the engine; once its loop closed (asyncio.run returned, a per-test loop ended) the
    engine serves the next loop (it hung, before). A stream the first loop left open is aborted by the takeover and
    raises `EventLoopError` in the new loop (it gave a stale delta, then a bare RuntimeError, before)."""
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    held = engine.stream([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))

    async def first() -> tuple[bool, list[int]]:
        assert not engine.started
        out = await engine.generate([5, 6, 7], params)
        await held.__anext__()
        return engine.started, out.token_ids

    async def second() -> list[int]:
        try:
            with pytest.raises(EventLoopError, match="event loop that has closed"):
                await held.__anext__()
            out = (await asyncio.wait_for(engine.generate([5, 6, 7], params), 20)).token_ids
            await _wait_idle(engine)
            assert engine.stats().request_success_total["abort"] == 1  # the held request, by the takeover
            return out
        finally:
            await engine.aclose()

    def runs() -> tuple[tuple[bool, list[int]], list[int]]:
        try:
            return asyncio.run(first()), asyncio.run(second())
        finally:
            asyncio.run(engine.aclose())  # (again: a no-op once closed)

    (started, one), two = await asyncio.to_thread(runs)
    assert started and len(one) == 3 and two == one


async def test_a_request_the_processor_thread_fails_on_gets_the_error_every_stream_gets(
        tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The processor thread dying while it adds a request (a bug in asyncllm) fails that request too, with the
    error the open streams get (it got no reply and waited forever, before)."""
    def broken(self, dealer, job) -> None:
        raise RuntimeError("a bug in the add path")

    async with AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=256) as engine:
        running = engine.stream([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        await running.__anext__()
        monkeypatch.setattr(Processor, "_add_request", broken)
        with pytest.raises(EngineDeadError, match="processor thread failed: a bug in the add path"):
            await asyncio.wait_for(engine.generate("x", SamplingParams(max_tokens=2)), 10)
        with pytest.raises(EngineDeadError, match="processor thread failed: a bug in the add path"):
            await _read(running)


async def test_a_requests_arrival_is_its_call_not_the_end_of_its_wait_for_a_core(engine: AsyncEngine,
                                                                                monkeypatch) -> None:
    """A request that waits for a core (one restarting: `ReplicaSet.pick`) arrived when it was called: its time to
    first token and end-to-end latency count the wait, as its caller saw it (its arrival was stamped after it)."""
    pick = engine._replicas.pick

    async def slow_pick(*args, **kwargs):
        await asyncio.sleep(0.3)
        return await pick(*args, **kwargs)

    monkeypatch.setattr(engine._replicas, "pick", slow_pick)
    out = await engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    assert out.metrics.time_to_first_token >= 0.3 and out.metrics.e2e_latency >= 0.3
