"""The host's early admission check: estimates from the core's latest stats plus its own submissions."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm.engine.admission import HostAdmission, estimate_prompt_tokens
from asyncllm.errors import EngineOverloadedError
from asyncllm.protocol import SchedulerStats


def test_prompt_token_estimates():
    assert estimate_prompt_tokens([5, 6, 7], chat=False) == 3
    assert estimate_prompt_tokens("x" * 41, chat=False) == 10
    messages = [{"role": "system", "content": "a" * 20}, {"role": "user", "content": "b" * 21}]
    assert estimate_prompt_tokens(messages, chat=True) == 10


def test_disabled_admission_refuses_nothing_but_counts_for_the_balancer():
    admission = HostAdmission(None, None)
    stats = SchedulerStats(num_requests_waiting=10**6)
    for _ in range(100):
        admission.admit(stats, "hi", chat=False)
    assert not admission.enabled and admission.num_waiting(stats) == 10**6 + 100


def test_submissions_count_until_a_snapshot_counts_them():
    admission = HostAdmission(max_num_queued_requests=3, max_num_queued_tokens=None)
    stats = SchedulerStats(num_requests_waiting=1)
    admission.admit(stats, "a", chat=False)
    admission.admit(stats, "b", chat=False)  # 1 waiting + 1 submitted < 3
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=3: about 3 requests"):
        admission.admit(stats, "c", chat=False)
    with pytest.raises(EngineOverloadedError, match="about 3 requests"):  # the core queued both: 3 wait
        admission.admit(SchedulerStats(num_requests_waiting=3, host_samples_queued=2), "c", chat=False)
    admission.admit(SchedulerStats(num_requests_waiting=2, host_samples_queued=2), "c", chat=False)  # one ran
    with pytest.raises(EngineOverloadedError, match="about 3 requests"):  # c not queued yet: still counted
        admission.admit(SchedulerStats(num_requests_waiting=2, host_samples_queued=2), "d", chat=False)


def test_n_samples_count_as_n_requests():
    admission = HostAdmission(max_num_queued_requests=4, max_num_queued_tokens=None)
    stats = SchedulerStats()
    admission.admit(stats, "a", chat=False, num_samples=3)
    admission.admit(stats, "b", chat=False)  # 3 < 4
    with pytest.raises(EngineOverloadedError, match="about 4 requests"):
        admission.admit(stats, "c", chat=False)


def test_token_limit_accepts_any_prompt_on_an_empty_queue():
    admission = HostAdmission(max_num_queued_requests=None, max_num_queued_tokens=100)
    admission.admit(SchedulerStats(), [1] * 500, chat=False)  # nothing queued: accepted (the core agrees)
    stats = SchedulerStats(num_requests_waiting=1, num_waiting_tokens=60, host_samples_queued=1)  # it, queued
    admission.admit(stats, "x" * 160, chat=False)  # 60 + 40 = 100: fits
    with pytest.raises(EngineOverloadedError, match="about 100 tokens are already waiting and this prompt has about 1"):
        admission.admit(stats, "abcd", chat=False)


def test_the_core_rule_with_n():
    """As the core (`check_queue_capacity`): an empty queue accepts any n; else waiting + n may not pass the limit."""
    admission = HostAdmission(max_num_queued_requests=2, max_num_queued_tokens=None)
    admission.admit(SchedulerStats(), "a", chat=False, num_samples=4)  # an empty queue: accepted
    admission = HostAdmission(max_num_queued_requests=3, max_num_queued_tokens=None)
    with pytest.raises(EngineOverloadedError, match="about 1 requests are already waiting and this request has n=3"):
        admission.admit(SchedulerStats(num_requests_waiting=1), "b", chat=False, num_samples=3)
    admission.admit(SchedulerStats(num_requests_waiting=1), "c", chat=False, num_samples=2)  # 1 + 2 = 3: fits


def test_token_limit_counts_n_prompts():
    admission = HostAdmission(max_num_queued_requests=None, max_num_queued_tokens=100)
    stats = SchedulerStats(num_requests_waiting=1, num_waiting_tokens=60)
    with pytest.raises(EngineOverloadedError, match="about 60 tokens are already waiting and this request's n=2"):
        admission.admit(stats, "x" * 84, chat=False, num_samples=2)  # 60 + 2 x 21 > 100


def test_a_failed_request_is_uncounted_unless_a_snapshot_counts_it():
    """`Admitted.retract`: a request failing before the core queued it (refused, never queued) stops counting at once,
    and once only; one the latest snapshot counts (queued, then failed) is the snapshot's alone."""
    admission = HostAdmission(max_num_queued_requests=2, max_num_queued_tokens=10)
    stats = SchedulerStats()
    refused = admission.admit(stats, [1] * 40, chat=False, num_samples=2)
    refused.retract()
    refused.retract()
    admission.admit(stats, [1] * 5, chat=False)  # 0 waiting: as if the refused one had never come
    admission.admit(stats, [1] * 5, chat=False)  # 5 + 5 <= 10 tokens, 1 + 1 <= 2 requests
    with pytest.raises(EngineOverloadedError):
        admission.admit(stats, [1], chat=False)
    counted = admission.admit(SchedulerStats(num_requests_waiting=1, host_samples_queued=2), [1], chat=False)
    new = SchedulerStats(num_requests_waiting=1, host_samples_queued=3)
    admission.admit(new, [1], chat=False)  # a new snapshot that counts `counted`: 1 waiting + this one
    counted.retract()  # counted by the snapshot: changes nothing
    with pytest.raises(EngineOverloadedError, match="about 2 requests"):
        admission.admit(new, [1], chat=False)


