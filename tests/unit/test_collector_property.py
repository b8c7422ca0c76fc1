"""`RequestCollector` under drawn traffic (hypothesis), fed as the loop's deliveries feed it, read as a stream reads it.

Drawn: a request of 1 to 3 samples, its ``output_kind`` (DELTA, CUMULATIVE, FINAL_ONLY), whether it asked for
logprobs and prompt logprobs, and a list of operations in one event loop: a delivery (a batch of deltas put at once,
as `AsyncEngine._on_delivery` puts the processor thread's batch: a few tokens and some text for an unfinished sample,
some ending it with "stop" or "length", late ones after the request ended), an error, an abort (`abort`, a stream
left), the processor's word that it accepted the request, and a take (the reader's `get`, run as a task: it takes at
once what is there, or waits, and a later delivery wakes it). The loop only turns over (``asyncio.sleep(0)``) between
operations: no timed sleeps.

The model is plain lists: every delta put, per sample, and what is due to the reader, by sample in the order it
became due. After every operation the collector must match it: a waiting reader is woken exactly when something is
due, and gets the first due sample's deltas merged into one (DELTA: text, token ids and logprobs concatenated, the
latest finish, stop reason, running ``cumulative_logprob`` and prompt logprobs), or that sample's whole output so far
(CUMULATIVE after any change; FINAL_ONLY once, when it finished), or, when nothing is due, the request's error; no
more than one item per sample is held (memory stays bounded); `finished`, `pending`, `done`, the acceptance event and
the retraction of the request's admission agree with the model. An abort ends each unfinished sample with an empty
"abort" delta carrying its running ``cumulative_logprob``. At the end the reader drains it: per sample, DELTA's items
concatenate to everything put, in order, with the finish reason on the last one only; each CUMULATIVE item is the
whole output so far and the last one all of it; FINAL_ONLY hands out one item per sample; nothing handed out changes
afterwards, and after the end a reader waits.
"""

from __future__ import annotations

import asyncio
import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import Logprob
from asyncllm.engine.collector import RequestCollector
from asyncllm.errors import EngineDeadError
from asyncllm.outputs import StreamDelta
from asyncllm.sampling import RequestOutputKind

KINDS = list(RequestOutputKind)
PROMPT_LOGPROBS = [None, {5: Logprob(-0.5, 1, "p")}]


class FakeAdmitted:
    """Counts `retract` calls (the host's queue estimate un-counting a failed request)."""

    def __init__(self) -> None:
        self.retracted = 0

    def retract(self) -> None:
        self.retracted += 1


def merged(index: int, parts: list[StreamDelta]) -> StreamDelta:
    """`parts` (one sample's deltas, in order) as one: what the reader gets for them, by the module's docstring."""
    logprobs = [entry for part in parts if part.logprobs is not None for entry in part.logprobs]
    prompt_logprobs = [part.prompt_logprobs for part in parts if part.prompt_logprobs is not None]
    last = parts[-1] if parts else StreamDelta(index, "", [])
    return StreamDelta(index, "".join(part.text for part in parts), [t for part in parts for t in part.token_ids],
                       last.finish_reason, last.stop_reason,
                       logprobs if any(part.logprobs is not None for part in parts) else None,
                       prompt_logprobs[-1] if prompt_logprobs else None, last.cumulative_logprob)


