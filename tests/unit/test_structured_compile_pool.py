"""The grammar compile pool's threads when compiles are abandoned, with a fake compile that blocks until told; and
shared fairly between clients (asyncllm/structured/fair_queue.py): one client's slow grammars do not keep another
client's waiting, the clients take turns, and a job shared by two clients runs once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from asyncllm import StructuredOutputs
from asyncllm.structured import compiler
from asyncllm.structured.compiler import GrammarCompilerPool
from asyncllm.structured.fair_queue import CompileJob, FairJobQueue


@pytest.fixture
def pool():
    """A pool whose compile of regex "slow..." blocks until `pool.finish` is set; any other returns its text.
    `pool.started` lists the texts in the order the threads took them."""
    pool = GrammarCompilerPool("unused", 512)
    pool.finish, pool.started = threading.Event(), []

    def compile_(key: tuple[str, str]) -> str:
        pool.started.append(key[1])
        if key[1].startswith("slow"):
            pool.finish.wait(timeout=60)
        return key[1]

    pool._compile = compile_
    yield pool
    pool.finish.set()
    pool.shutdown()


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _abandon(pool: GrammarCompilerPool, regex: str):
    """Submit a slow compile, wait until a thread runs it, and release it as a timed-out request does."""
    structured = StructuredOutputs(regex=regex)
    future = pool.submit(structured)
    _wait(future.running)
    pool.release(structured, future, still_wanted=False)
    return structured, future


def test_replacement_threads_keep_serving_after_abandoned_compiles(pool) -> None:
    slow = [_abandon(pool, f"slow{i}") for i in range(2)]
    assert pool._num_threads == 4 and pool._num_busy == 2  # two stuck threads, each with a replacement
    for i in range(6):  # the replacements serve the queue, job after job
        assert pool.submit(StructuredOutputs(regex=f"quick{i}")).result(timeout=10) == f"quick{i}"
    _wait(lambda: pool._num_busy == 2)
    assert pool._num_threads == 4
    structured, future = slow[1]
    assert pool.submit(structured) is future  # a later request shares the running job ...
    pool.release(structured, future, still_wanted=False)  # ... and gives up too: no second replacement
    assert pool._num_threads == 4
    pool.finish.set()
    assert [future.result(timeout=10) for _, future in slow] == ["slow0", "slow1"]
    _wait(lambda: pool._num_threads == 2)  # the replaced threads go once done, the replacements stay
    assert pool.submit(StructuredOutputs(regex="quick-after")).result(timeout=10) == "quick-after"
    assert pool._num_threads == 2 and not pool._abandoned


def test_at_the_thread_cap_an_abandoned_compile_keeps_its_thread(pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "_MAX_THREADS", 3)
    slow = [_abandon(pool, f"slow{i}") for i in range(2)]
    assert pool._num_threads == 3  # the second has no replacement: the cap
    assert pool.submit(StructuredOutputs(regex="quick")).result(timeout=10) == "quick"  # the one free thread
    pool.finish.set()
    for _, future in slow:
        future.result(timeout=10)
    _wait(lambda: pool._num_threads == 2)  # only the replaced thread goes
    time.sleep(0.05)
    assert pool._num_threads == 2 and not pool._abandoned


def test_the_whitespace_row_is_built_on_the_compile_thread(tiny_llama: str) -> None:
    """`space_row` (`Marker.after_space`) scans the vocabulary: the first compile job builds it, not the core's step."""
    pytest.importorskip("xgrammar")
    pool = GrammarCompilerPool(tiny_llama, 512)
    pool.submit(StructuredOutputs(regex="a+")).result(timeout=60)
    pool.shutdown()
    assert "space_row" in vars(pool) and "space_tokens" in vars(pool)
    texts = pool._tokenizer_info.decoded_vocab
    assert pool.space_tokens == {i for i, text in enumerate(texts) if text and text.isspace()} != set()


A, B, C = b"host-a", b"host-b", b"host-c"


def _submit(pool: GrammarCompilerPool, regex: str, client_id: bytes) -> Future:
    return pool.submit(StructuredOutputs(regex=regex), client_id)


def test_one_clients_slow_grammars_do_not_hold_another_clients_grammar(pool) -> None:
    """Host A's two slow grammars hold both compile threads and two more wait: host B's grammar gets a thread of its
    own at once (before A's queued ones), which goes once done; A's queued ones run as A's threads free up."""
    running = [_submit(pool, f"slow{i}", A) for i in range(2)]
    for future in running:
        _wait(future.running)
    queued = [_submit(pool, f"slow{i}", A) for i in range(2, 4)]
    assert pool._num_threads == 2  # one client alone: no thread more, its jobs wait for its own
    assert _submit(pool, "quick", B).result(timeout=10) == "quick"  # before: queued behind A's two, done after them
    _wait(lambda: pool._num_threads == 2)  # the thread started for B went
    assert pool._jobs.statistics() == {A: (2, 2)} and not any(future.running() for future in queued)
    pool.finish.set()
    assert [future.result(timeout=10) for future in running + queued] == [f"slow{i}" for i in range(4)]
    assert set(pool.started[:3]) == {"slow0", "slow1", "quick"} and set(pool.started[3:]) == {"slow2", "slow3"}
    assert len(pool.started) == 5 and pool._num_threads == 2


