"""`SyncEngine` from plain threads, from a running loop's thread pool, and as a sync iterator."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from asyncllm import EngineDeadError, SamplingParams
from asyncllm.integrations import sync
from asyncllm.integrations.sync import SyncEngine
from hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["def main():", "import os\n", "class Config:", "for x in y:"]


@pytest.fixture(scope="module")
def engine(tiny_llama: str):
    engine = SyncEngine(tiny_llama, disable_log_stats=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def expected(tiny_llama: str) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return {p: hf_greedy(tiny_llama, tokenizer(p).input_ids, 12) for p in PROMPTS}


def test_generate_from_many_plain_threads(engine, expected) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        outputs = list(pool.map(lambda p: engine.generate(p, GREEDY), PROMPTS))
    assert [o.token_ids for o in outputs] == [expected[p] for p in PROMPTS]


def test_stream_is_a_sync_iterator(engine, expected) -> None:
    deltas = list(engine.stream(PROMPTS[0], GREEDY))
    assert [t for d in deltas for t in d.token_ids] == expected[PROMPTS[0]]
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == engine.generate(PROMPTS[0], GREEDY).text


def test_leaving_a_stream_early_aborts(engine) -> None:
    before = engine.stats().request_success_total.get("abort", 0)
    for _ in engine.stream("x", SamplingParams(max_tokens=1000, ignore_eos=True)):
        break  # the generator is closed here: its request is aborted
    deadline = time.monotonic() + 5
    while engine.stats().num_requests_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().num_requests_running == 0
    assert engine.stats().request_success_total.get("abort", 0) == before + 1


def test_a_stream_collected_on_the_loops_own_thread_aborts_without_a_deadlock(engine) -> None:
    """A stream left in a reference cycle is closed by whichever thread's garbage collection finds it; on the
    engine's loop thread its abort is scheduled, not waited for (which hung the loop for good)."""
    import gc
    import sys

    def leave_in_a_cycle() -> None:
        stream = engine.stream("x", SamplingParams(max_tokens=1000, ignore_eos=True))
        next(stream)
        frame = sys._getframe()  # noqa: F841 - the frame holds itself and the stream: only the GC frees them

    async def collect() -> str:
        gc.collect()
        return "collected"

    before = engine.stats().request_success_total.get("abort", 0)
    gc.disable()
    try:
        leave_in_a_cycle()
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(engine.run, collect()).result(timeout=20) == "collected"
    finally:
        gc.enable()
    deadline = time.monotonic() + 5
    while engine.stats().request_success_total.get("abort", 0) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().request_success_total.get("abort", 0) == before + 1


def test_chat_and_generate_many(engine, expected) -> None:
    reply = "".join(d.text for d in engine.chat([{"role": "user", "content": "hi"}], GREEDY))
    assert isinstance(reply, str)
    outputs = engine.generate_many(PROMPTS, GREEDY, max_concurrency=2)
    assert [o.token_ids for o in outputs] == [expected[p] for p in PROMPTS]
    embedded = engine.embed(PROMPTS[0])
    assert embedded.prompt_token_ids == outputs[0].prompt_token_ids
    assert abs(sum(x * x for x in embedded.embedding) - 1.0) < 1e-5  # normalized


def test_from_a_running_loops_thread_pool(engine, expected) -> None:
    async def handler() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        calls = [loop.run_in_executor(None, engine.generate, p, GREEDY) for p in PROMPTS]
        return [o.token_ids for o in await asyncio.gather(*calls)]

    assert asyncio.run(handler()) == [expected[p] for p in PROMPTS]


def test_calling_it_on_its_own_loop_is_refused(engine) -> None:
    async def nested() -> None:
        engine.generate("x", GREEDY)  # would wait for the loop it is blocking

    with pytest.raises(RuntimeError, match="deadlock"):
        engine.run(nested())


def test_closing_it_on_its_own_loop_is_refused(tiny_llama: str) -> None:
    """close() in a coroutine passed to run() would wait for the loop it blocks (it hung): it raises as other calls
    there, and closes nothing."""
    engine = SyncEngine(tiny_llama)  # never started

    async def close_here() -> None:
        engine.close()

    caller, outcome = _in_a_thread(lambda: engine.run(close_here()))
    caller.join(10)
    assert outcome and outcome[0].startswith("RuntimeError") and "deadlock" in outcome[0]
    assert engine.run(asyncio.sleep(0, "open")) == "open"
    engine.close()


