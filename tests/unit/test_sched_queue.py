"""The waiting queues (asyncllm/sched/queue.py) against a plain-list model, their O(1) removal (lazy in the priority
heap), their adapter counts, and the scheduler's aborts leaving untouched what the aborted requests are not in."""

from __future__ import annotations

import random

import pytest

from asyncllm.config import EngineConfig
from asyncllm.lora import LoRARequest
from asyncllm.sampling import SamplingParams
from asyncllm.sched.queue import FCFSRequestQueue, PriorityRequestQueue, RequestQueue
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler

ADAPTERS = [None, LoRARequest("a1", 1, "/adapters/1"), LoRARequest("a2", 2, "/adapters/2")]


def make_request(req_id: str, num_tokens: int = 3, priority: int = 0, arrival: float = 0.0,
                 lora: LoRARequest | None = None) -> Request:
    return Request(req_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=4), [2], arrival,
                   priority=priority, lora=lora)


class ModelQueue:
    """What a queue must hold, as a plain list rebuilt on every change."""

    def __init__(self, policy: str) -> None:
        self.policy, self.entries, self.counter = policy, [], 0

    def add(self, request: Request, front: bool = False) -> None:
        self.counter += 1
        key = (-self.counter,) if front else (self.counter,)
        if self.policy == "priority":
            key = (request.priority, request.arrival_time, self.counter)
        self.entries.append((key, request))

    def order(self) -> list[Request]:
        return [request for _, request in sorted(self.entries, key=lambda e: e[0])]

    def pop(self) -> Request:
        first = self.order()[0]
        self.entries = [e for e in self.entries if e[1] is not first]
        return first

    def remove(self, req_ids: set[str]) -> None:
        self.entries = [e for e in self.entries if e[1].request_id not in req_ids]


def assert_same(queue: RequestQueue, model: ModelQueue) -> None:
    order = model.order()
    assert [r.request_id for r in queue] == [r.request_id for r in order]
    assert (len(queue), bool(queue), queue.num_tokens) == (len(order), bool(order), sum(r.num_tokens for r in order))
    assert queue.lora_names == sorted({r.lora.lora_name for r in order if r.lora is not None})
    if order:
        assert queue.peek() is order[0]
    else:
        with pytest.raises(IndexError):
            queue.peek()
        with pytest.raises(IndexError):
            queue.pop()


@pytest.mark.parametrize("queue_class, policy", [(FCFSRequestQueue, "fcfs"), (PriorityRequestQueue, "priority")])
def test_queue_matches_a_list_through_adds_pops_and_removals(queue_class: type[RequestQueue], policy: str) -> None:
    rng = random.Random(7)
    queue, model = queue_class(), ModelQueue(policy)
    popped: list[Request] = []  # out of the queue (admitted or removed): may come back preempted
    for step in range(1500):
        op = rng.random()
        if op < 0.35:
            request = make_request(f"r{step}", rng.randrange(1, 50), rng.randrange(3), float(rng.randrange(5)),
                                   rng.choice(ADAPTERS))
            queue.add(request)
            model.add(request)
        elif op < 0.5 and popped:
            request = popped.pop(rng.randrange(len(popped)))
            queue.add_preempted(request)
            model.add(request, front=True)
        elif op < 0.7 and model.entries:
            request = queue.pop()
            assert request is model.pop()
            popped.append(request)
        else:  # queued, already gone and unknown ids together, often none queued
            queued = [r.request_id for r in model.order()]
            ids = set(rng.sample(queued, min(len(queued), rng.randrange(3)))) | {"unknown"}
            ids |= {r.request_id for r in rng.sample(popped, min(len(popped), 2))}
            popped += [r for r in model.order() if r.request_id in ids]
            queue.remove_requests(ids)
            model.remove(ids)
        assert_same(queue, model)