class _Stats:
    """A replica's `HostStats`: the core's latest snapshot, replaced as the processor thread receives one."""

    def __init__(self, scheduler: SchedulerStats) -> None:
        self.scheduler = scheduler


class _Request:
    """A `RequestCollector`, as `Admitted.track` sees it."""

    finished = False


def test_a_snapshot_taken_before_the_core_got_the_requests_still_counts_them():
    """The lag this closes: a snapshot the core took before it received this host's latest requests arrives after
    they were sent; it does not count them (its `host_samples_queued` says so), so the host still does, and refuses
    in its own words ("about") what the core would refuse in its own."""
    admission = HostAdmission(max_num_queued_requests=3, max_num_queued_tokens=20)
    admission.admit(SchedulerStats(num_requests_waiting=1, num_waiting_tokens=4), [1] * 6, chat=False, num_samples=2)
    older = SchedulerStats(num_requests_waiting=1, num_waiting_tokens=4, num_steps_total=7)  # taken before they came
    assert admission.num_waiting(older) == 3
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=3: about 3 requests are already"):
        admission.admit(older, [1], chat=False)
    admission = HostAdmission(max_num_queued_requests=None, max_num_queued_tokens=20)
    admission.admit(SchedulerStats(num_requests_waiting=1, num_waiting_tokens=4), [1] * 6, chat=False, num_samples=2)
    with pytest.raises(EngineOverloadedError, match="about 16 tokens are already waiting and this prompt has about 5"):
        admission.admit(older, [1] * 5, chat=False)
    counts = SchedulerStats(num_requests_waiting=3, num_waiting_tokens=16, host_samples_queued=2)  # the core has them
    assert admission.num_waiting(counts) == 3
    admission.admit(counts, [1] * 4, chat=False)  # 16 + 4 <= 20: the snapshot's own count, no more


def test_the_snapshot_a_failing_request_is_checked_on_is_the_latest():
    """A request the core queued then failed (or refused: never counted) between two admissions: the replica's latest
    snapshot (`latest`), not yet seen by an admission, says which."""
    latest = _Stats(SchedulerStats())
    admission = HostAdmission(None, None, latest)  # type: ignore[arg-type]
    queued_then_failed = admission.admit(latest.scheduler, "a", chat=False, num_samples=2)
    refused = admission.admit(latest.scheduler, "b", chat=False)
    admission.admit(latest.scheduler, "c", chat=False)
    latest.scheduler = SchedulerStats(num_requests_waiting=2, host_samples_queued=2)  # a queued, b and c not yet
    queued_then_failed.retract()  # the snapshot counts it: no change
    refused.retract()  # the core refused it: it never counts
    assert admission.num_waiting(latest.scheduler) == 2 + 1  # a's 2 samples (the snapshot's) + c
    latest.scheduler = SchedulerStats(num_requests_waiting=2, host_samples_queued=3)  # c queued, a's samples ran
    assert admission.num_waiting(latest.scheduler) == 2


def test_a_restarted_core_counts_from_0_and_never_below():
    admission = HostAdmission(None, None)
    admission.num_waiting(SchedulerStats(host_samples_queued=100))  # the old core's count
    for prompt in "abc":
        admission.admit(SchedulerStats(host_samples_queued=100), prompt, chat=False)
    assert admission.num_waiting(SchedulerStats()) == 3  # a dead core's zeroed view: nothing counted by it
    assert admission.num_waiting(SchedulerStats(num_requests_waiting=1, host_samples_queued=1)) == 1 + 2  # a new core
    assert admission.num_waiting(SchedulerStats(num_requests_waiting=2, host_samples_queued=50)) == 2  # never < 0
    admission.admit(SchedulerStats(num_requests_waiting=2, host_samples_queued=50), "d", chat=False)
    assert admission.num_waiting(SchedulerStats(num_requests_waiting=2, host_samples_queued=50)) == 3
    assert admission.num_waiting(SchedulerStats(num_requests_waiting=2, host_samples_queued=51)) == 2


