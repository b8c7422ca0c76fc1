"""The scheduler's small rule modules under drawn inputs (hypothesis), each against a naive model written here from
its docstring and docs/scheduling.md.

- Chunking (asyncllm/sched/chunking.py): drawn step budgets, `enable_chunked_prefill`,
  `long_prefill_token_threshold` (below, at and above the step) and requests (fresh, partly computed, or resumed
  with outputs that made them longer than a step). A running prefill computes min(rest, threshold, budget); a
  waiting one the same with chunking on, and with it off its rest (capped by the threshold) whole, or nothing
  when that does not fit what is left, unless it is longer than any step (resumed): then what is left. A full
  step always makes progress. `splits_prompts` and `token_budget` follow the doc's table.
- Deadlines (asyncllm/sched/deadlines.py `DeadlineHeap`): drawn adds (some in bursts of requests that finish at
  once), finishes and checks at a moving time, against a list of entries: a check returns exactly the due,
  unfinished requests, each once, earliest first; finished entries stay (lazily) until due or until an add
  finds more than 2 * live + 64 entries, which drops them all, so after every add the heap holds at most that.
- Admission (asyncllm/sched/admission.py): `check_request` refuses a prompt (`InvalidRequestError`, field
  "prompt", naming a rule that applies) exactly when it is empty, passes max_model_len or the KV cache (less one
  position unless it samples once), holds a both-ways span longer than a step, or is longer than a step that
  cannot split prompts; every prompt it accepts gets a first chunk in an empty step. `check_queue_capacity`
  under drawn arrivals (n samples, admission groups, limits or none) and the scheduler taking requests: refused
  (`EngineOverloadedError` naming a limit passed) exactly when the queue is not empty and the waiting requests
  plus n, or their tokens plus n prompts, would pass a limit raised by the size of the request's open group.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.config import EngineConfig
from asyncllm.errors import EngineOverloadedError, InvalidRequestError
from asyncllm.pooling import PoolingParams
from asyncllm.protocol_worker import MultiModalItem
from asyncllm.sampling import SamplingParams
from asyncllm.sched.admission import AdmissionGroups, check_queue_capacity, check_request
from asyncllm.sched.chunking import ChunkPolicy, token_budget
from asyncllm.sched.deadlines import DeadlineHeap
from asyncllm.sched.queue import FCFSRequestQueue
from asyncllm.sched.request import Request, RequestStatus

SLACK = 64
"""Finished entries a `DeadlineHeap` may hold beyond twice the live requests (its docstring's "a few")."""

_ids = itertools.count()


def make_request(num_prompt: int, num_outputs: int = 0, max_tokens: int | None = 16, pooling: bool = False,
                 mm_items: list[MultiModalItem] | None = None) -> Request:
    request = Request(f"r{next(_ids)}", [5] * num_prompt, SamplingParams(max_tokens=max_tokens), [2], 0.0,
                      pooling=PoolingParams() if pooling else None, mm_items=mm_items)
    for _ in range(num_outputs):
        request.append_output_token(7)
    return request


# ------------------------------------------------------------------ chunking
def capped(num_remaining: int, threshold: int) -> int:
    """The long-prefill threshold caps a chunk (0: no cap)."""
    return min(num_remaining, threshold) if threshold > 0 else num_remaining


def running_chunk(num_remaining: int, budget: int, threshold: int) -> int:
    return min(capped(num_remaining, threshold), budget)


def waiting_chunk(num_remaining: int, budget: int, threshold: int, chunked: bool, step: int) -> int:
    wanted = capped(num_remaining, threshold)
    if chunked or wanted <= budget:
        return min(wanted, budget)
    if wanted > step:  # longer than any step (a resumed request): chunked anyway, or it could never run again
        return budget
    return 0  # whole or not at all: waits for a step with room for it


policies = st.tuples(st.integers(1, 40), st.booleans(), st.integers(0, 50))
"""max_num_batched_tokens, enable_chunked_prefill, long_prefill_token_threshold (0: off; may pass the step)."""


@settings(deadline=None, max_examples=300)
@given(policy=policies, num_prompt=st.integers(1, 90), num_outputs=st.integers(0, 30), data=st.data())
def test_a_step_computes_the_chunk_the_rules_give(policy, num_prompt, num_outputs, data):
    step, chunked, threshold = policy
    chunking = ChunkPolicy(step, chunked, threshold)
    assert chunking.splits_prompts == (chunked or 0 < threshold <= step)
    request = make_request(num_prompt, num_outputs)
    num_computed = data.draw(st.integers(0, request.num_tokens - 1), "num_computed")
    rest = request.num_tokens - num_computed
    for budget in data.draw(st.lists(st.integers(0, step), min_size=1, max_size=4), "budgets") + [step]:
        waiting = chunking.first_chunk(request, num_computed, budget)
        assert waiting == waiting_chunk(rest, budget, threshold, chunked, step), (rest, budget)
        request.num_computed_tokens = num_computed
        assert chunking.prefill_chunk(request, budget) == running_chunk(rest, budget, threshold), (rest, budget)
    assert waiting > 0 and chunking.prefill_chunk(request, step) > 0  # a whole step always makes progress


@settings(deadline=None, max_examples=200)
@given(policy=policies, num_prompt=st.integers(1, 90), num_outputs=st.integers(0, 30),
       budgets=st.lists(st.integers(0, 40), min_size=1, max_size=30))
def test_a_prefill_runs_to_its_end_in_chunks_within_each_budget(policy, num_prompt, num_outputs, budgets):
    """Admitted by `first_chunk`, then `prefill_chunk` each step: no chunk passes the budget or the threshold, and
    the chunks add up to the request's tokens (full steps after the drawn ones)."""
    step, chunked, threshold = policy
    chunking = ChunkPolicy(step, chunked, threshold)
    request = make_request(num_prompt, num_outputs)
    admitted, steps = False, [min(b, step) for b in budgets] + [step] * request.num_tokens
    for budget in steps:
        if request.num_computed_tokens == request.num_tokens:
            break
        if admitted:
            num_new = chunking.prefill_chunk(request, budget)
        else:
            num_new = chunking.first_chunk(request, 0, budget)
            admitted = num_new > 0
        assert num_new <= budget and (threshold <= 0 or num_new <= threshold)
        request.num_computed_tokens += num_new
    assert request.num_computed_tokens == request.num_tokens


@settings(deadline=None, max_examples=100)
@given(field=st.none() | st.integers(1, 20_000), chunked=st.booleans(), max_num_seqs=st.integers(1, 12_000),
       max_model_len=st.integers(1, 20_000))
def test_the_step_budget_defaults_as_the_doc_says(field, chunked, max_num_seqs, max_model_len):
    """docs/scheduling.md: the field, else max(8192, max_num_seqs) with chunking, else max(max_model_len,
    max_num_seqs)."""
    if field is not None and field < max_num_seqs:
        field = max_num_seqs  # the config refuses fewer tokens than sequences, as vLLM
    config = EngineConfig.create("dummy-model", max_num_batched_tokens=field, enable_chunked_prefill=chunked,
                                 max_num_seqs=max_num_seqs)
    default = max(8192 if chunked else max_model_len, max_num_seqs)
    assert token_budget(config, max_model_len) == (default if field is None else field)


# ------------------------------------------------------------------ deadlines
class DeadlineModel:
    """The heap's entries as a plain list of [deadline, request], in add order."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, Request]] = []
        self.live: list[Request] = []
        """The scheduler's unfinished requests (with a deadline or not)."""

    def add(self, heap: DeadlineHeap, deadline: float, with_deadline: bool) -> Request:
        request = make_request(2)
        self.live.append(request)
        if with_deadline:
            heap.add(request, deadline, len(self.live))
            self.entries.append((deadline, request))
            if len(self.entries) > 2 * len(self.live) + SLACK:
                self.entries = [(d, r) for d, r in self.entries if not r.is_finished]
            assert len(heap) <= 2 * len(self.live) + SLACK
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.finish(status)
        self.live.remove(request)

    def due(self, now: float) -> list[tuple[float, Request]]:
        due = [(d, r) for d, r in self.entries if d <= now]
        self.entries = [(d, r) for d, r in self.entries if d > now]
        return [(d, r) for d, r in due if not r.is_finished]


timeouts = st.lists(st.integers(0, 12), min_size=1, max_size=6)
"""Half-seconds, of requests that arrive together."""

deadline_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), timeouts, st.booleans()),  # whether they have a timeout
    st.tuples(st.just("burst"), st.integers(10, 70), st.randoms(use_true_random=False)),  # arrivals, drawn below
    st.tuples(st.just("finish"), st.integers(0, 1000), st.sampled_from([RequestStatus.FINISHED_STOPPED,
                                                                        RequestStatus.FINISHED_ABORTED])),
    st.tuples(st.just("check"), st.integers(0, 6), st.none()),  # half-seconds the clock moves on, then a check
), max_size=40)