class Model:
    """Every delta put per sample, and what is due to the reader: sample -> its deltas since its last item (DELTA;
    the other kinds hand out the whole sample, so only the order matters), in the order each became due."""

    def __init__(self, n: int, kind: RequestOutputKind, logprobs: bool) -> None:
        self.kind = kind
        self.put_so_far: dict[int, list[StreamDelta]] = {i: [] for i in range(n)}
        self.unfinished: dict[int, float | None] = {i: 0.0 if logprobs else None for i in range(n)}
        """Each unfinished sample's running cumulative_logprob (0.0 before any token, with logprobs asked)."""
        self.due: dict[int, list[StreamDelta]] = {}
        self.finished = False
        self.error: BaseException | None = None
        self.accepted = False
        self.retracted = 0

    def put(self, delta: StreamDelta) -> None:
        if self.finished:  # anything after the end is dropped
            return
        self.accepted = True
        self.put_so_far[delta.index].append(delta)
        if delta.finished:
            del self.unfinished[delta.index]
            self.finished = not self.unfinished
        else:
            self.unfinished[delta.index] = delta.cumulative_logprob
        if self.kind is RequestOutputKind.DELTA:
            self.due.setdefault(delta.index, []).append(delta)
        elif self.kind is RequestOutputKind.CUMULATIVE or delta.finished:
            self.due.setdefault(delta.index, [])

    def put_error(self, error: BaseException) -> None:
        if not self.finished:
            self.finished, self.error, self.accepted = True, error, True
            self.retracted += 1

    def abort(self) -> None:
        for index, cumulative_logprob in list(self.unfinished.items()):
            self.put(StreamDelta(index, "", [], "abort", cumulative_logprob=cumulative_logprob))

    def ready(self) -> bool:
        return bool(self.due) or self.error is not None

    def take(self) -> StreamDelta | BaseException:
        if not self.due:
            assert self.error is not None
            return self.error
        index = next(iter(self.due))
        parts = self.due.pop(index)
        return merged(index, parts if self.kind is RequestOutputKind.DELTA else self.put_so_far[index])

    @property
    def done(self) -> bool:
        return self.finished and self.error is None and not self.due


class Producer:
    """Makes valid deltas for the drawn request: token ids count up per sample, each named in the text, logprobs one
    per token."""

    def __init__(self, n: int, logprobs: bool, prompt_logprobs: bool) -> None:
        self.logprobs = logprobs
        self.next_token = {i: 100 * i for i in range(n)}
        self.cumulative = {i: 0.0 for i in range(n)}
        self.prompt_logprobs = PROMPT_LOGPROBS if prompt_logprobs else None

    def delta(self, model: Model, pick: int, num_tokens: int, text: str, finish: str | None) -> StreamDelta:
        """The next delta of an unfinished sample (any sample once the request ended: a late one)."""
        samples = list(model.unfinished) or list(model.put_so_far)
        index = samples[pick % len(samples)]
        tokens = list(range(self.next_token[index], self.next_token[index] + num_tokens))
        self.next_token[index] += num_tokens
        text += "".join(f"<{t}>" for t in tokens)  # the order of merged texts shows
        delta = StreamDelta(index, text, tokens, finish, None if finish is None else [None, "##", 2][pick % 3])
        if self.logprobs:
            if tokens:  # a delta without tokens has no rows (None), as the processor's
                delta.logprobs = [{t: Logprob(-(t % 7) - 0.25, 1, str(t))} for t in tokens]
                self.cumulative[index] += sum(entry[t].logprob for t, entry in zip(tokens, delta.logprobs))
            delta.cumulative_logprob = self.cumulative[index]
        if index == 0 and self.prompt_logprobs is not None:  # sample 0's first delta, as the processor sends them
            delta.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return delta


def handed_over(delta: StreamDelta) -> StreamDelta:
    """A copy for the collector, which may extend the lists of a delta it holds."""
    return copy.deepcopy(delta)


class Reader:
    """The stream's side: one `get` task at a time, and everything it got (with a copy to see it never changes)."""

    def __init__(self, collector: RequestCollector) -> None:
        self.collector = collector
        self.waiting: asyncio.Task | None = None
        self.got: list[tuple[StreamDelta, StreamDelta]] = []

    def take(self) -> None:
        if self.waiting is None:
            self.waiting = asyncio.get_running_loop().create_task(self.collector.get())

    def check(self, model: Model) -> None:
        """After the loop turned over: a waiting reader got what the model says is due, or waits for it."""
        if self.waiting is None:
            return
        if not model.ready():
            assert not self.waiting.done(), "the reader was woken with nothing due"
            return
        assert self.waiting.done(), "the reader still waits although something is due"
        expected, task, self.waiting = model.take(), self.waiting, None
        if isinstance(expected, BaseException):
            assert task.exception() is expected
            return
        got = task.result()
        assert got == expected
        self.got.append((got, copy.deepcopy(got)))


async def turn_over() -> None:
    """Let the loop run what is ready (a woken reader) without waiting for time to pass."""
    for _ in range(3):
        await asyncio.sleep(0)


