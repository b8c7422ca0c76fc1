"""`beam_search` over a drawn scripted engine (hypothesis), against a naive beam search written from its docstring.

Drawn: a vocabulary of 4 to 8 tokens with one or two EOS ids, a prompt of 1 to 4 tokens, `beam_width` 1 to 4,
`max_tokens` 1 to 6, `length_penalty` 0, 1, 2 or a float in [-1, 3], `ignore_eos` on or off, `max_model_len` tight
(leaving 1 to ``max_tokens + 1`` tokens) or not, and up to two ``suppress_tokens`` and two ``begin_suppress_tokens``
ids. The engine answers each step's ``max_tokens=1`` request with its top ``params.logprobs`` tokens, each with its
raw logprob and rank (the count of tokens at least as likely), from a table keyed by the last one or two tokens; a
context's row is drawn the first time it is asked for: the log-softmax of drawn logits, small integers (ties) or
floats. Tied tokens come in a drawn order, as torch.topk's, which the beams' entries keep.

The reference is the docstring's rules: each step every live beam is expanded by its step entry (the
``2 * beam_width`` most likely tokens not left out, best first), a candidate ending in EOS is complete unless
``ignore_eos``, the best ``beam_width`` of the others by cumulative logprob go on, for ``min(max_tokens,
max_model_len - len(prompt))`` steps or until none is left; then complete and live beams are ranked by
``cum_logprob / length ** length_penalty`` (length: prompt and output tokens, less an EOS the beam ends with) and the
best ``beam_width`` returned, best first. Each returned sequence must be one of the reference's, with its tokens,
cumulative logprob (within 1e-9, relative), finish reason, and per output token the whole entry (the engine's
`Logprob`s, raw ranks, in order). Every step's requests must be raw-logprob, greedy, one-token and within
max_model_len.

Ties: the docstring fixes no order among equal cumulative logprobs or equal scores, so the test accepts any the
rules allow. The beams each step goes on with are read from the engine's requests (a step's beams are the requests
of one length) and must be a best ``beam_width`` of the candidates: as many, none left out better than one taken;
the reference then goes on with those. The last step's live beams are not seen: the returned sequences must be the
best ``beam_width`` by score, in order, of the complete beams and some best ``beam_width`` of those candidates.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import BeamSearchParams
from asyncllm.beam_search import BeamSearchSequence, beam_search
from asyncllm.generation_config import SuppressedTokens
from asyncllm.outputs import Logprob

MAX_LOGPROBS = 20
LOGITS = st.one_of(st.integers(-3, 3).map(float), st.floats(-6, 6, allow_nan=False, allow_infinity=False))


def at_most(a: float, b: float) -> bool:
    """a <= b, but for the last bits of a float sum: equal values may have been added up in another order."""
    return a <= b + 1e-9 * (1 + abs(b))


def log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    log_total = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_total for x in logits]


@dataclass(frozen=True)
class Case:
    vocab_size: int
    eos: frozenset[int]
    prompt: tuple[int, ...]
    width: int
    max_tokens: int
    max_model_len: int
    length_penalty: float
    ignore_eos: bool
    context_len: int
    """The table's rows are keyed by the last this many tokens."""
    tie_order: tuple[int, ...]
    always: frozenset[int]
    at_start: frozenset[int]
    suppressed_vocab_size: int
    """`SuppressedTokens.vocab_size`: 0 (no bound) is drawn only where nothing is suppressed."""

    @property
    def steps(self) -> int:
        return min(self.max_tokens, self.max_model_len - len(self.prompt))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    vocab = draw(st.integers(4, 8))
    token = st.integers(0, vocab - 1)
    prompt = tuple(draw(st.lists(token, min_size=1, max_size=4)))
    max_tokens = draw(st.sampled_from(range(1, 7)))
    tight = draw(st.booleans())
    always, at_start = draw(st.frozensets(token, max_size=2)), draw(st.frozensets(token, max_size=2))
    return Case(
        vocab_size=vocab, eos=frozenset(draw(st.lists(token, min_size=1, max_size=2, unique=True))), prompt=prompt,
        width=draw(st.sampled_from(range(1, 5))), max_tokens=max_tokens,
        max_model_len=len(prompt) + draw(st.integers(1, max_tokens + 1)) if tight else 64,
        length_penalty=draw(st.one_of(st.sampled_from([0, 1, 2]), st.floats(-1, 3))),
        ignore_eos=draw(st.booleans()), context_len=draw(st.sampled_from([1, 2])),
        tie_order=tuple(draw(st.permutations(range(vocab)))), always=always, at_start=at_start,
        suppressed_vocab_size=vocab if always or at_start else draw(st.sampled_from([0, vocab])))