@settings(deadline=None, max_examples=300)
@given(ops=deadline_ops)
def test_due_unfinished_requests_come_out_once_and_finished_ones_do_not_pile_up(ops):
    heap, model, now = DeadlineHeap(), DeadlineModel(), 0.0
    returned: set[str] = set()
    for op, a, b in ops:
        if op == "add":
            for timeout in a:
                model.add(heap, now + timeout / 2, b)
        elif op == "burst":
            for _ in range(a):  # most finish before their deadline, as under a generous timeout
                request = model.add(heap, now + b.randint(0, 12) / 2, True)
                if b.random() < 0.9:
                    model.finish(request, RequestStatus.FINISHED_STOPPED)
        elif op == "finish" and model.live:
            model.finish(model.live[a % len(model.live)], b)
        elif op == "check":
            now += a / 2
            expired = heap.pop_expired(now)
            expected = model.due(now)
            assert sorted(map(id, expired)) == sorted(id(r) for _, r in expected)
            deadlines = {id(r): d for d, r in expected}
            assert [deadlines[id(r)] for r in expired] == sorted(deadlines.values())  # earliest first
            assert not returned & {r.request_id for r in expired}  # each once
            returned |= {r.request_id for r in expired}
            for request in expired:  # the scheduler times them out
                model.finish(request, RequestStatus.FINISHED_TIMEOUT)
        assert len(heap) == len(model.entries)
        assert heap.next_deadline() == min((d for d, _ in model.entries), default=None)