def test_priority_queue_drops_removed_entries_lazily_and_bounds_them() -> None:
    queue = PriorityRequestQueue()
    requests = [make_request(f"r{i}", priority=i % 3, arrival=float(i)) for i in range(300)]
    for request in requests:
        queue.add(request)
    queue.remove_requests({"r0", "r3"})  # the two first: their entries stay until they reach the top
    assert (len(queue._heap), len(queue)) == (300, 298)
    assert queue.peek().request_id == "r6"
    assert len(queue._heap) == 298
    for request in requests[:250]:
        queue.remove_requests({request.request_id})
    assert len(queue._heap) <= 2 * len(queue) + 64  # dead entries rebuilt away: memory stays O(queued)
    assert [r.request_id for r in queue] == [r.request_id for r in sorted(requests[250:], key=lambda r: r.priority)]
    queue.add_preempted(requests[0])
    assert [queue.pop().request_id for _ in range(2)] == ["r0", "r252"]


def test_priority_queue_takes_a_removed_request_back_once() -> None:
    queue = PriorityRequestQueue()
    x, y, z = (make_request(name, priority=i) for i, name in enumerate("xyz"))
    for request in (x, y, z):
        queue.add(request)
    queue.remove_requests({"y"})  # its dead entry stays in the heap
    queue.add_preempted(y)
    assert [queue.pop() for _ in range(len(queue))] == [x, y, z]
    assert (len(queue), queue.num_tokens) == (0, 0)
    with pytest.raises(IndexError):
        queue.pop()


def make_scheduler(policy: str, **fields) -> Scheduler:
    return Scheduler(EngineConfig.create("dummy-model", block_size=4, max_num_seqs=2, scheduling_policy=policy,
                                         **fields), 64, 256)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_aborts_touch_only_where_the_requests_are(policy: str) -> None:
    sched = make_scheduler(policy)
    for i in range(6):
        sched.add_request(make_request(f"r{i}"))
    sched.schedule()  # r0, r1 run
    running = sched.running
    sched.abort_requests(["r3", "r5", "nobody"])  # waiting ones: the running list is not rebuilt
    assert sched.running is running and [r.request_id for r in sched.waiting] == ["r2", "r4"]
    store = vars(sched.waiting).copy()
    sched.abort_requests(["r0"])  # a running one: the queue is not rebuilt
    assert {name: value is store[name] for name, value in vars(sched.waiting).items()} == dict.fromkeys(store, True)
    assert [r.request_id for r in sched.running] == ["r1"]
    assert (len(sched.waiting), sched.waiting.num_tokens) == (2, 6)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_lora_stats_follow_the_queue(policy: str) -> None:
    sched = make_scheduler(policy, enable_lora=True, max_loras=1)
    loras = [ADAPTERS[1], ADAPTERS[2], ADAPTERS[2], None, ADAPTERS[1]]
    for i, lora in enumerate(loras):
        sched.add_request(make_request(f"r{i}", lora=lora))

    def adapters() -> tuple[list[str], list[str]]:
        stats = sched.get_stats()
        return stats.running_lora_adapters, stats.waiting_lora_adapters

    assert adapters() == ([], ["a1", "a2"])
    sched.schedule()  # r0 (a1) runs; r1 (a2) waits for a slot; r2 neither, r3 (no adapter) runs
    assert adapters() == (["a1"], ["a1", "a2"])
    sched.abort_requests(["r4"])
    assert adapters() == (["a1"], ["a2"])
    sched.abort_requests(["r1", "r2", "r0"])
    assert adapters() == ([], [])


@pytest.mark.parametrize("queue_class", [FCFSRequestQueue, PriorityRequestQueue])
@pytest.mark.parametrize("preempted", [False, True])
def test_a_queued_request_is_never_queued_again(queue_class: type[RequestQueue], preempted: bool) -> None:
    """One entry per request id: queued twice, `num_tokens` and the adapters would count it twice."""
    queue = queue_class()
    request = make_request("r", lora=ADAPTERS[1])
    queue.add(request)
    with pytest.raises(AssertionError, match="queued twice"):
        (queue.add_preempted if preempted else queue.add)(request)
    assert (len(queue), queue.num_tokens, queue.lora_names) == (1, 3, ["a1"])
    queue.remove_requests(["r"])
    queue.add_preempted(request)  # taken out, it is queued again
    assert (len(queue), queue.num_tokens) == (1, 3)