def test_a_request_that_ended_before_the_core_queued_it_stops_counting():
    """Aborted while still on its way (or dropped): an ended request first in line leaves the count, so none counts
    forever; one the core queued ahead of an elder (sent out of order) frees it once the elder is queued too."""
    admission = HostAdmission(None, None)
    aborted, request = admission.admit(SchedulerStats(), "a", chat=False), _Request()
    aborted.track(request)
    waiting, running = admission.admit(SchedulerStats(), "b", chat=False, num_samples=2), _Request()
    waiting.track(running)
    request.finished = True
    assert admission.num_waiting(SchedulerStats(num_steps_total=1)) == 2  # a left, b's 2 samples count
    admission.admit(SchedulerStats(), "c", chat=False)
    assert admission.num_waiting(SchedulerStats(num_requests_waiting=1, host_samples_queued=1)) == 1 + 3  # c first
    assert admission.num_waiting(SchedulerStats(num_requests_waiting=3, host_samples_queued=3)) == 3  # b too


def test_a_request_ended_before_the_core_got_it_stops_counting_without_a_new_snapshot():
    """Aborted while parked for its LoRA check (never sent: the core hears nothing, an idle one sends no snapshot):
    the next admission, on the same snapshot, must not count it, else `max_num_queued_requests` such aborts refuse
    every later request for good (none reaches the core, which would send the snapshot that frees them)."""
    admission = HostAdmission(max_num_queued_requests=1, max_num_queued_tokens=None)
    idle = SchedulerStats()
    parked, request = admission.admit(idle, "a", chat=False), _Request()
    parked.track(request)
    request.finished = True  # aborted while parked: no message to the core, no new snapshot
    assert admission.num_waiting(idle) == 0
    admission.admit(idle, "b", chat=False)  # the queue is empty: accepted


async def test_the_estimate_sees_a_snapshot_only_after_the_failures_delivered_before_it():
    """The core refuses b (behind a) and queues c; the processor thread delivers b's error, then takes the snapshot
    counting a and c for the metrics at once. The engine's estimate must see that snapshot only with its delivery,
    after b's error: seen before (as it was until 2026-12-07), its count of 2 went to a and b, and c, queued, stayed
    counted twice, a count too high that passes to the next request as long as traffic goes on."""
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.collector import RequestCollector

    engine = AsyncEngine("m", max_num_queued_requests=8)
    engine._loop = asyncio.get_running_loop()
    replica = engine._replicas.replicas[0]
    admission = replica.admission
    collectors = []
    for prompt in "abc":
        admitted = admission.admit(replica.queue_stats(), prompt, chat=False)
        collectors.append(RequestCollector(prompt, 0.0, 1, admitted=admitted))
        admitted.track(collectors[-1])
    engine._deliver_threadsafe(admission, [(collectors[1], EngineOverloadedError("the queue is full"))], None)
    snapshot = SchedulerStats(num_requests_waiting=2, host_samples_queued=2)
    replica.observer.on_scheduler_stats(snapshot, True)  # the processor thread, at once
    engine._deliver_threadsafe(admission, [], snapshot)
    assert replica.observer.stats.scheduler is snapshot and replica.queue_stats() is not snapshot
    assert admission.num_waiting(replica.queue_stats()) == 3  # the loop before the deliveries: a, b, c in flight
    await asyncio.sleep(0)
    assert collectors[1].finished and replica.queue_stats() is snapshot
    assert admission.num_waiting(replica.queue_stats()) == 2  # a and c, both in the snapshot's count, once


async def test_a_dead_cores_zeros_are_seen_before_the_next_cores_count():
    """A core that queued 2 of this host's samples dies; its replacement queues 3 more before any request is
    admitted. The dead core's zeros (`Replica.check_dead`) must reach the estimate first, or the new count reads as
    the old one going on: 1 more queued instead of 3, and two queued requests counted twice."""
    from types import SimpleNamespace

    from asyncllm.engine.async_engine import AsyncEngine

    engine = AsyncEngine("m")
    replica = engine._replicas.replicas[0]
    admission = replica.admission
    for prompt in "ab":
        admission.admit(replica.queue_stats(), prompt, chat=False)
    engine._on_delivery(admission, [], SchedulerStats(num_requests_waiting=2, host_samples_queued=2))
    assert admission.num_waiting(replica.queue_stats()) == 2
    replica.processor = SimpleNamespace(dead=RuntimeError("the core died"))
    replica.supervisor = SimpleNamespace(on_core_dead=lambda exc: None)  # type: ignore[assignment]
    replica.check_dead()
    assert replica.queue_stats().host_samples_queued == 0
    replica.processor = SimpleNamespace(dead=None)  # the next core
    for prompt in "cde":
        admission.admit(replica.queue_stats(), prompt, chat=False)
    engine._on_delivery(admission, [], SchedulerStats(num_requests_waiting=3, host_samples_queued=3))
    assert admission.num_waiting(replica.queue_stats()) == 3