@dataclass
class Table:
    """The model: every context's tokens, best first (ties in `Case.tie_order`), with raw logprobs and ranks; a
    context's row drawn the first time it is asked for."""

    case: Case
    data: st.DataObject
    rows: dict[tuple[int, ...], list[tuple[int, Logprob]]] = field(default_factory=dict)

    def ranked(self, tokens: tuple[int, ...]) -> list[tuple[int, Logprob]]:
        context = tokens[-self.case.context_len:]
        if context not in self.rows:
            logits = self.data.draw(st.lists(LOGITS, min_size=self.case.vocab_size, max_size=self.case.vocab_size))
            logprobs = log_softmax(logits)
            order = sorted(range(self.case.vocab_size), key=lambda t: (-logprobs[t], self.case.tie_order.index(t)))
            self.rows[context] = [(t, Logprob(logprobs[t], sum(x >= logprobs[t] for x in logprobs))) for t in order]
        return self.rows[context]


class ScriptedEngine:
    """Answers each step's request with the table's top ``params.logprobs``; keeps every request's tokens."""

    tokenizer = None

    def __init__(self, case: Case, table: Table) -> None:
        self.case, self.table = case, table
        self.eos_token_ids = sorted(case.eos)
        self.config = SimpleNamespace(max_logprobs=MAX_LOGPROBS, max_model_len=case.max_model_len)
        self.suppressed_tokens = SuppressedTokens(case.always, case.at_start, case.suppressed_vocab_size)
        self.requests: list[tuple[int, ...]] = []

    async def start(self) -> None:
        return None

    async def generate(self, tokens: list[int], params: Any, **options: Any) -> Any:
        assert len(tokens) < self.case.max_model_len, "the engine refuses a prompt that leaves no room"
        assert (params.max_tokens, params.temperature, params.logprobs_mode) == (1, 0.0, "raw_logprobs")
        assert params.logprobs <= MAX_LOGPROBS, "the engine refuses more than its max_logprobs"
        self.requests.append(tuple(tokens))
        entry = dict(self.table.ranked(tuple(tokens))[:params.logprobs])
        return SimpleNamespace(outputs=[SimpleNamespace(logprobs=[entry], finish_reason="length")])


@dataclass
class Beam:
    tokens: tuple[int, ...]
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    complete: bool = False


def step_entry(case: Case, table: Table, tokens: tuple[int, ...], index: int) -> dict[int, Logprob]:
    """The ``2 * beam_width`` most likely tokens not left out, best first."""
    left_out = case.always | case.at_start if index == 0 else case.always
    return dict([(t, logprob) for t, logprob in table.ranked(tokens) if t not in left_out][:2 * case.width])


def expand(case: Case, table: Table, beams: list[Beam], index: int) -> list[Beam]:
    """Every beam with each token of its step entry; one ending in EOS is complete unless `ignore_eos`."""
    ends = frozenset() if case.ignore_eos else case.eos
    candidates = []
    for beam in beams:
        entry = step_entry(case, table, beam.tokens, index)
        for token, logprob in entry.items():
            candidates.append(Beam(beam.tokens + (token,), beam.cum_logprob + logprob.logprob,
                                   beam.logprobs + [entry], token in ends))
    return candidates


def chosen_beams(requests: list[tuple[int, ...]], candidates: list[Beam], width: int) -> list[Beam]:
    """The candidates a step went on with (its next step's requests), which must be a best `width` of them."""
    by_tokens = {c.tokens: c for c in candidates}
    assert len(set(requests)) == len(requests), requests
    assert all(tokens in by_tokens for tokens in requests), (requests, list(by_tokens))
    assert len(requests) == min(width, len(candidates)), (requests, list(by_tokens))
    chosen = [by_tokens[tokens] for tokens in requests]
    worst = min(c.cum_logprob for c in chosen)
    assert all(at_most(c.cum_logprob, worst) for c in candidates if c.tokens not in set(requests))
    return chosen