def test_a_stream_collected_while_posting_aborts_without_a_deadlock(tiny_llama: str, monkeypatch) -> None:
    """A stream in a reference cycle collected by the allocations of another call's `_post` (under its lock)
    re-enters `_post` to abort: no self-deadlock (a plain Lock), and its abort is only scheduled, since a wait there
    would stall the loop's own `_post` (the stream's aclose collecting another stream on the loop thread)."""
    engine = SyncEngine(tiny_llama)  # never started: its streams are fakes
    aborted = threading.Event()

    class FakeStream:
        _done, collector = False, None

        async def __anext__(self) -> str:
            return "delta"

        async def aclose(self) -> None:
            engine._finish(asyncio.sleep(0))  # on the loop thread: takes `_close_lock`
            aborted.set()

    monkeypatch.setattr(engine._engine, "stream", lambda *args, **kwargs: FakeStream())
    real = asyncio.run_coroutine_threadsafe

    def collecting(coro, loop):
        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", real)
        gc.collect()  # as a gen-0 collection its allocations start
        return real(coro, loop)

    gc.disable()
    try:
        stream = engine.stream("x")
        assert next(stream) == "delta"
        cycle = [stream]
        cycle.append(cycle)
        del stream, cycle
        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", collecting)
        caller, outcome = _in_a_thread(lambda: engine.run(asyncio.sleep(0)))
        caller.join(10)
    finally:
        gc.enable()
    assert outcome == ["no error"] and aborted.wait(10)
    engine.close()


def test_close_ends_a_call_whose_cancellation_outlasts_its_wait(tiny_llama: str, monkeypatch) -> None:
    """A call whose coroutine's cancellation cleanup runs past close()'s wait is left on a stopped loop: close()
    ends its caller with EngineDeadError (it waited forever)."""
    monkeypatch.setattr(sync, "CANCEL_WAIT_S", 0.05)
    engine = SyncEngine(tiny_llama)  # never started
    running = threading.Event()

    async def stubborn() -> None:
        try:
            running.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.Event().wait()  # a cleanup that never ends
            raise

    caller, outcome = _in_a_thread(lambda: engine.run(stubborn()))
    assert running.wait(10)
    engine.close()
    caller.join(10)
    assert outcome == ["EngineDeadError: this SyncEngine was closed; create a new one"]


def test_close_then_use(tiny_llama: str) -> None:
    engine = SyncEngine(tiny_llama)  # never started: close is cheap and idempotent
    engine.close()
    engine.close()
    with pytest.raises(EngineDeadError):
        engine.generate("x")
    assert not any(t.name == "asyncllm-sync-loop" and t is engine._thread for t in threading.enumerate())