def check_state(collector: RequestCollector, model: Model, admitted: FakeAdmitted, accepted: asyncio.Event,
                n: int) -> None:
    assert (collector.finished, collector.pending, collector.done) == (model.finished, bool(model.due), model.done)
    held = list(collector._pending) + list(collector._changed)  # at most one item per sample: memory stays bounded
    assert held == list(model.due) and len(held) <= n
    assert (accepted.is_set(), admitted.retracted) == (model.accepted, model.retracted)


def check_drained(reader: Reader, model: Model, n: int) -> None:
    """Per sample, what the reader got adds up to everything put, as its output kind says, and never changed (a
    sample the request's error cut short ends without a finish reason; under FINAL_ONLY it has no item)."""
    assert all(got == kept for got, kept in reader.got)
    for index in range(n):
        items = [got for got, _ in reader.got if got.index == index]
        whole = merged(index, model.put_so_far[index])
        if not model.put_so_far[index] or (model.kind is RequestOutputKind.FINAL_ONLY and not whole.finished):
            assert items == []
            continue
        assert [item.finished for item in items] == [False] * (len(items) - 1) + [whole.finished]
        if model.kind is RequestOutputKind.DELTA:
            assert merged(index, items) == whole
        else:
            assert items[-1] == whole
            for earlier, later in zip(items, items[1:]):  # each snapshot extends the one before
                assert later.text.startswith(earlier.text)
                assert later.token_ids[: len(earlier.token_ids)] == earlier.token_ids
        if model.kind is RequestOutputKind.FINAL_ONLY:
            assert len(items) == 1


OPERATIONS = ["deliver"] * 8 + ["take"] * 6 + ["error", "abort", "accept"]  # an error or an abort ends it: seldom
finishes = st.sampled_from([None] * 5 + ["stop", "length"])
one_delta = st.tuples(st.integers(0, 5), st.integers(0, 3), st.text("ab", max_size=2), finishes)
operation = st.tuples(st.sampled_from(OPERATIONS), st.lists(one_delta, min_size=1, max_size=4))


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, RequestOutputKind, bool, bool, list]:
    n, kind = draw(st.integers(1, 3)), draw(st.sampled_from(KINDS))
    return n, kind, draw(st.booleans()), draw(st.booleans()), draw(st.lists(operation, max_size=30))


async def run(case: tuple[int, RequestOutputKind, bool, bool, list]) -> None:
    n, kind, logprobs, prompt_logprobs, operations = case
    admitted, accepted = FakeAdmitted(), asyncio.Event()
    collector = RequestCollector("r", 0.0, n, kind, logprobs, admitted, accepted)  # type: ignore[arg-type]
    model, producer, reader = Model(n, kind, logprobs), Producer(n, logprobs, prompt_logprobs), Reader(collector)
    for name, batch in operations:
        if name == "deliver":
            for pick, num_tokens, text, finish in batch:
                delta = producer.delta(model, pick, num_tokens, text, finish)
                collector.put(handed_over(delta))
                model.put(delta)
        elif name == "take":
            reader.take()
        elif name == "error":
            error = EngineDeadError("the engine died")
            collector.put_error(error)
            model.put_error(error)
        elif name == "abort":
            collector.abort()
            model.abort()
        else:
            collector.accept()
            model.accepted = True
        await turn_over()
        reader.check(model)
        check_state(collector, model, admitted, accepted, n)
    await drain(collector, model, reader, admitted, accepted, n)


async def drain(collector: RequestCollector, model: Model, reader: Reader, admitted: FakeAdmitted,
                accepted: asyncio.Event, n: int) -> None:
    """The stream is left (an abort, unless the request ended), then read to its end; after it a reader waits."""
    collector.abort()
    model.abort()
    while model.ready():
        error = model.error if not model.due else None
        reader.take()
        await turn_over()
        reader.check(model)
        check_state(collector, model, admitted, accepted, n)
        if error is not None:
            break
    check_drained(reader, model, n)
    if model.error is None:
        reader.take()
        await turn_over()
        reader.check(model)
        assert reader.waiting is not None and not reader.waiting.done()
        reader.waiting.cancel()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=requests())
def test_reader_gets_every_sample_merged_or_whole_as_its_output_kind_says(case) -> None:
    asyncio.run(run(case))