def reference_search(case: Case, table: Table, requests: list[tuple[int, ...]]) -> tuple[list[Beam], list[Beam]]:
    """The complete beams and the last step's live candidates, the steps going on with the beams the search took."""
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for tokens in requests:
        by_length.setdefault(len(tokens), []).append(tokens)
    assert by_length.pop(len(case.prompt), None) == [case.prompt]
    beams, complete = [Beam(case.prompt)], []
    for index in range(case.steps):
        candidates = expand(case, table, beams, index)
        complete += [c for c in candidates if c.complete]
        live = [c for c in candidates if not c.complete]
        if index == case.steps - 1 or not live:
            assert not by_length, f"requests after the search's last step: {by_length}"
            return complete, live
        beams = chosen_beams(by_length.pop(len(case.prompt) + index + 1, []), live, case.width)
    raise AssertionError("a search of no step")


def score(case: Case, beam: Beam) -> float:
    """The length counts prompt and output tokens, less an EOS id the beam ends with (`ignore_eos` or not)."""
    length = len(beam.tokens) - (beam.tokens[-1] in case.eos)
    return beam.cum_logprob / length ** case.length_penalty


def check_sequence(sequence: BeamSearchSequence, beam: Beam) -> None:
    assert sequence.tokens == list(beam.tokens)
    assert math.isclose(sequence.cum_logprob, beam.cum_logprob, rel_tol=1e-9, abs_tol=1e-9), sequence
    assert sequence.finish_reason == ("stop" if beam.complete else "length")
    assert [list(entry.items()) for entry in sequence.logprobs] == [list(entry.items()) for entry in beam.logprobs]
    outputs = beam.tokens[len(beam.tokens) - len(beam.logprobs):]
    assert sequence.token_logprobs == [entry[t].logprob for t, entry in zip(outputs, beam.logprobs)]
    assert sequence.text == ""


def check_best(case: Case, returned: list[Beam], complete: list[Beam], last: list[Beam]) -> None:
    """`returned` is a best ``beam_width`` by score, best first, of `complete` and some best ``beam_width`` of the
    last step's candidates `last` (any of those tied at its cut)."""
    kept = min(case.width, len(last))
    cut = sorted((c.cum_logprob for c in last), reverse=True)[kept - 1] if kept else 0.0
    surely_live = [c for c in last if not at_most(c.cum_logprob, cut)]
    tied = [c for c in last if at_most(c.cum_logprob, cut) and at_most(cut, c.cum_logprob)]
    taken = {id(b) for b in returned}
    assert taken <= {id(b) for b in complete + surely_live + tied}, "a beam the search had dropped"
    assert len(returned) == min(case.width, len(complete) + kept)
    scores = [score(case, b) for b in returned]
    assert all(at_most(b, a) for a, b in zip(scores, scores[1:])), f"not best first: {scores}"
    tied_taken = sum(id(b) in taken for b in tied)
    assert tied_taken <= kept - len(surely_live), "more of the tied candidates than went on"
    worst = min(scores, default=math.inf)
    missing = [b for b in complete + surely_live if id(b) not in taken]
    assert all(at_most(score(case, b), worst) for b in missing), "a better beam left out"
    tied_left = [b for b in tied if id(b) not in taken]
    assert sum(at_most(score(case, b), worst) for b in tied_left) >= kept - len(surely_live) - tied_taken, \
        "the tied candidates that went on would have been returned"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), data=st.data())
def test_beam_search_matches_the_docstrings_rules(case: Case, data: st.DataObject) -> None:
    table = Table(case, data)
    engine = ScriptedEngine(case, table)
    params = BeamSearchParams(beam_width=case.width, max_tokens=case.max_tokens, ignore_eos=case.ignore_eos,
                              length_penalty=case.length_penalty)
    out = asyncio.run(beam_search(engine, list(case.prompt), params))  # type: ignore[arg-type]
    complete, last = reference_search(case, table, engine.requests)
    finals = {b.tokens: b for b in complete + last}
    assert len(finals) == len(complete) + len(last)
    returned = []
    for sequence in out.sequences:
        assert tuple(sequence.tokens) in finals, f"{sequence.tokens} is no beam of the search"
        returned.append(finals[tuple(sequence.tokens)])
        check_sequence(sequence, returned[-1])
    assert len({id(b) for b in returned}) == len(returned), "a beam returned twice"
    check_best(case, returned, complete, last)
