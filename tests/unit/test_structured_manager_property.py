"""`StructuredOutputManager` under drawn steps (hypothesis), driven as the engine core and the scheduler drive it,
against a model that replays each request's tokens into a fresh xgrammar matcher.

Drawn: a speculative depth (0, 2 or 3 drafts), then operations on a 36-token vocabulary (a few letters and digits,
three whitespace tokens, ``<think>`` at id 31, the int32 sign bit, ``</think>``, ``<|channel|>``, ``<|message|>``,
EOS): add one or two structured requests (a regex or choice grammar; no start_after, a one- or two-token
``start_after_token_ids``, gpt-oss's marker with a suffix, or mistral's opener and glm45's opener after whitespace;
allowed_token_ids or bad_words; ignore_eos; max_tokens), compiled by the real compile pool over that vocabulary and
polled in; abort a request (the core's `drop`, or just gone from the scheduler); and steps. A step schedules some
running requests and a free one, some as a prefill chunk that samples nothing, the others with drawn drafts; asks
for the step's `grammar_bitmask`; then `accept`s, per sampling request, a drawn number of its drafts and a bonus
token (mostly ones the masks let through, sometimes any; where the grammar may end, often EOS or a token it refuses,
as the workers sample when allowed_token_ids or bad_words leave the grammar nothing), cut at EOS (unless
ignore_eos) or max_tokens as the scheduler cuts them.

The model splits a request's output by the rules of the manager's docstring and docs/sampling.md#structured-output
into free text and the grammar's tokens (no start_after: all; else those after the marker; with an opener, the first
token other than whitespace decides). Checked after every step: each sampling request's rows and positions equal a
fresh matcher's fed its grammar tokens and the drafts before each position (an undecided one's with the opener and
the whitespace allowed too; none while it waits, after a draft the grammar refuses, or after one that ended it);
`accept` leaves each delta as the rules say (its tokens, finish reason, stop reason, error, and logprobs rows: each
delta drawn with or without a row per token, and with the stop token as its stop reason or none when it ends "stop";
a cut delta keeps the rows of the tokens it keeps, a request the manager ends "stop" has no stop reason): "stop" when
the grammar ended, a refused token failing its request with
`narrowing.rejection`'s error, or ending it "stop" before that token where allowed_token_ids / bad_words are set and
the grammar may end; the finished requests handed to `finish`; the free request untouched; and the matchers and
start_after waits held exactly for the requests that still need them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import SamplingParams, StructuredOutputs, protocol
from asyncllm.sched.request import Request
from asyncllm.structured.narrowing import rejection

xgr = pytest.importorskip("xgrammar")

VOCAB = ["a", "b", "c", "ab", "ba", "0", "1", "10", "x", "y", " ", "\n", "  "] + [f"q{i}" for i in range(18)] + [
    "<think>", "</think>", "<|channel|>", "<|message|>", "</s>"]
A, B, C, AB, BA, ZERO, ONE, TEN, X, Y, SPACE, NEWLINE, SPACES = range(13)
OPENER, CLOSER, CHANNEL, MESSAGE, EOS = range(31, 36)
SPACE_TOKENS = frozenset({SPACE, NEWLINE, SPACES})
ANY = [A, B, C, AB, BA, ZERO, ONE, TEN, X, Y, SPACE, NEWLINE, SPACES, 13, OPENER, CLOSER, CHANNEL, MESSAGE, EOS]
PROMPT = [A, B, C]

GRAMMARS = {  # name: (the request's constraint, the model's own compile of the same language)
    "ab+": (dict(regex="(a|b)+"), lambda c: c.compile_regex("(a|b)+")),
    "x01y": (dict(regex="x[01]{1,3}y"), lambda c: c.compile_regex("x[01]{1,3}y")),
    "ab2-4": (dict(regex="[ab]{2,4}"), lambda c: c.compile_regex("[ab]{2,4}")),
    "choice": (dict(choice=["ab", "b a", "x10y"]), lambda c: c.compile_grammar('root ::= "ab" | "b a" | "x10y"')),
}
UNDECIDED, WAITING, GRAMMAR = "undecided", "waiting", "grammar"


@dataclass(frozen=True)
class Wait:
    """A start_after marker: `ids`, then `suffix` with fewer than `between` tokens between; `opener`: the output's first
    token decides (mistral's), `after_space`: whitespace before it does not (glm45's)."""

    ids: tuple[int, ...]
    suffix: tuple[int, ...] = ()
    between: int = 0
    opener: bool = False
    after_space: bool = False

    def fields(self) -> dict:
        fields = dict(start_after="</think>", start_after_token_ids=list(self.ids))
        if self.suffix:
            fields.update(start_after_suffix="<|message|>", start_after_suffix_token_ids=list(self.suffix),
                          start_after_max_between=self.between)
        if self.opener:
            fields.update(start_after_only_if_reply_opens=True, start_after_opener_token_ids=[OPENER],
                          start_after_opener_after_space=self.after_space)
        return fields


WAITS = [None, Wait((CLOSER,)), Wait((Y, CLOSER)), Wait((CHANNEL,), (MESSAGE,), 2), Wait((CLOSER,), opener=True),
         Wait((CLOSER,), opener=True, after_space=True)]
NARROWING = {None: {}, "allowed_token_ids": {"allowed_token_ids": [A, B, X]},
             "bad_words": {"bad_words_token_ids": [[EOS]]}}


@functools.cache
def tokenizer_info():
    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[EOS])


@functools.cache
def reference_grammar(name: str):
    return GRAMMARS[name][1](xgr.GrammarCompiler(tokenizer_info(), max_threads=1, cache_enabled=False))


@pytest.fixture(scope="module")
def pool():
    """The real compile pool, its vocabulary ours (no model folder): shared by the examples, its cache too."""
    from asyncllm.structured.compiler import GrammarCompilerPool

    pool = GrammarCompilerPool("unused", len(VOCAB))
    pool._tokenizer_info = tokenizer_info()
    pool._compiler = xgr.GrammarCompiler(tokenizer_info(), max_threads=1, cache_enabled=False)
    pool.ready_since = 0.0
    yield pool
    pool.shutdown()


# ------------------------------------------------------------ the model
@dataclass
class Live:
    """A structured request the scheduler runs, as the model sees it."""

    request: Request
    grammar: str
    wait: Wait | None
    narrowed: str | None
    ignore_eos: bool
    max_tokens: int
    output: list[int] = field(default_factory=list)


def marker_end(wait: Wait, tokens: list[int]) -> int | None:
    """The length of the shortest prefix of `tokens` that ends with the marker (None: none does)."""
    for end in range(1, len(tokens) + 1):
        head = tokens[:end]
        if not wait.suffix:
            if tuple(head[-len(wait.ids):]) == wait.ids:
                return end
            continue
        s = end - len(wait.suffix)
        if s >= 0 and tuple(head[s:]) == wait.suffix and any(
                tuple(head[i:i + len(wait.ids)]) == wait.ids and 0 <= s - i - len(wait.ids) < wait.between
                for i in range(s)):
            return end
    return None


def split(wait: Wait | None, output: list[int]) -> tuple[str, list[int]]:
    """(undecided, waiting or grammar; the grammar's tokens) of an output, from its first token."""
    if wait is None:
        return GRAMMAR, output
    start = 0
    if wait.opener:
        while wait.after_space and start < len(output) and output[start] in SPACE_TOKENS:
            start += 1
        if start == len(output):
            return UNDECIDED, []
        if output[start] != OPENER:
            return GRAMMAR, output[start:]
    end = marker_end(wait, output[start:])
    return (WAITING, []) if end is None else (GRAMMAR, output[start + end:])


def fed(grammar: str, tokens: list[int]):
    """A fresh matcher fed `tokens` up to the first it refuses; (the matcher, that token's index or None)."""
    matcher = xgr.GrammarMatcher(reference_grammar(grammar), override_stop_tokens=[EOS])
    return matcher, next((k for k, token in enumerate(tokens) if not matcher.accept_token(token)), None)


def allowed_by(matcher) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    matcher.fill_next_token_bitmask(bitmask, 0)
    return allowed_in(bitmask[0].numpy())


def allowed_in(words) -> set[int]:
    return {t for t in range(len(VOCAB)) if int(words[t // 32]) >> (t % 32) & 1}


def expected_rows(live: Live, drafts: list[int]) -> list[tuple[int, set[int]]]:
    """(position, allowed tokens) of each row: a fresh matcher fed the grammar's tokens before that position."""
    rows = []
    for position in range(len(drafts) + 1):
        phase, grammar_tokens = split(live.wait, live.output + drafts[:position])
        matcher, refused = fed(live.grammar, grammar_tokens)
        if refused is not None or (phase == GRAMMAR and position and matcher.is_terminated()):
            break
        if phase == WAITING:
            continue
        allowed = allowed_by(matcher)
        if phase == UNDECIDED:
            allowed |= {OPENER} | (SPACE_TOKENS if live.wait.after_space else set())
        rows.append((position, allowed))
    return rows


def likely_next(live: Live, tokens: list[int]) -> list[int]:
    """The tokens the masks would let through after `tokens` (the marker's while it waits)."""
    phase, grammar_tokens = split(live.wait, tokens)
    if phase == WAITING:  # mostly the marker's next token
        marker = live.wait.ids + live.wait.suffix
        written = max(k for k in range(len(marker)) if k == 0 or tuple(tokens[-k:]) == marker[:k])
        return [marker[written]] * 3 + [A, OPENER]
    matcher, refused = fed(live.grammar, grammar_tokens)
    if refused is not None or matcher.is_terminated():
        return []
    allowed = allowed_by(matcher)
    return sorted(allowed | ({OPENER} | SPACE_TOKENS if phase == UNDECIDED else set()))


def expected_accept(live: Live, new: list[int], reason: str | None):
    """(the request's deltas after `accept`, whether it is finished by `accept`, whether it ended)."""
    client, req_id = live.request.client_id, live.request.request_id
    phase, grammar_tokens = split(live.wait, live.output + new)
    matcher, refused = fed(live.grammar, grammar_tokens)
    if refused is not None:
        head, _ = fed(live.grammar, grammar_tokens[:refused])
        kept = new[:len(new) - (len(grammar_tokens) - refused)]
        if head.is_terminated():  # drafts past its EOS (ignore_eos): dropped, it ends "stop" on the EOS
            return [(client, req_id, kept, "stop", None)], reason is None, True
        if live.narrowed and head.accept_token(EOS):  # it may end there: "stop" before the refused token
            deltas = [(client, req_id, kept, "stop" if not kept else None, None)]
            if kept:
                deltas.append((client, req_id, [], "stop", None))
            return deltas, reason is None, True
        error = rejection((live.narrowed,) if live.narrowed else (), grammar_tokens[refused])
        return [(client, req_id, new, reason or "abort", error)], reason is None, True
    if reason is not None:
        return [(client, req_id, new, reason, None)], False, True
    if phase == GRAMMAR and matcher.is_terminated():
        return [(client, req_id, new, "stop", None)], True, True
    return [(client, req_id, new, None, None)], False, False


def logprobs_rows(tokens: list[int]) -> protocol.LogprobsArrays | None:
    """One row per token (its id, a logprob from it, rank 1), as a request with logprobs gets them; None: none."""
    if not tokens:
        return None
    ids = np.array(tokens, dtype=np.int32)
    return protocol.LogprobsArrays(1, ids.tobytes(), (-ids.astype(np.float32)).tobytes(),
                                   np.ones(len(tokens), dtype=np.int32).tobytes())


def rows_of(logprobs: protocol.LogprobsArrays | None) -> list[int] | None:
    return None if logprobs is None else np.frombuffer(logprobs.token_ids, dtype=np.int32).tolist()


def expected_extras(delta: tuple, drawn: tuple[bool, int | None]) -> tuple[list[int] | None, int | None]:
    """A delta's logprobs rows and stop reason after `accept`: the rows of the tokens it keeps (when drawn with
    rows), and the drawn stop reason unless the manager ended it "stop" itself or cut its tokens."""
    tokens = delta[2]
    with_rows, stop_reason = drawn
    return (tokens if with_rows and tokens else None), stop_reason


def scheduler_cut(live: Live, proposed: list[int]) -> tuple[list[int], str | None]:
    """The scheduler's append: up to EOS ("stop", unless ignore_eos) or max_tokens ("length")."""
    kept: list[int] = []
    for token in proposed:
        kept.append(token)
        if token == EOS and not live.ignore_eos:
            return kept, "stop"
        if len(live.output) + len(kept) >= live.max_tokens:
            return kept, "length"
    return kept, None


# ------------------------------------------------------------ driving the manager
class Harness:
    """The manager, the scheduler's requests, and the model: the live requests and the matchers the manager holds."""

    def __init__(self, pool, max_drafts: int) -> None:
        from asyncllm.structured.manager import StructuredOutputManager

        self.manager = StructuredOutputManager("unused", len(VOCAB), compile_timeout_s=600.0, clock=lambda: 0.0,
                                               max_drafts=max_drafts)
        self.manager._compilers = pool
        self.max_drafts = max_drafts
        free = protocol.AddRequest("free", list(PROMPT), SamplingParams(max_tokens=10**6), [EOS], 0.0)
        self.free = Request.from_add_request(free, b"f")
        self.requests: dict[str, Request] = {"free": self.free}
        self.live: dict[str, Live] = {}
        self.holding: set[str] = set()
        """Requests whose matcher the manager still holds (finished or aborted ones until it learns of it)."""
        self.waiting: set[str] = set()
        self.next_id = 0

    def add(self, data) -> None:
        batch: list[Live] = []
        for _ in range(data.draw(st.integers(1, 2), label="added")):
            taken = set(self.live) | {live.request.request_id for live in batch}
            ended = sorted(set(f"r{i}" for i in range(self.next_id)) - taken)
            reuse = ended and data.draw(st.booleans(), label="reuse id")
            req_id = data.draw(st.sampled_from(ended), label="id") if reuse else f"r{self.next_id}"
            self.next_id += not reuse
            batch.append(self.add_one(data, req_id))
        for live in batch:
            self.manager.pending[live.request.request_id].future.result(timeout=60)
        ready, failed = self.manager.poll()
        assert ready == [live.request for live in batch] and failed == []
        for live in batch:
            req_id = live.request.request_id
            self.live[req_id], self.requests[req_id] = live, live.request
            self.holding.add(req_id)
            if live.wait is not None:
                self.waiting.add(req_id)

    def add_one(self, data, req_id: str) -> Live:
        grammar = data.draw(st.sampled_from(sorted(GRAMMARS)), label="grammar")
        wait = data.draw(st.sampled_from([None, *WAITS]), label="start_after")  # None twice as often
        narrowed = data.draw(st.sampled_from(list(NARROWING)), label="narrowing")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        max_tokens = data.draw(st.sampled_from([3, 5, 40]), label="max_tokens")
        structured = StructuredOutputs(**GRAMMARS[grammar][0], **(wait.fields() if wait else {}))
        structured.validate()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, structured=structured,
                                **NARROWING[narrowed])
        client = data.draw(st.sampled_from([b"c0", b"c1"]), label="client")
        request = Request.from_add_request(protocol.AddRequest(req_id, list(PROMPT), params, [EOS], 0.0), client)
        self.manager.drop([req_id])  # the core's, on a free id
        self.holding.discard(req_id)
        self.waiting.discard(req_id)
        self.manager.add(request)
        return Live(request, grammar, wait, narrowed, ignore_eos, max_tokens)

    def abort(self, data) -> None:
        if not self.live:
            return
        req_id = data.draw(st.sampled_from(sorted(self.live)), label="aborted")
        del self.live[req_id], self.requests[req_id]
        if data.draw(st.booleans(), label="drop"):  # the core's abort; else the workers' failure it missed
            self.manager.drop([req_id])
            self.holding.discard(req_id)
            self.waiting.discard(req_id)

    def step(self, data) -> None:
        scheduled = [req_id for req_id in sorted(self.live) if data.draw(st.integers(0, 4), label=req_id)]
        sampling = {req_id: data.draw(st.integers(0, 5), label="samples") > 0 for req_id in scheduled}
        drafts = {req_id: self.draw_drafts(data, self.live[req_id]) for req_id in scheduled if sampling[req_id]}
        free_drafts = data.draw(st.lists(st.sampled_from(ANY), max_size=self.max_drafts), label="free drafts")
        self.check_bitmask(scheduled, sampling, drafts, free_drafts)
        self.check_accept(data, drafts)

    def draw_drafts(self, data, live: Live) -> list[int]:
        drafts: list[int] = []
        for _ in range(data.draw(st.integers(0, self.max_drafts), label="num drafts")):
            drafts.append(self.draw_token(data, live, live.output + drafts))
        return drafts

    @staticmethod
    def draw_token(data, live: Live, tokens: list[int]) -> int:
        """Mostly a token the masks let through; sometimes any; where the grammar may end, sometimes a token it
        refuses (what the workers sample when allowed_token_ids or bad_words leave the grammar nothing)."""
        likely, choice = likely_next(live, tokens), data.draw(st.integers(0, 19), label="allowed?")
        if choice in (1, 2, 3) and EOS in likely:
            return C
        if choice in (4, 5) and EOS in likely:
            return EOS
        if likely and choice:
            return data.draw(st.sampled_from(likely), label="token")
        return data.draw(st.sampled_from(ANY), label="any token")

    def check_bitmask(self, scheduled, sampling, drafts, free_drafts) -> None:
        num_scheduled, spec = {"free": 1 + len(free_drafts)}, {"free": free_drafts} if free_drafts else {}
        self.free.num_computed_tokens = self.free.num_tokens - 1
        for req_id in scheduled:
            request = self.requests[req_id]
            request.num_computed_tokens = request.num_tokens - (1 if sampling[req_id] else 2)  # a chunk: no sample
            num_scheduled[req_id] = 1 + len(drafts.get(req_id, []))
            if drafts.get(req_id):
                spec[req_id] = drafts[req_id]
        sched_out = protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), num_scheduled,
                                             sum(num_scheduled.values()), spec_token_ids=spec)
        got = self.manager.grammar_bitmask(sched_out, self.requests)
        self.holding &= set(self.live)  # it forgets the requests the scheduler no longer holds
        self.waiting &= self.holding
        expected = {req_id: expected_rows(self.live[req_id], proposed) for req_id, proposed in drafts.items()}
        expected = {req_id: rows for req_id, rows in expected.items() if rows}
        if not expected:
            assert got is None
            return
        assert got is not None
        words = np.frombuffer(got.bitmask, dtype=np.int32).reshape(len(got.req_ids), -1)
        assert words.shape[1] == (len(VOCAB) + 31) // 32
        drafted = any(drafts.values())
        positions = got.positions if drafted else [0] * len(got.req_ids)
        assert len(positions) == len(got.req_ids) and (drafted or got.positions == [])
        rows: dict[str, list[tuple[int, set[int]]]] = {}
        for req_id, position, row in zip(got.req_ids, positions, words):
            rows.setdefault(req_id, []).append((position, allowed_in(row)))
        assert rows == expected

    def check_accept(self, data, drafts: dict[str, list[int]]) -> None:
        outputs, expected_outputs, expected_ended, extra = [], [], [], []
        extras: list[tuple[list[int] | None, int | None]] = []
        extra_extras: list[tuple[list[int] | None, int | None]] = []
        for req_id, proposed in drafts.items():
            live = self.live[req_id]
            accepted = proposed[:data.draw(st.sampled_from([len(proposed)]) | st.integers(0, len(proposed)),
                                           label="accepted")]
            new, reason = scheduler_cut(live, accepted + [self.draw_token(data, live, live.output + accepted)])
            with_rows = data.draw(st.booleans(), label="logprobs")
            stop_reason = new[-1] if reason == "stop" and data.draw(st.booleans(), label="stop token") else None
            outputs.append((live.request.client_id, protocol.RequestOutputDelta(
                req_id, list(new), reason, stop_reason, logprobs=logprobs_rows(new) if with_rows else None)))
            deltas, finished, ended = expected_accept(live, new, reason)
            cut = deltas[0][2] != new or (deltas[0][3] == "stop" and reason != "stop") or len(deltas) > 1
            extras.append(expected_extras(deltas[0], (with_rows, None if cut else stop_reason)))
            expected_outputs.append(deltas[0])
            extra += deltas[1:]
            extra_extras += [(None, None)] * len(deltas[1:])
            expected_ended += [req_id] if finished else []
            self.record(live, new, ended)
        free_new = data.draw(st.lists(st.sampled_from(ANY), min_size=1, max_size=1 + self.max_drafts), label="free")
        outputs.append((b"f", protocol.RequestOutputDelta("free", list(free_new))))
        expected_outputs.append((b"f", "free", free_new, None, None))
        extras.append((None, None))
        finished: list[list[str]] = []
        self.manager.accept(outputs, finished.append)
        got = [(client, d.request_id, d.new_token_ids, d.finish_reason, d.error) for client, d in outputs]
        assert got == expected_outputs + extra
        assert [(rows_of(d.logprobs), d.stop_reason) for _, d in outputs] == extras + extra_extras
        assert finished == ([expected_ended] if expected_ended else [])

    def record(self, live: Live, new: list[int], ended: bool) -> None:
        """The model after a step: an ended request gone (its matcher too), a running one's output longer."""
        req_id = live.request.request_id
        if ended:
            del self.live[req_id], self.requests[req_id]
            self.holding.discard(req_id)
        live.output += new
        for token in new:
            live.request.append_output_token(token)
        if ended or split(live.wait, live.output)[0] == GRAMMAR:
            self.waiting.discard(req_id)

    def check_state(self) -> None:
        assert set(self.manager.matchers) == self.holding
        assert set(self.manager.waiting) == self.waiting
        assert self.manager.active == bool(self.holding) and not self.manager.pending


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rows_and_accepts_match_a_fresh_matcher_fed_the_grammars_tokens(pool, data) -> None:
    harness = Harness(pool, data.draw(st.sampled_from([0, 2, 3]), label="max_drafts"))
    for _ in range(data.draw(st.integers(3, 20), label="operations")):
        operation = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "step", "step", "abort"]))
        getattr(harness, operation)(data)
        harness.check_state()
    harness.requests, harness.live = {"free": harness.free}, {}
    harness.check_bitmask([], {}, {}, [])  # nothing scheduled holds a matcher: all forgotten
    harness.check_state()
    assert not harness.manager.active