def test_close_ends_what_other_threads_wait_for_or_iterate(tiny_llama: str) -> None:
    """close() while other threads hold streams or wait in calls: a stream whose last delta was handed out ends, one
    whose last delta was not raises EngineDeadError, and so does a call still running on the loop; none waits
    forever nor gets asyncio's bare "Event loop is closed" and a never-awaited coroutine."""
    engine = SyncEngine(tiny_llama, disable_log_stats=True)
    ended = engine.stream("x", SamplingParams(max_tokens=2, ignore_eos=True))
    while next(ended).finish_reason is None:  # its last delta, not yet its StopIteration
        pass
    unread = engine.stream("x", SamplingParams(max_tokens=1000, ignore_eos=True))
    next(unread)
    running = threading.Event()

    async def forever() -> None:
        running.set()
        await asyncio.Event().wait()

    caller, waiting = _in_a_thread(lambda: engine.run(forever()))
    assert running.wait(30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.close()
        caller.join(10)
        assert not caller.is_alive(), "a call running on the loop waits forever after close()"
        assert list(ended) == []
        with pytest.raises(EngineDeadError, match="was closed"):
            next(unread)
        del ended, unread
        gc.collect()
    assert waiting == ["EngineDeadError: this SyncEngine was closed; create a new one"]
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_a_generate_that_close_cut_short_raises_rather_than_returning_a_partial_output(tiny_llama: str,
                                                                                       monkeypatch) -> None:
    """The engine's close aborts a `generate` in flight, whose output (finish_reason "abort") would pass for a
    whole one in a batch job: the caller gets EngineDeadError, as every other call close ends."""
    from asyncllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

    engine = SyncEngine(tiny_llama, disable_log_stats=True)

    async def cut_short(*args, **kwargs) -> RequestOutput:  # as the engine's close ends a running request
        while not engine._closed:
            await asyncio.sleep(0.01)
        return RequestOutput("r", "x", [1], [CompletionOutput(0, "def", [2], "abort", None)],
                             RequestMetrics(arrival_time=time.time()))

    monkeypatch.setattr(engine._engine, "generate", cut_short)
    caller, outcome = _in_a_thread(lambda: engine.generate("x"))
    time.sleep(0.2)
    engine.close()
    caller.join(10)
    assert outcome == ["EngineDeadError: this SyncEngine was closed; create a new one"]


def test_a_generate_many_that_close_cut_short_raises_rather_than_returning_partial_outputs(tiny_llama: str,
                                                                                          monkeypatch) -> None:
    """A batch whose last prompts were in flight when close() came: the engine's close aborts them, and their outputs
    (finish_reason "abort") would pass for whole ones; the caller gets EngineDeadError, as `generate`'s does."""
    from asyncllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

    engine = SyncEngine(tiny_llama, disable_log_stats=True)

    async def cut_short(prompt, *args, **kwargs) -> RequestOutput:  # as the engine's close ends a running request
        while not engine._closed:
            await asyncio.sleep(0.01)
        return RequestOutput("r", prompt, [1], [CompletionOutput(0, "def", [2], "abort", None)],
                             RequestMetrics(arrival_time=time.time()))

    async def slow_aclose(close=engine._engine.aclose) -> None:  # the batch returns before the loop stops
        await asyncio.sleep(0.5)
        await close()

    monkeypatch.setattr(engine._engine, "generate", cut_short)
    monkeypatch.setattr(engine._engine, "aclose", slow_aclose)
    caller, outcome = _in_a_thread(lambda: engine.generate_many(["x", "y"], max_concurrency=2))
    time.sleep(0.2)
    engine.close()
    caller.join(10)
    assert outcome == ["EngineDeadError: this SyncEngine was closed; create a new one"]


def test_a_forked_child_cannot_use_the_engine_and_leaves_the_parents_alone(engine, expected) -> None:
    """gunicorn --preload / a Celery prefork master: an engine started before os.fork() serves the parent only. In
    the child every call says so (instead of waiting forever) and closing it stops nothing of the parent's."""
    engine.start()
    core = engine.engine._core
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        try:
            report = [_error_of(lambda: engine.generate("x", GREEDY)),
                      _error_of(lambda: asyncio.run(engine.engine.generate("x", GREEDY))),
                      str(engine.stats().engine_alive)]
            asyncio.run(engine.engine.aclose())  # forgets the parent's replicas: stops, removes, unlinks nothing
            engine.close()
            report.append(str(engine.engine._replicas[0].core))
            os.write(write_end, "\n".join(report).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    _wait_for_child(pid)
    with os.fdopen(read_end) as child:
        report = child.read().split("\n")
    assert len(report) == 4 and report[2:] == ["False", "None"]  # the parent's engine: dead to the child
    for error in report[:2]:
        assert error.startswith("EngineDeadError") and f"process {os.getpid()}, before a fork" in error
    assert report[0] == report[1].replace("AsyncEngine", "SyncEngine")  # one check (procutil.check_not_forked)
    assert core.proc.poll() is None and os.path.isdir(core.ipc_dir)
    assert engine.generate(PROMPTS[0], GREEDY).token_ids == expected[PROMPTS[0]]


def _error_of(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _in_a_thread(call) -> tuple[threading.Thread, list[str]]:
    """`call` started in a daemon thread (a hang fails the test, not the run) and the list it reports into."""
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(_error_of(call)), daemon=True)
    thread.start()
    return thread, outcome


def _wait_for_child(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")
