"""`SampleGroups` (asyncllm/engine/sample_groups.py) under drawn traffic of hosts sharing one engine core
(hypothesis), driven through `EngineCore._handle` and `SampleGroups.admit_compiled` as the core drives them, with a
real scheduler and structured-output manager and no workers (as tests/unit/test_core_sample_groups.py builds one).

Drawn: the queue's limits (``max_num_queued_requests`` None, 2 or 4; ``max_num_queued_tokens`` None, 30 or 80), two
hosts each using three request ids again and again, and a list of operations: a request (n 1 to 4; a prompt of 3
tokens, of 40 (the token limit), with a token outside the vocabulary (refused by `check_add_request`) or longer than
the KV cache (refused by the scheduler); with a grammar (parked until `admit_compiled`; with a timeout or not) or not;
its sample 0 missing the processor cache (its host resends it, or cannot and fails the request)), the delivery of the
next message of one of a host's requests (the samples of one request in order, sample 0 first, interleaved with other
requests'), the grammars sent so far compiling, the core's turn admitting the parked requests whose grammar compiled
(ending those whose timeout passed), ten seconds passing, a queued sample finishing, the user aborting a request, a
host detaching (`Goodbye`) and attaching again under its old client id or a new one, a host sending an id in use,
and a sample 0 counting for more than `MAX_N` samples. The scheduler is never stepped: every queued sample waits.

The hosts act as asyncllm's (processor_requests.py, processor_outputs.py): a request's n samples are sent together
(``<id>#<k>-<i>``, sample 0 counting for all n, the others for none); on a sample's error the host aborts the
request's other unfinished samples (named even when still on their way), on sample 0's processor-cache miss it
resends sample 0 after the samples already sent, or (it cannot) aborts all its unfinished samples, sample 0 too; the
user's abort names the unfinished samples. Each request draws whether its host's abort follows the samples already
sent (they come first) or overtakes them (they never come: the abort must forget them).

`Model` holds the docs' rules (the module docstring, docs/scheduling.md "An n > 1 request is n core requests",
docs/reliability.md on ``num_samples``): sample 0 alone is checked against the queue's limits (the waiting samples,
plus its n, n times its prompt; an empty queue accepts it), the others are queued unchecked; when sample 0 is refused
(for any reason but a processor-cache miss or an id in use) its siblings already here (queued, or parked for a
grammar) end at once with its error, those still to come are remembered and refused on arrival with that same error,
never queued, until they come or the host's abort names them; a resent sample 0 (after a miss) remembers none; the
missed sample 0's key is kept from its miss until it comes again and then until it is queued, refused, failed (its
timeout passed while parked) or aborted; a host leaving leaves nothing; `queued` counts each host's samples queued or
parked (sample 0 for its n). After every operation the real core must match: every error delta sent (its id, type
and message: a sibling's is sample 0's) and every timeout, the scheduler's requests and queue, the parked requests in
order, the samples remembered as refused (with their error), the missed sample 0s kept, each host's count. When all
is settled (every message delivered, every request finished) the module's tables are empty, and an id used again by a
new request is served as new.
Explicit cases reach what drawn ones seldom do. Mutation runs: ``SAMPLE_GROUPS_NO_SHRINK=1`` runs without shrinking.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from asyncllm import SamplingParams, StructuredOutputs, protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.client_liveness import ClientLiveness
from asyncllm.engine.core import EngineCore
from asyncllm.engine.lora_ids import HostLoRAIds
from asyncllm.engine.request_keys import host_tag, request_key
from asyncllm.engine.sample_groups import SampleGroups, sample_ids
from asyncllm.engine.validation import MAX_N
from asyncllm.mm.cache import MultiModalCacheMiss
from asyncllm.sched.scheduler import Scheduler
from asyncllm.structured.manager import StructuredOutputManager
from test_core_validation import VOCAB

xgr = pytest.importorskip("xgrammar")

HOSTS = 2
BASES = 3
"""Request ids per host (``q<j>#1``), used again by new requests once the old one is settled."""
PROMPTS = {"short": [1, 2, 3], "long": [5] * 40, "bad": [1, VOCAB, 3], "huge": [4] * 300}
"""``bad``: a token outside the vocabulary (`check_add_request`); ``huge``: more than the KV cache's 256 tokens
(the scheduler's `check_request`, after the processor cache's fill)."""
GRAMMAR = StructuredOutputs(choice=["x"])
MISS = "key-only"
"""The multimodal item of a sample 0 drawn to miss the processor cache (the fake cache misses every such item)."""

settings.register_profile("sample_groups_mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("SAMPLE_GROUPS_NO_SHRINK"):
    settings.load_profile("sample_groups_mutations")


@dataclass(eq=False)
class Err:
    """An expected error delta: its type, how its message begins and what it holds; `text` is learned from the first
    delta of it (sample 0's), which every other delta of it (a sibling's) must repeat."""

    type: str
    prefix: str = ""
    holds: tuple[str, ...] = ()
    text: str | None = None

    def check(self, key: str, error_type: str, error: str) -> None:
        assert error_type == self.type and error.startswith(self.prefix), (key, error_type, error, self)
        assert all(part in error for part in self.holds), (key, error, self.holds)
        if self.text is None:
            self.text = error
        assert error == self.text, (key, error, self.text)  # a sibling ends with sample 0's error


class Timeout:
    """An expected "timeout" delta: a parked request whose own timeout passed (no error; its host has it finished)."""


TIMEOUT = Timeout()


@dataclass(eq=False)
class Sample:
    """One core request as the core receives it."""

    client: bytes
    key: str
    num_samples: int
    prompt: str
    structured: bool
    siblings: list[str]
    """Sample 0 of an n > 1 request: the keys of the others; [] for any other."""
    timeout: float | None = None
    deadline: float | None = None
    """Parked: when its own timeout ends its wait for the grammar."""
    compiled: bool = False
    """Parked: its grammar has compiled."""

    @property
    def tokens(self) -> int:
        return len(PROMPTS[self.prompt])


class Model:
    """The core's n > 1 requests by the docs' rules: what is queued, parked, remembered, and the errors sent."""

    def __init__(self, max_requests: int | None, max_tokens: int | None) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.queued: dict[str, Sample] = {}
        """In the scheduler (never stepped: all waiting)."""
        self.parked: dict[str, Sample] = {}
        """Waiting for their grammar, in arrival order."""
        self.to_come: dict[str, Err] = {}
        """Samples still to come whose sample 0 was refused: its error."""
        self.missed: set[str] = set()
        """n > 1 sample 0s that missed the processor cache, kept until they come again and are queued, refused or
        aborted."""
        self.counted: dict[bytes, int] = {}
        self.now = 0.0
        """The clock of the parked requests' timeouts."""
        self.expected: dict[str, Err | Timeout] = {}
        """This operation's error deltas, by key."""

    def over_limits(self, s: Sample) -> str | None:
        """The limit sample 0 (the n samples it counts for) would pass, as its refusal begins; None: it fits."""
        if not s.num_samples or not self.queued:  # an empty queue accepts any request
            return None
        if self.max_requests is not None and len(self.queued) + s.num_samples > self.max_requests:
            return f"max_num_queued_requests={self.max_requests}"
        waiting = sum(q.tokens for q in self.queued.values())
        if self.max_tokens is not None and waiting + s.num_samples * s.tokens > self.max_tokens:
            return f"max_num_queued_tokens={self.max_tokens}"
        return None

    def arrive(self, s: Sample, miss: bool) -> None:
        """A sample arrives: refused as its sample 0 was, refused for its prompt, missed, parked, or added."""
        err = self.to_come.pop(s.key, None)
        if err is not None:
            self.expected[s.key] = err
        elif s.prompt == "bad":
            self.refuse(s, Err("InvalidRequestError", "prompt: token ids must be in"))
        elif miss:  # no refusal: its host resends it
            self.expected[s.key] = Err("MultiModalCacheMiss", "mm_items: ")
            if s.siblings:
                self.missed.add(s.key)
        elif s.structured:
            s.deadline = None if s.timeout is None else self.now + s.timeout
            self.parked[s.key] = s
            self.count(s)
        elif self.add(s):
            self.count(s)

    def count(self, s: Sample) -> None:
        self.counted[s.client] = self.counted.get(s.client, 0) + s.num_samples

    def add(self, s: Sample) -> bool:
        """The scheduler's `add_request`: a prompt it can never run, then the queue's limits (sample 0 alone)."""
        if s.prompt == "huge":
            self.refuse(s, Err("InvalidRequestError", "prompt: 300 tokens"))
            return False
        over = self.over_limits(s)
        if over is not None:
            self.refuse(s, Err("EngineOverloadedError", over, (f"n={s.num_samples}",) if s.siblings else ()))
            return False
        self.queued[s.key] = s
        self.missed.discard(s.key)
        return True

    def refuse(self, s: Sample, err: Err) -> None:
        """`s` refused with `err`; sample 0's siblings here end with it, those to come are remembered (none for a
        sample 0 resent after its miss: its siblings all came before it)."""
        resent = s.key in self.missed
        self.missed.discard(s.key)
        self.expected[s.key] = err
        for sibling in s.siblings:
            if self.queued.pop(sibling, None) or self.parked.pop(sibling, None):
                self.expected[sibling] = err
            elif not resent:
                self.to_come[sibling] = err

    def admit(self) -> None:
        """The core's turn: the parked requests whose timeout passed end ("timeout"; a missed sample 0 is no longer
        kept), those whose grammar compiled are added in arrival order, the others wait (here for a refusal of their
        sample 0)."""
        ready = []
        for key, s in list(self.parked.items()):
            if s.deadline is not None and self.now >= s.deadline:
                del self.parked[key]
                self.expected[key] = TIMEOUT
                self.missed.discard(key)
            elif s.compiled:
                del self.parked[key]
                ready.append(s)
        for s in ready:
            err = self.to_come.pop(s.key, None)
            if err is not None:
                self.expected[s.key] = err
            else:
                self.add(s)

    def abort(self, keys: list[str]) -> None:
        for key in keys:
            self.queued.pop(key, None)
            self.parked.pop(key, None)
            self.to_come.pop(key, None)
            self.missed.discard(key)

    def detach(self, client: bytes) -> None:
        tag = host_tag(client)
        self.abort([key for key in [*self.queued, *self.parked, *self.to_come, *self.missed] if key.startswith(tag)])
        self.counted.pop(client, None)

    def keys_of(self, keys: list[str]) -> bool:
        return any(key in self.queued or key in self.parked or key in self.to_come or key in self.missed
                   for key in keys)


@dataclass(eq=False)
class HostRequest:
    """A host's request: its messages on their way to the core and its unfinished samples (as the host tracks them)."""

    base: str
    n: int
    prompt: str
    structured: bool
    miss: bool
    resend_fails: bool
    overtake: bool
    """Its host's abort overtakes the samples still on their way (they never come)."""
    timeout: float | None = None
    outbox: list[tuple] = field(default_factory=list)
    unfinished: set[int] = field(default_factory=set)

    @property
    def ids(self) -> list[str]:
        return sample_ids(self.base, self.n)


@dataclass(eq=False)
class Host:
    client: bytes
    requests: dict[int, HostRequest] = field(default_factory=dict)
    """Base index -> its latest request."""


def _fill(client_id: bytes, message: protocol.AddRequest) -> None:
    """The core's processor cache, which has none of the items sent without data."""
    raise MultiModalCacheMiss("mm_items", "not in the core's processor cache: img")


class _Grammars:
    """A grammar compile pool whose jobs are done when the test says (`compile_all`; the matcher is faked too)."""

    ready_since = None

    def __init__(self) -> None:
        self.compiling: list[Future] = []

    def submit(self, structured: StructuredOutputs, client_id: bytes = b"") -> Future:
        future: Future = Future()
        self.compiling.append(future)
        return future

    def compile_all(self) -> None:
        for future in self.compiling:
            future.set_result("grammar")
        self.compiling.clear()

    def release(self, structured, future, still_wanted: bool) -> None:
        pass


def _core(max_requests: int | None, max_tokens: int | None, sent: list, now: list[float]) -> EngineCore:
    """An `EngineCore` with a real scheduler (64 blocks of 4 tokens) and structured-output manager, no executor."""
    core = EngineCore.__new__(EngineCore)
    core.config = EngineConfig.create("dummy-model", block_size=4, max_num_queued_requests=max_requests,
                                      max_num_queued_tokens=max_tokens)
    core.executor, core.tasks, core.clients = SimpleNamespace(vocab_size=VOCAB), None, set()
    core.lora_ids, core.liveness, core.overlap = HostLoRAIds(), ClientLiveness(), None
    core.mm_cache, core.stats_reporter = SimpleNamespace(fill=_fill, detach=lambda client_id: None), None
    core.io = SimpleNamespace(send=lambda client, outputs: sent.extend((client, d) for d in outputs.outputs))
    core.scheduler = Scheduler(core.config, 64, 256, clock=lambda: 0.0)
    core.structured = StructuredOutputManager("unused", VOCAB, 30.0, clock=lambda: now[0])
    core.structured._compilers = _Grammars()  # type: ignore[assignment]
    core.samples = SampleGroups(core)
    return core


class Driver:
    """The real core and the model side by side, with the hosts that use them."""

    def __init__(self, max_requests: int | None, max_tokens: int | None) -> None:
        self.sent: list[tuple[bytes, protocol.RequestOutputDelta]] = []
        self.now = [0.0]
        self.core = _core(max_requests, max_tokens, self.sent, self.now)
        self.model = Model(max_requests, max_tokens)
        self.hosts = [Host(f"h{h}".encode()) for h in range(HOSTS)]
        self.core.clients.update(host.client for host in self.hosts)
        self.renamed = 0

    # ------------------------------------------------------------ operations
    def submit(self, h: int, j: int, n: int, prompt: str, structured: bool, miss: bool, resend_fails: bool,
               overtake: bool, timeout: float | None) -> None:
        """A new request of id ``q<j>#1`` (once its last one is settled: an id used again), all its samples sent;
        `timeout` counts while a sample waits for its grammar."""
        host = self.hosts[h]
        old = host.requests.get(j)
        if old is not None and not self._settled(host, old):
            return
        request = HostRequest(f"q{j}#1", n, prompt, structured, miss, resend_fails, overtake, timeout)
        request.outbox = [("add", i, False) for i in range(n)]
        request.unfinished = set(range(n))
        host.requests[j] = request

    def _settled(self, host: Host, request: HostRequest) -> bool:
        keys = [request_key(host.client, core_id) for core_id in request.ids]
        return not request.outbox and not request.unfinished and not self.model.keys_of(keys)

    def deliver(self, h: int, index: int) -> None:
        """The next message of one of host `h`'s requests arrives at the core."""
        host = self.hosts[h]
        busy = [request for request in host.requests.values() if request.outbox]
        if not busy:
            return
        request = busy[index % len(busy)]
        message = request.outbox.pop(0)
        if message[0] == "abort":
            ids = message[1]
            self.model.abort([request_key(host.client, core_id) for core_id in ids])
            self.core._handle(host.client, protocol.AbortRequests(ids))
            return
        _, i, resent = message
        ids = request.ids
        keys = [request_key(host.client, core_id) for core_id in ids]
        num_samples = request.n if i == 0 else 0
        sample = Sample(host.client, keys[i], num_samples, request.prompt, request.structured,
                        keys[1:] if i == 0 and request.n > 1 else [], request.timeout)
        miss = request.miss and i == 0 and not resent
        self.model.arrive(sample, miss)
        self.core._handle(host.client, protocol.AddRequest(
            ids[i], list(PROMPTS[request.prompt]), SamplingParams(max_tokens=2, structured=GRAMMAR if
                                                                  request.structured else None),
            [2], time.time(), timeout=request.timeout, num_samples=num_samples, mm_items=[MISS] if miss else []))

    def compile(self) -> None:
        """Every grammar sent so far has compiled (the compile threads)."""
        self.core.structured._compilers.compile_all()
        for s in self.model.parked.values():
            s.compiled = True

    def admit(self) -> None:
        """The core's turn with requests parked for their grammar (`EngineCore.run_once`)."""
        self.model.admit()
        self.sent.extend(self.core.samples.admit_compiled())

    def wait(self) -> None:
        """Ten seconds pass: the parked requests whose own timeout passed end at the core's next turn."""
        self.now[0] += 10.0
        self.model.now += 10.0

    def finish(self, h: int, index: int) -> None:
        """A queued sample of host `h` finishes (the scheduler ends it; the module is not told)."""
        tag = host_tag(self.hosts[h].client)
        keys = sorted(key for key in self.model.queued if key.startswith(tag))
        if not keys:
            return
        key = keys[index % len(keys)]
        self.model.queued.pop(key)
        self.core.scheduler.finish_requests([key])
        self.core.structured.drop([key])
        found = self._request_of(self.hosts[h], key[len(tag):])
        if found is not None:
            found[0].unfinished.discard(found[1])

    def abort(self, h: int, index: int) -> None:
        """The user aborts one of host `h`'s requests: its host aborts the unfinished samples."""
        host = self.hosts[h]
        live = [request for request in host.requests.values() if request.unfinished]
        if live:
            request = live[index % len(live)]
            self._host_aborts(request, sorted(request.unfinished))

    def detach(self, h: int, same_id: bool) -> None:
        """Host `h` leaves (`Goodbye`) and attaches again, under its old client id or (not `same_id`) a new one."""
        host = self.hosts[h]
        self.core._handle(host.client, protocol.Goodbye())
        self.model.detach(host.client)
        host.requests.clear()
        if not same_id:
            host.client = host.client + b".1"
        self.core.clients.add(host.client)

    def duplicate(self, h: int, index: int) -> None:
        """Host `h` (a faulty peer) sends an id in use again: refused alone, nothing else changes."""
        tag = host_tag(self.hosts[h].client)
        live = sorted(key for key in [*self.model.queued, *self.model.parked] if key.startswith(tag))
        if not live:
            return
        key = live[index % len(live)]
        s = self.model.queued.get(key) or self.model.parked[key]
        self.model.expected[key] = Err("InvalidRequestError", "request_id: ", ("already used",))
        self.core._handle(s.client, protocol.AddRequest(key[len(tag):], [1, 2, 3], SamplingParams(
            max_tokens=2, structured=GRAMMAR if s.structured else None), [2], time.time(), num_samples=s.num_samples))

    def oversize(self, h: int, j: int) -> None:
        """A sample 0 counting for more than `MAX_N` samples (a peer that is not our host): refused, never
        expanded (no sibling remembered)."""
        self.model.expected[request_key(self.hosts[h].client, f"big{j}#1-0")] = Err("InvalidRequestError",
                                                                                   "num_samples: ")
        self.core._handle(self.hosts[h].client, protocol.AddRequest(
            f"big{j}#1-0", [1, 2, 3], SamplingParams(max_tokens=2), [2], time.time(), num_samples=MAX_N + 1))

    # ------------------------------------------------------------ the hosts' answers
    def _request_of(self, host: Host, core_id: str) -> tuple[HostRequest, int] | None:
        for request in host.requests.values():
            if core_id in request.ids:
                return request, request.ids.index(core_id)
        return None

    def _host_aborts(self, request: HostRequest, indices: list[int]) -> None:
        """The host aborts these samples: after the messages on their way, or overtaking them (never sent)."""
        request.unfinished = set()
        if request.overtake:
            request.outbox.clear()
        if indices:
            request.outbox.append(("abort", [request.ids[i] for i in indices]))

    def _answer(self, client: bytes, delta: protocol.RequestOutputDelta) -> None:
        """processor_outputs.py's `_on_delta`: a miss resent (or the request failed), an error fails the request."""
        host = next((host for host in self.hosts if host.client == client), None)
        found = None if host is None else self._request_of(host, delta.request_id)
        if found is None or found[1] not in found[0].unfinished:
            return
        request, i = found
        if delta.error is None:  # its timeout passed while it waited for its grammar: finished
            request.unfinished.discard(i)
            return
        if delta.error_type == "MultiModalCacheMiss":
            if not request.resend_fails:
                request.outbox.append(("add", i, True))  # after the samples already sent
                return
            self._host_aborts(request, sorted(request.unfinished))  # sample 0 too: the core forgets its miss
            return
        self._host_aborts(request, sorted(request.unfinished - {i}))

    # ------------------------------------------------------------ comparison
    def after(self, answered: bool = True) -> None:
        """This operation's error deltas are the model's; the hosts answer them; then the state is compared."""
        got: dict[str, tuple[bytes, protocol.RequestOutputDelta]] = {}
        for client, delta in self.sent:
            key = delta.request_id if delta.request_id.startswith(host_tag(client)) else request_key(
                client, delta.request_id)  # admit_compiled's are keys, sent ones the host's ids
            assert key not in got, key
            expected = self.model.expected.get(key)
            finish_reason = "timeout" if expected is TIMEOUT else "abort"
            assert (delta.error is None) == (expected is TIMEOUT) and delta.finish_reason == finish_reason, delta
            assert not delta.new_token_ids, delta
            got[key] = (client, delta)
        assert set(got) == set(self.model.expected), (sorted(got), sorted(self.model.expected))
        for key, (client, delta) in got.items():
            expected = self.model.expected[key]
            if isinstance(expected, Err):
                expected.check(key, delta.error_type, delta.error)
        self.model.expected.clear()
        deltas, self.sent[:] = list(self.sent), []
        if answered:
            for client, delta in deltas:
                tag = host_tag(client)
                self._answer(client, delta if not delta.request_id.startswith(tag) else protocol.RequestOutputDelta(
                    delta.request_id[len(tag):], [], "abort", error=delta.error, error_type=delta.error_type))
        self.check()

    def check(self) -> None:
        """The core's requests, queue, parked requests, remembered refusals, kept misses and counts: the model's."""
        core, model, samples = self.core, self.model, self.core.samples
        assert set(core.scheduler.requests) == set(model.queued)
        assert len(core.scheduler.waiting) == len(model.queued)
        assert core.scheduler.waiting.num_tokens == sum(s.tokens for s in model.queued.values())
        assert list(core.structured.pending) == list(model.parked)
        refused = {key: (type(exc).__name__, str(exc)) for key, exc in samples._refused.items()}
        assert refused == {key: (err.type, err.text) for key, err in model.to_come.items()}
        assert samples._missed | samples._resent == model.missed
        assert {c: v for c, v in samples.queued.items() if v} == {c: v for c, v in model.counted.items() if v}
        assert set(samples.queued) <= core.clients

    def settle(self) -> None:
        """Every message delivered, every grammar admitted, every sample finished: nothing remembered; then every
        host leaves: no count left."""
        for _ in range(10_000):
            busy = [(h, request) for h, host in enumerate(self.hosts) for request in host.requests.values()
                    if request.outbox]
            if busy:
                h, request = busy[0]
                self.deliver(h, list(r for r in self.hosts[h].requests.values() if r.outbox).index(request))
            elif self.model.parked:
                self.compile()
                self.admit()
            elif self.model.queued:
                key = next(iter(self.model.queued))
                self.finish(next(h for h, host in enumerate(self.hosts) if key.startswith(host_tag(host.client))), 0)
            else:
                break
            self.after()
        samples = self.core.samples
        assert samples._refused == {} and samples._missed == samples._resent == set()
        assert not self.model.to_come and not self.model.missed
        assert self.core.scheduler.requests == {} and self.core.structured.pending == {}
        assert self.core.structured.matchers == {}
        for h in range(HOSTS):
            self.detach(h, True)
        assert samples.queued == {}


def run(max_requests: int | None, max_tokens: int | None, ops: list[tuple]) -> None:
    with mock.patch.object(xgr, "GrammarMatcher", lambda grammar, **kwargs: SimpleNamespace(grammar=grammar)):
        driver = Driver(max_requests, max_tokens)
        for kind, *args in ops:
            getattr(driver, kind)(*args)
            driver.after(answered=kind not in ("duplicate", "oversize"))
        driver.settle()


HOST = st.integers(0, HOSTS - 1)
INDEX = st.integers(0, 5)
SUBMIT = st.tuples(st.just("submit"), HOST, st.integers(0, BASES - 1), st.sampled_from([1, 2, 3, 3, 4]),
                   st.sampled_from(["short"] * 4 + ["long"] * 2 + ["bad", "huge"]), st.booleans(),
                   st.booleans(), st.sampled_from([False, False, False, True]),
                   st.sampled_from([False, False, True]), st.sampled_from([None, None, 5.0, 15.0]))
OPS = st.one_of(*[st.tuples(st.just("deliver"), HOST, INDEX)] * 7, *[SUBMIT] * 3,
                *[st.just(("admit",))] * 2, *[st.just(("compile",))] * 2, st.just(("wait",)),
                *[st.tuples(st.just("finish"), HOST, INDEX)] * 2,
                st.tuples(st.just("abort"), HOST, INDEX), st.tuples(st.just("detach"), HOST, st.booleans()),
                st.tuples(st.just("duplicate"), HOST, INDEX), st.tuples(st.just("oversize"), HOST, st.integers(0, 1)))


def _sub(h: int, j: int, n: int, prompt: str = "short", structured: bool = False, miss: bool = False,
         resend_fails: bool = False, overtake: bool = False, timeout: float | None = None) -> tuple:
    return ("submit", h, j, n, prompt, structured, miss, resend_fails, overtake, timeout)


D0 = ("deliver", 0, 0)
"""The next message of host 0's first request with one on its way."""


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limits=st.tuples(st.sampled_from([None, 2, 4]), st.sampled_from([None, 30, 80])),
       ops=st.lists(OPS, min_size=10, max_size=80))
# the queue full (3 requests): sample 0 of an n=3 request refused for its n; its siblings on their way refused on
# arrival with its error, never queued; the host's abort after them; the id used again (n=2) is served as new
@example(limits=(3, None), ops=[_sub(0, 0, 1), D0, _sub(0, 1, 3), D0, D0, D0, D0, _sub(0, 1, 2), ("deliver", 0, 1),
                                ("deliver", 0, 1)])
# a bad prompt: the abort overtakes the siblings, which never come: remembered until it arrives, then forgotten;
# the id used again with a good prompt is queued whole
@example(limits=(None, None), ops=[_sub(0, 0, 3, "bad", overtake=True), D0, D0, _sub(0, 0, 3), D0, D0, D0])
# sample 0 misses the processor cache; its siblings come and are queued, one finishes; the resent sample 0 is refused
# (the queue's tokens, for its n): the one queued ends at once, none is remembered (the finished one never comes)
@example(limits=(None, 50), ops=[_sub(1, 0, 1, "long"), ("deliver", 1, 0), _sub(0, 0, 3, "long", miss=True), D0,
                                 D0, ("finish", 0, 0), D0, D0])
# sample 0 misses and its host cannot resend it: its abort names sample 0 with the siblings; the core forgets its miss
@example(limits=(None, None), ops=[_sub(0, 0, 2, miss=True, resend_fails=True), D0, D0, D0])
# with a grammar: sample 0 compiled, admitted and refused (the requests' limit) while its sibling parked after it still
# compiles: that one ends at once, the one still to come is refused on arrival; a resent sample 0 parked for its
# grammar is kept until admitted (refused: its sibling queued ends at once)
@example(limits=(3, None), ops=[_sub(1, 0, 2), ("deliver", 1, 0), _sub(0, 0, 3, structured=True), D0, ("compile",),
                                D0, ("admit",), D0, D0, _sub(0, 1, 2, structured=True, miss=True), D0, D0,
                                ("compile",), ("admit",), D0, ("deliver", 1, 0), ("compile",), ("admit",)])
# a resent sample 0 parked for its grammar: kept until its own timeout ends it there ("timeout", failed)
@example(limits=(None, None), ops=[_sub(0, 0, 2, structured=True, miss=True, timeout=5.0), D0, D0, ("compile",),
                                   ("admit",), D0, ("wait",), ("admit",)])
# a resent sample 0 parked for its grammar: kept until the user's abort names it; another until its host leaves
@example(limits=(None, None), ops=[_sub(0, 0, 2, structured=True, miss=True), D0, D0, D0, ("abort", 0, 0), D0,
                                   _sub(1, 0, 3, structured=True, miss=True), *[("deliver", 1, 0)] * 4,
                                   ("detach", 1, False)])
# a host leaves with siblings remembered and a miss kept; back under its id, its ids are new requests
@example(limits=(3, None), ops=[_sub(0, 0, 1), D0, _sub(0, 1, 3), ("deliver", 0, 1), _sub(0, 2, 2, miss=True),
                                ("deliver", 0, 1), ("detach", 0, True), _sub(0, 1, 3), _sub(0, 2, 2), D0, D0, D0, D0,
                                D0])
# a prompt longer than the KV cache, resent after a miss: each sibling refused alone, the host fails the request on
# the first; a resent sample 0 parked for its grammar, then sent again while in use: refused alone, its miss still
# kept; a sample 0 counting for more than MAX_N: refused, nothing remembered
@example(limits=(None, None), ops=[_sub(0, 0, 3, "huge", miss=True), D0, D0, D0, D0, D0,
                                   _sub(0, 1, 2, structured=True, miss=True), D0, D0, D0, ("duplicate", 0, 0),
                                   ("oversize", 0, 0), ("compile",), ("admit",)])
def test_sample_groups_follow_the_docs(limits: tuple[int | None, int | None], ops: list[tuple]) -> None:
    run(*limits, ops)