def _admitted(harness: Harness, params: SamplingParams) -> Request:
    """Request "r" with `params`, its grammar compiled and polled in."""
    request = Request.from_add_request(protocol.AddRequest("r", list(PROMPT), params, [EOS], 0.0), b"c0")
    harness.manager.add(request)
    harness.manager.pending["r"].future.result(timeout=60)
    assert harness.manager.poll() == ([request], [])
    return request


@pytest.mark.parametrize("reason, stop_reason", [(None, None), ("stop", B)])
@pytest.mark.parametrize("narrowed", [None, "allowed_token_ids"])
def test_drafts_accepted_past_the_grammars_eos_are_dropped_and_it_stops(pool, narrowed, reason, stop_reason) -> None:
    """With ignore_eos, drafts [a, EOS] and a bonus token b (or b a stop token, ending the request): the grammar ended
    at EOS, so the request ends "stop" there, with no stop reason and the logprobs rows of a and EOS (the bonus had no
    row: nothing constrained it). Before the fix, the bonus failed the request, or with allowed_token_ids crashed the
    core (xgrammar refuses a bitmask of a terminated matcher)."""
    harness = Harness(pool, max_drafts=2)
    structured = StructuredOutputs(regex="(a|b)+")
    request = _admitted(harness, SamplingParams(max_tokens=40, ignore_eos=True, structured=structured,
                                                **NARROWING[narrowed]))
    sched_out = protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), {"r": 3}, 3,
                                         spec_token_ids={"r": [A, EOS]})
    assert harness.manager.grammar_bitmask(sched_out, {"r": request}).positions == [0, 1]  # none after EOS
    delta = protocol.RequestOutputDelta("r", [A, EOS, B], reason, stop_reason, logprobs=logprobs_rows([A, EOS, B]))
    outputs, finished = [(b"c0", delta)], []
    harness.manager.accept(outputs, finished.append)
    assert [(d.new_token_ids, d.finish_reason, d.error) for _, d in outputs] == [([A, EOS], "stop", None)]
    assert delta.stop_reason is None and rows_of(delta.logprobs) == [A, EOS]
    assert finished == ([] if reason else [["r"]]) and not harness.manager.active  # one ending already: the core's


