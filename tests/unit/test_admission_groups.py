"""Admission groups (asyncllm/sched/admission.py `AdmissionGroups`, asyncllm/engine/admission.py `admission_group`):
a group that found the queue empty may pass the limits by its size, on the host and in the core; a busy one is
checked request by request."""

from __future__ import annotations

import itertools

import asyncio

import pytest

from asyncllm import SamplingParams
from asyncllm.engine.admission import HostAdmission, admission_group, current_admission_group
from asyncllm.engine.stream import RequestOptions, RequestStream
from asyncllm.errors import EngineOverloadedError
from asyncllm.protocol import SchedulerStats
from asyncllm.sched.admission import AdmissionGroups, check_queue_capacity
from asyncllm.sched.queue import FCFSRequestQueue
from asyncllm.sched.request import Request


def test_the_host_admits_a_group_that_found_the_queue_empty_up_to_its_size():
    admission = HostAdmission(max_num_queued_requests=2, max_num_queued_tokens=None)
    stats = SchedulerStats()
    for prompt in "abcd":  # 0, 1, 2, 3 counted as waiting: the limit 2 raised by the group's size 2
        admission.admit(stats, prompt, chat=False, group="g1/2")
    assert admission.num_waiting(stats) == 4  # still counted, for other requests and the balancer
    with pytest.raises(EngineOverloadedError, match=r"=2 \(its admission group may pass it by 2\): about 4 requests"):
        admission.admit(stats, "e", chat=False, group="g1/2")  # its allowance spent: refused, however long it lasts
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=2: about 4 requests are already waiting"):
        admission.admit(stats, "x", chat=False)  # ungrouped: checked as ever
    with pytest.raises(EngineOverloadedError):
        admission.admit(stats, "x", chat=False, group="g2/9")  # another group found the queue busy


def test_the_host_checks_a_group_that_found_the_queue_busy_request_by_request():
    admission = HostAdmission(max_num_queued_requests=3, max_num_queued_tokens=None)
    stats = SchedulerStats(num_requests_waiting=1)
    admission.admit(stats, "a", chat=False, group="g/3")  # 1 + 1
    admission.admit(stats, "b", chat=False, group="g/3")  # 2 + 1
    with pytest.raises(EngineOverloadedError, match="about 3 requests"):
        admission.admit(stats, "c", chat=False, group="g/3")  # its first two admitted, the third refused


def _core_queue(limit: int):
    groups, waiting, ids = AdmissionGroups(), FCFSRequestQueue(), itertools.count()

    def add(group: str, n: int = 1) -> None:
        request = Request(f"r{next(ids)}", [1, 2, 3], SamplingParams(), [0], 0.0)  # unique: a queue refuses repeats
        request.admission_group, request.num_samples = group, n
        check_queue_capacity(waiting, request, groups, limit, None)
        waiting.add(request)

    return groups, waiting, add


def test_the_core_admits_a_group_that_found_the_queue_empty_up_to_its_size():
    """`check_queue_capacity`: a group whose request found the queue empty is open: its later requests pass the limit
    by its size whatever the queue holds; another group, or a request of none, is checked as ever."""
    groups, waiting, add = _core_queue(2)
    for _ in range(4):
        add("host1-a/2")
    for refused in ("", "host2-b/5"):
        with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=2: 4 requests"):
            add(refused)
    with pytest.raises(EngineOverloadedError, match="may pass it by 2"):
        add("host1-a/2")  # its allowance spent
    while len(waiting):
        waiting.pop()
    add("host2-b/5")  # found the queue empty: open too
    add("host1-a/2", n=3)  # still open: 1 + 3 <= 2 + 2
    assert len(groups.open) == 2


def test_a_group_that_keeps_submitting_under_load_never_passes_its_size():
    """The review's case: a group open for good (a long generate_many, a beam search) while others submit: the queue
    never holds more than the limit plus the group's size, and the others get their turn."""
    groups, waiting, add = _core_queue(2)
    admitted = 0
    add("a/1")
    for step in range(200):
        order = ("a/1", "", f"http-{step}/1")
        for group in order if step % 2 else order[::-1]:  # who submits first when a seat frees alternates
            try:
                add(group)
                admitted += group != "a/1"
            except EngineOverloadedError:
                pass
        if step % 3 == 0 and len(waiting):
            waiting.pop()  # the scheduler takes one now and then
        assert len(waiting) <= 3
    assert admitted > 0


def test_two_groups_open_at_once_each_keep_their_allowance():
    """A batch's next requests after another group found the queue empty (and opened) are still its own: not
    refused midway (one open slot, taken by the other group, refused the batch's next)."""
    groups, waiting, add = _core_queue(2)
    for _ in range(4):
        add("batch/4")
    while len(waiting):
        waiting.pop()
    add("other/1")
    for _ in range(4):
        add("batch/4")  # 1 + 4 <= 2 + 4
    assert len(waiting) == 5
    for _ in range(AdmissionGroups.MAX_OPEN):
        groups.check(f"g{_}/1", 0, 0, 1, 1, 2, None)
    assert len(groups.open) == AdmissionGroups.MAX_OPEN and "batch" not in groups.open  # bounded: oldest forgotten


def test_scoring_gathers_its_requests_in_one_group_sized_by_them():
    """`score` / `embed`'s documents (`scoring._gather`) are one admission group of their count: an idle engine takes
    them all, past max_num_queued_requests (a request each, the limit's + 1st refused before)."""
    from asyncllm.engine import scoring

    async def made() -> str:
        return current_admission_group()

    groups = asyncio.run(scoring._gather([made() for _ in range(5)]))
    assert len(set(groups)) == 1 and groups[0].endswith("/5")


def test_an_admission_group_reaches_the_streams_made_in_it_and_their_tasks():
    async def run() -> list[str]:
        options = RequestOptions()
        outside = RequestStream(None, "x", None, options, chat=False)  # type: ignore[arg-type]
        with admission_group() as group:
            with admission_group(3) as inner:
                assert inner.split("/")[0] == group.split("/")[0] and inner.endswith("/3")  # nested: the outer group
            with admission_group(2, own=True) as step:
                assert step.split("/")[0] != group.split("/")[0] and step.endswith("/2")  # own: a new group
            group = current_admission_group()
            inside = RequestStream(None, "x", None, options, chat=False)  # type: ignore[arg-type]
            task = asyncio.ensure_future(asyncio.sleep(0, current_admission_group()))
        with admission_group() as other:
            assert other and other != group
        assert current_admission_group() == ""
        return [outside._options.admission_group, inside._options.admission_group, await task, group]

    outside, inside, in_task, group = asyncio.run(run())
    assert (outside, inside, in_task) == ("", group, group) and group
