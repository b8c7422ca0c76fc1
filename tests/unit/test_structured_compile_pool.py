"""The grammar compile pool's threads when compiles are abandoned, with a fake compile that blocks until told."""

from __future__ import annotations

import threading
import time

import pytest

from asyncllm import StructuredOutputs
from asyncllm.structured import compiler
from asyncllm.structured.compiler import GrammarCompilerPool


@pytest.fixture
def pool():
    """A pool whose compile of regex "slow..." blocks until `pool.finish` is set; any other returns its text."""
    pool = GrammarCompilerPool("unused", 512)
    pool.finish = threading.Event()

    def compile_(key: tuple[str, str]) -> str:
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