@pytest.mark.parametrize("kept", [[A], []])
def test_a_refused_token_ends_a_narrowed_request_before_it_without_its_rows(pool, kept: list[int]) -> None:
    """allowed_token_ids forbade the grammar's end, so the workers sampled x, which the grammar refuses where it may
    end: the request ends "stop" before x (and the stop token after it), keeping the rows of the tokens before x and
    no stop reason; with tokens left, on an empty delta after them (docs/sampling.md, narrowing)."""
    harness = Harness(pool, max_drafts=2)
    structured = StructuredOutputs(regex="(a|b)+")
    params = SamplingParams(max_tokens=40, structured=structured, **NARROWING["allowed_token_ids"])
    request = _admitted(harness, params)
    if not kept:  # the grammar may end only after a first token
        outputs = [(b"c0", protocol.RequestOutputDelta("r", [B]))]
        harness.manager.accept(outputs, lambda ended: None)
        request.append_output_token(B)
    new = [*kept, X, ONE]
    delta = protocol.RequestOutputDelta("r", new, "stop", ONE, logprobs=logprobs_rows(new))
    outputs, finished = [(b"c0", delta)], []
    harness.manager.accept(outputs, finished.append)
    got = [(d.new_token_ids, d.finish_reason, d.stop_reason, rows_of(d.logprobs)) for _, d in outputs]
    if kept:
        assert got == [(kept, None, None, kept), ([], "stop", None, None)]
    else:
        assert got == [([], "stop", None, None)]
    assert finished == [] and not harness.manager.active