# ------------------------------------------------------------------ admission: prompts that could never run
def refusals(num_prompt: int, samples_once: bool, spans: list[int], max_model_len: int, kv_capacity: int,
             splits_prompts: bool, step: int) -> list[str]:
    """What the message of each rule the prompt breaks says (none: accepted)."""
    room = 0 if samples_once else 1  # a generation keeps a position for its first generated token
    broken = [
        (num_prompt == 0, "is empty"),
        (num_prompt + room > max_model_len, f"max_model_len={max_model_len} leaves room for at most "
                                            f"{max_model_len - room} prompt tokens"),
        (num_prompt + room > kv_capacity, f"do not fit in the whole KV cache ({kv_capacity} tokens"),
        (max(spans, default=0) > step, f"more than max_num_batched_tokens={step}"),
        (not splits_prompts and num_prompt > step, f"exceed max_num_batched_tokens={step} with "
                                                   "enable_chunked_prefill=False"),
    ]
    return [message for breaks, message in broken if breaks]


def both_ways_items(spans: list[tuple[int, int]]) -> list[MultiModalItem]:
    """An item per (lead, span): `lead` causal rows, then `span` both-ways ones; laid end to end in the prompt."""
    items, offset = [], 0
    for lead, span in spans:
        items.append(MultiModalItem(f"h{offset}", offset, lead + span, bidirectional=[lead, lead + span]))
        offset += lead + span
    return items


@settings(deadline=None, max_examples=400)
@given(num_prompt=st.integers(0, 70), kind=st.sampled_from(["generate", "max_tokens 1", "pooling"]),
       max_model_len=st.integers(1, 64), kv_capacity=st.integers(1, 64), policy=policies, data=st.data())
def test_a_prompt_is_refused_exactly_when_it_could_never_run(num_prompt, kind, max_model_len, kv_capacity, policy,
                                                             data):
    step, chunked, threshold = policy
    span_lengths = st.integers(1, 30) | st.sampled_from([step, step + 1])  # a step's edge is where mistakes show
    spans = data.draw(st.lists(st.tuples(st.integers(0, 3), span_lengths), max_size=2), "spans")
    spans = [s for i, s in enumerate(spans) if sum(map(sum, spans[:i + 1])) <= num_prompt]  # inside the prompt
    request = make_request(num_prompt, max_tokens=1 if kind == "max_tokens 1" else 16, pooling=kind == "pooling",
                           mm_items=both_ways_items(spans))
    chunking = ChunkPolicy(step, chunked, threshold)
    expected = refusals(num_prompt, kind != "generate", [span for _, span in spans], max_model_len, kv_capacity,
                        chunking.splits_prompts, step)
    try:
        check_request(request, max_model_len, kv_capacity, chunking.splits_prompts, step, "kv_cache_memory_bytes")
    except InvalidRequestError as error:
        assert error.field == "prompt" and expected, error
        assert any(message in error.message for message in expected), (error.message, expected)
    else:
        assert not expected
        assert chunking.first_chunk(request, 0, step) > 0  # it runs: an empty step takes its first chunk


