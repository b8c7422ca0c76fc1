"""`RequestCollector`: merging per sample, output kinds, n > 1 completion, errors after pending deltas."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import InvalidRequestError, Logprob
from asyncllm.engine.collector import RequestCollector
from asyncllm.outputs import StreamDelta
from asyncllm.sampling import RequestOutputKind


def lp(token_id: int) -> dict[int, Logprob]:
    return {token_id: Logprob(-1.0, 1, str(token_id))}


def delta(index: int, text: str, token: int, finish: str | None = None) -> StreamDelta:
    """One token; its ``cumulative_logprob`` -token stands for the running total up to it."""
    return StreamDelta(index, text, [token], finish, None, [lp(token)], cumulative_logprob=-float(token))


async def drain(collector: RequestCollector) -> list[StreamDelta]:
    out = []
    while not collector.done:
        out.append(await asyncio.wait_for(collector.get(), 1))
    return out


async def test_delta_kind_merges_each_sample_separately() -> None:
    c = RequestCollector("r", 0.0, n=2)
    for item in (delta(0, "a", 1), delta(1, "x", 7), delta(0, "b", 2), delta(1, "y", 8, "length"), delta(0, "c", 3, "stop")):
        c.put(item)
    assert c.finished
    got = await drain(c)
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in got] == [
        (0, "abc", [1, 2, 3], "stop"), (1, "xy", [7, 8], "length")]
    assert got[0].logprobs == [lp(1), lp(2), lp(3)]
    assert [d.cumulative_logprob for d in got] == [-3.0, -8.0]  # a running total: the merged delta's latest


async def test_n_samples_finish_the_request_only_when_all_did() -> None:
    c = RequestCollector("r", 0.0, n=2)
    c.put(delta(0, "a", 1, "stop"))
    assert not c.finished and (await c.get()).index == 0 and not c.done
    c.put(delta(1, "b", 2, "length"))
    assert c.finished and (await c.get()).index == 1 and c.done
    c.put(delta(0, "late", 3))  # anything after the end is dropped
    assert c.done


async def test_cumulative_kind_hands_out_snapshots() -> None:
    c = RequestCollector("r", 0.0, output_kind=RequestOutputKind.CUMULATIVE)
    c.put(delta(0, "a", 1))
    first = await c.get()
    c.put(delta(0, "b", 2))
    c.put(delta(0, "c", 3, "stop"))
    last = await c.get()
    assert (first.text, first.token_ids, first.cumulative_logprob) == ("a", [1], -1.0)  # later tokens leave it
    assert last.cumulative_logprob == -3.0
    assert (last.text, last.token_ids, last.finish_reason, last.logprobs) == ("abc", [1, 2, 3], "stop", [lp(1), lp(2), lp(3)])
    assert c.done


async def test_final_only_kind_yields_each_sample_once() -> None:
    c = RequestCollector("r", 0.0, n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    c.put(delta(1, "x", 7))
    c.put(delta(0, "a", 1))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(c.get(), 0.05)
    c.put(delta(1, "y", 8, "stop"))
    c.put(delta(0, "b", 2, "length"))
    got = await drain(c)
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in got] == [(1, "xy", [7, 8], "stop"), (0, "ab", [1, 2], "length")]


async def test_error_comes_after_the_pending_deltas() -> None:
    c = RequestCollector("r", 0.0)
    c.put(delta(0, "a", 1))
    c.put_error(InvalidRequestError("prompt", "bad"))
    assert (await c.get()).text == "a" and not c.done
    with pytest.raises(InvalidRequestError):
        await c.get()


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
async def test_abort_ends_each_unfinished_sample_as_the_engine_close_does(kind: RequestOutputKind) -> None:
    """A stream left (`RequestStream.aclose`): each unfinished sample's last delta says "abort" and keeps its running
    ``cumulative_logprob``, as `_fail_all`'s (0.0 with logprobs asked before any token); a finished sample gets
    none."""
    c = RequestCollector("r", 0.0, n=3, output_kind=kind, logprobs=True)
    c.put(delta(0, "a", 1))
    c.put(delta(1, "x", 7, "stop"))
    c.abort()
    assert c.finished
    got = {d.index: d for d in await drain(c)}
    assert (got[0].text, got[0].finish_reason, got[0].cumulative_logprob) == ("a", "abort", -1.0)
    assert (got[2].text, got[2].token_ids, got[2].finish_reason, got[2].cumulative_logprob) == ("", [], "abort", 0.0)
    assert got[1].finish_reason == "stop" and not c.pending
    plain = RequestCollector("p", 0.0, n=1, output_kind=kind)  # no logprobs asked: None, as vLLM's
    plain.abort()
    assert [d.cumulative_logprob for d in await drain(plain)] == [None]


def test_a_stream_collected_on_another_thread_only_posts_the_abort() -> None:
    """`RequestStream.__del__` runs on whatever thread collects it: it posts the core's abort (thread-safe) and
    leaves the loop's collector alone (an asyncio.Event set off the loop's thread races it)."""
    import threading
    from types import SimpleNamespace

    from asyncllm.engine.stream import RequestOptions, RequestStream

    aborted: list[str] = []
    stream = RequestStream(SimpleNamespace(_abort=lambda request_id, collector: aborted.append(request_id)), "p", None,
                           RequestOptions(), False)
    stream.collector = collector = RequestCollector("r", 0.0, n=2)
    finalizer = threading.Thread(target=stream.__del__)
    finalizer.start()
    finalizer.join()
    assert aborted == ["r"] and not collector.finished and not collector.pending and not collector._ready.is_set()