def test_a_client_within_its_share_gets_no_extra_thread(pool) -> None:
    """A and B each run one slow grammar (their share of the two threads): C's waits for a free thread."""
    slow = [_submit(pool, "slow-a", A), _submit(pool, "slow-b", B)]
    for future in slow:
        _wait(future.running)
    waiting = _submit(pool, "quick-c", C)
    assert pool._num_threads == 2 and not waiting.running()
    pool.finish.set()
    assert waiting.result(timeout=10) == "quick-c"


def test_a_queued_job_another_client_shares_runs_once_at_the_first_turn(pool) -> None:
    """B's request for the grammar A queued last joins A's job (one future, the cache's sharing) and takes B's turn:
    it runs before A's other queued grammars, once."""
    for i in range(2):
        _wait(_submit(pool, f"slow{i}", A).running)
    a_jobs = [_submit(pool, f"slowq{i}", A) for i in range(3)]
    shared = _submit(pool, "slowq2", B)
    assert shared is a_jobs[2]
    _wait(shared.running)  # on the thread started for B, while A's first two still wait
    assert not a_jobs[0].running() and not a_jobs[1].running()
    pool.finish.set()
    for future in a_jobs:
        future.result(timeout=10)
    assert sorted(pool.started) == ["slow0", "slow1", "slowq0", "slowq1", "slowq2"]  # each once


def _job(name: str) -> CompileJob:
    return CompileJob(Future(), name.encode(), ("regex", name))


def test_the_clients_take_turns_the_one_running_fewest_first() -> None:
    queue = FairJobQueue()
    for _ in range(2):
        queue.add_thread()
    for name in ("a1", "a2", "a3"):
        queue.put(_job(name), A)
    for name in ("b1", "b2"):
        queue.put(_job(name), B)
    taken = [queue.take() for _ in range(5)]  # nothing is done meanwhile: each turn goes to the one running fewest
    assert [(job.constraint[1], client) for job, client in taken] == [
        ("a1", A), ("b1", B), ("a2", A), ("b2", B), ("a3", A)]
    assert all(job.future.running() for job, _ in taken)
    assert queue.statistics() == {A: (3, 0), B: (2, 0)}
    queue.done(A, leaving=False)
    assert queue.statistics() == {A: (2, 0), B: (2, 0)}


def test_a_client_running_none_goes_before_one_running_some() -> None:
    queue = FairJobQueue()
    queue.put(_job("a1"), A)
    assert queue.take()[1] == A
    queue.put(_job("a2"), A)
    queue.put(_job("b1"), B)  # queued after A's second
    assert queue.take()[0].constraint[1] == "b1"


def test_starved_needs_every_thread_busy_and_another_client_over_its_share() -> None:
    queue = FairJobQueue()
    for _ in range(2):
        queue.add_thread()
    for name in ("a1", "a2", "a3"):
        queue.put(_job(name), A)
    queue.take()
    queue.put(_job("b1"), B)
    assert not queue.starved(2)  # a thread is free: it takes B's next
    queue.put(_job("b0"), C)
    assert queue.take()[1] == B
    assert not queue.starved(2)  # A and B run one each: within their share, C waits for a free thread
    queue.done(B, leaving=False)
    assert queue.take()[1] == C
    queue.done(C, leaving=False)
    assert queue.take()[1] == A  # only A's left: both threads A's
    assert not queue.starved(2)  # one client: its jobs wait for its own
    queue.put(_job("b2"), B)
    assert queue.starved(2)  # every thread A's while B waits: the pool starts one more
    assert not queue.starved(4)  # A runs two of four threads: its share
    queue.done(A, leaving=True)  # a thread that went: none free, and A now runs one, its share
    assert not queue.starved(2)
    queue.take()  # B's, with the thread started for it
    assert queue.statistics() == {A: (1, 1), B: (1, 0)}


def test_cancelled_and_started_jobs_are_skipped() -> None:
    queue = FairJobQueue()
    cancelled, shared = _job("gone"), _job("shared")
    queue.put(cancelled, A)
    queue.put(shared, A)
    queue.put(CompileJob(shared.future, shared.key, shared.constraint), B)  # B waits for the same job
    queue.put(CompileJob(shared.future, shared.key, shared.constraint), B)  # twice: queued once
    assert queue.statistics() == {A: (0, 2), B: (0, 1)}
    cancelled.future.cancel()
    job, client = queue.take()
    assert job is shared and client == A
    assert queue.statistics() == {A: (1, 0)}  # B's entry of the running job is gone too


def test_close_wakes_the_waiting_threads() -> None:
    queue = FairJobQueue()
    results: list = []
    thread = threading.Thread(target=lambda: results.append(queue.take()))
    thread.start()
    queue.close()
    thread.join(timeout=10)
    assert results == [None]
