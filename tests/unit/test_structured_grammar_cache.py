"""The compiled-grammar cache's bounds: ASYNCLLM_XGRAMMAR_CACHE_MB of grammars (least recently used go), keys that are
digests (no client-sized text kept once a compile is done), and the sharing of one compile by equal constraints."""

from __future__ import annotations

import gc
import sys
import threading
from concurrent.futures import Future

import pytest
from test_structured_compile_pool import _wait

from asyncllm import InvalidRequestError, StructuredOutputs
from asyncllm.structured.compiler import GrammarCache, GrammarCompilerPool, constraint_digest

KIB = 2**10


class _Grammar:
    """A fake compiled grammar of `memory_size_bytes` (xgrammar's attribute)."""

    def __init__(self, text: str, memory_size_bytes: int) -> None:
        self.text, self.memory_size_bytes = text, memory_size_bytes


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch):
    """A 1 MiB cache whose fake compile of regex "NAME:KIB" makes a grammar of KIB KiB ("slow..." waits for
    `pool.finish`, "bad..." fails); `pool.compiles` lists the compiles' names, `pool.settled` the futures whose
    grammar's size the cache took."""
    monkeypatch.setenv("ASYNCLLM_XGRAMMAR_CACHE_MB", "1")
    pool = GrammarCompilerPool("unused", 512)
    pool.finish, pool.compiles, pool.settled = threading.Event(), [], []

    def compile_(key: tuple[str, str]) -> _Grammar:
        text = key[1]
        name, _, size = text.rpartition(":")
        pool.compiles.append(name[:8])
        if text.startswith("slow"):
            pool.finish.wait(timeout=60)
        if text.startswith("bad"):
            raise InvalidRequestError("structured", "invalid regex")  # its traceback's frame holds the text
        return _Grammar(name[:8], int(size) * KIB if size.isdigit() else 0)

    def compiled(key: bytes, future: Future, grammar_bytes: int, cache_compiled=pool._cache.compiled) -> None:
        cache_compiled(key, future, grammar_bytes)
        pool.settled.append(future)

    pool._compile, pool._cache.compiled = compile_, compiled
    yield pool
    pool.finish.set()
    pool.shutdown()


def _compiled(pool: GrammarCompilerPool, regex: str) -> Future:
    future = pool.submit(StructuredOutputs(regex=regex))
    _wait(lambda: future in pool.settled)  # the cache took its size
    return future


def test_least_recently_used_grammars_go_past_the_byte_limit(pool) -> None:
    a, b = _compiled(pool, "a:400"), _compiled(pool, "b:400")
    assert pool.submit(StructuredOutputs(regex="a:400")) is a  # a is now the most recently used
    _compiled(pool, "c:400")  # 1200 KiB > 1 MiB: b goes, not a
    assert pool.submit(StructuredOutputs(regex="a:400")) is a
    assert _compiled(pool, "b:400") is not b
    assert pool.compiles == ["a", "b", "c", "b"] and len(pool._cache) == 2  # b's recompile pushed c out
    assert pool.submit(StructuredOutputs(regex="a:400")) is a
    assert 800 * KIB < pool._cache.num_bytes <= 2**20


def test_a_grammar_over_the_whole_limit_serves_its_request_but_is_not_kept(pool) -> None:
    small = _compiled(pool, "small:100")
    huge = _compiled(pool, "huge:2000")
    assert huge.result().text == "huge" and len(pool._cache) == 1  # the small one stays
    assert pool.submit(StructuredOutputs(regex="small:100")) is small
    assert _compiled(pool, "huge:2000") is not huge and pool.compiles == ["small", "huge", "huge"]


def test_an_equal_constraint_shares_the_compile_in_flight(pool) -> None:
    schema = {"type": "object", "properties": {"slow": {"type": "string"}}}
    first = pool.submit(StructuredOutputs(regex="slow:10"))
    _wait(first.running)
    assert pool.submit(StructuredOutputs(regex="slow:10")) is first
    big = [_compiled(pool, f"big{i}:600") for i in range(2)]  # past the limit: the oldest compiled one goes ...
    assert pool.submit(StructuredOutputs(regex="slow:10")) is first  # ... not the older one in flight
    assert pool.submit(StructuredOutputs(regex="big1:600")) is big[1]
    pool.finish.set()
    assert first.result(timeout=10).text == "slow" and pool.compiles == ["slow", "big0", "big1"]
    assert pool.submit(StructuredOutputs(json=schema)) is pool.submit(StructuredOutputs(json=dict(schema)))
    assert constraint_digest(("regex", "x")) != constraint_digest(("grammar", "x"))


def test_no_client_text_is_kept_once_the_compile_is_done(pool) -> None:
    """The cache's keys are digests: a 1 MiB schema's text is dropped with its job (its refcount comes back)."""
    for prefix in ("", "bad"):  # a failed compile too: its future (traceback, frames) is not kept either
        text = prefix + "d" * 2**20 + ":1"
        structured = StructuredOutputs(regex=text)
        held = sys.getrefcount(text)
        future = pool.submit(structured)
        future.exception(timeout=10)
        del future
        _wait(lambda: gc.collect() >= 0 and sys.getrefcount(text) == held)  # a failed job's frames: a cycle
    assert all(isinstance(key, bytes) and len(key) == 32 for key in pool._cache._entries)


def test_the_limit_is_read_from_the_environment_in_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCLLM_XGRAMMAR_CACHE_MB", raising=False)
    assert GrammarCompilerPool("unused", 512)._cache.limit_bytes == 512 * 2**20  # vLLM's default
    cache = GrammarCache(limit_bytes=1000)
    done = Future()
    done.set_result(None)
    cache.add(b"k" * 32, done)
    cache.compiled(b"k" * 32, done, 100)
    assert cache.num_bytes == 100 + sys.getsizeof(b"k" * 32)
    cache.discard(b"k" * 32, done)
    assert cache.num_bytes == 0 and len(cache) == 0


def test_a_real_grammars_bytes_are_counted(tiny_llama: str) -> None:
    pytest.importorskip("xgrammar")
    pool = GrammarCompilerPool(tiny_llama, 512)
    grammar = pool.submit(StructuredOutputs(regex="a+")).result(timeout=60)
    _wait(lambda: pool._num_busy == 0)
    pool.shutdown()
    assert grammar.memory_size_bytes > 0
    assert pool._cache.num_bytes == grammar.memory_size_bytes + sys.getsizeof(constraint_digest(("regex", "a+")))