# ------------------------------------------------------------------ admission: the queue's limits
def group_name_and_size(group: str) -> tuple[str, int]:
    """"NAME/SIZE" (SIZE up to 9 digits, at least 1); else the whole id, size 1."""
    name, slash, size = group.rpartition("/")
    if slash and name and size.isdigit() and size.isascii() and len(size) <= 9:
        return name, max(1, int(size))
    return group, 1


class QueueModel:
    """The waiting requests' prompt lengths, oldest first, and the open groups' sizes, the last `max_open` to open
    (oldest first)."""

    def __init__(self, max_open: int) -> None:
        self.waiting: list[int] = []
        self.open: list[tuple[str, int]] = []
        self.max_open = max_open

    def limits_passed(self, num_samples: int, num_prompt: int, group: str, max_requests: int | None,
                      max_tokens: int | None) -> list[str]:
        """The limits this request would pass ([] when it is queued), opening its group on an empty queue."""
        name, size = group_name_and_size(group)
        if not self.waiting:
            if group:
                self.open = [(n, s) for n, s in self.open if n != name][-(self.max_open - 1):] + [(name, size)]
            return []
        extra = next((s for n, s in self.open if n == name and group), 0)
        passed = []
        if max_requests is not None and len(self.waiting) + num_samples > max_requests + extra:
            passed.append(f"max_num_queued_requests={max_requests}")
        if max_tokens is not None and sum(self.waiting) + num_samples * num_prompt > max_tokens + extra * num_prompt:
            passed.append(f"max_num_queued_tokens={max_tokens}")
        return passed


GROUPS = ["", "", "a/2", "a/3", "b/1", "c/4", "d", "/3", "e/0", "f/x2"]
"""Admission group ids: none, sized ones (two sharing the name "a"), and ids whose size is not one (size 1)."""

queue_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 4), st.sampled_from(GROUPS)),  # prompt, n, group
    st.tuples(st.just("take"), st.integers(1, 8), st.none(), st.none()),  # the scheduler admits that many
), max_size=40)


@settings(deadline=None, max_examples=300)
@given(ops=queue_ops, max_requests=st.sampled_from([None, 0]) | st.integers(0, 6),
       max_tokens=st.sampled_from([None, 0]) | st.integers(0, 40), max_open=st.sampled_from([2, 3, 1024]))
def test_the_queue_refuses_exactly_what_passes_its_limits(ops, max_requests, max_tokens, max_open):
    """An n-sample request is checked on its sample 0 (`num_samples` n); its other samples (`num_samples` 0) are
    queued with it unchecked. Open groups are remembered up to `AdmissionGroups.MAX_OPEN`, drawn small here."""
    groups = type("Groups", (AdmissionGroups,), {"MAX_OPEN": max_open})()
    waiting, model = FCFSRequestQueue(), QueueModel(max_open)
    for op, a, n, group in ops:
        if op == "take":
            for _ in range(min(a, len(waiting))):
                waiting.pop()
                model.waiting.pop(0)
            continue
        samples = [make_request(a) for _ in range(n)]
        for index, sample in enumerate(samples):
            sample.num_samples, sample.admission_group = (n if index == 0 else 0), group
        expected = model.limits_passed(n, a, group, max_requests, max_tokens)
        if expected:
            with pytest.raises(EngineOverloadedError) as refused:
                check_queue_capacity(waiting, samples[0], groups, max_requests, max_tokens)
            assert any(str(refused.value).startswith(limit) for limit in expected), (refused.value, expected)
            continue
        for sample in samples:
            check_queue_capacity(waiting, sample, groups, max_requests, max_tokens)
            waiting.add(sample)
        model.waiting += [a] * n
        assert (len(waiting), waiting.num_tokens) == (len(model.waiting), sum(model.waiting))
        assert list(groups.open.items()) == model.open
