"""Admission groups (asyncllm/sched/admission.py `AdmissionGroups`, asyncllm/engine/admission.py `admission_group`):
an empty queue accepts a whole group, on the host and in the core; a busy one checks it request by request."""

from __future__ import annotations

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


def test_the_host_admits_a_group_that_found_the_queue_empty_whole():
    admission = HostAdmission(max_num_queued_requests=2, max_num_queued_tokens=None)
    stats = SchedulerStats()
    for prompt in "abcde":  # 0, 1, 2, ... counted as waiting: the third on would pass the limit alone
        admission.admit(stats, prompt, chat=False, group="g1")
    assert admission.num_waiting(stats) == 5  # still counted, for other requests and the balancer
    with pytest.raises(EngineOverloadedError, match="about 5 requests are already waiting"):
        admission.admit(stats, "x", chat=False)  # ungrouped: checked as ever
    with pytest.raises(EngineOverloadedError):
        admission.admit(stats, "x", chat=False, group="g2")  # another group found the queue busy


def test_the_host_checks_a_group_that_found_the_queue_busy_request_by_request():
    admission = HostAdmission(max_num_queued_requests=3, max_num_queued_tokens=None)
    stats = SchedulerStats(num_requests_waiting=1)
    admission.admit(stats, "a", chat=False, group="g")  # 1 + 1
    admission.admit(stats, "b", chat=False, group="g")  # 2 + 1
    with pytest.raises(EngineOverloadedError, match="about 3 requests"):
        admission.admit(stats, "c", chat=False, group="g")  # refused as the three together would be


def test_the_core_admits_a_group_that_found_the_queue_empty_whole():
    """`check_queue_capacity`: the group whose request last found the queue empty is open (its later requests pass
    whatever the queue holds); another group, or a request of none, is checked as ever; a group opened later closes
    it (a shared core: the groups of every host)."""
    groups, waiting = AdmissionGroups(), FCFSRequestQueue()

    def add(group: str, n: int = 1) -> None:
        request = Request(f"r{len(waiting)}", [1, 2, 3], SamplingParams(), [0], 0.0)
        request.admission_group, request.num_samples = group, n
        check_queue_capacity(waiting, request, groups, 2, None)
        waiting.add(request)

    for _ in range(4):
        add("host1-a")
    for refused in ("", "host2-b"):
        with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=2: 4 requests"):
            add(refused)
    add("host1-a", n=3)
    while len(waiting):
        waiting.pop()
    add("host2-b")  # found the queue empty: now the open group
    add("host2-b")
    with pytest.raises(EngineOverloadedError):
        add("host1-a")


def test_an_admission_group_reaches_the_streams_made_in_it_and_their_tasks():
    async def run() -> list[str]:
        options = RequestOptions()
        outside = RequestStream(None, "x", None, options, chat=False)  # type: ignore[arg-type]
        with admission_group() as group:
            with admission_group() as inner:
                assert inner == group  # nested: the outer group
            inside = RequestStream(None, "x", None, options, chat=False)  # type: ignore[arg-type]
            task = asyncio.ensure_future(asyncio.sleep(0, current_admission_group()))
        with admission_group() as other:
            assert other and other != group
        assert current_admission_group() == ""
        return [outside._options.admission_group, inside._options.admission_group, await task, group]

    outside, inside, in_task, group = asyncio.run(run())
    assert (outside, inside, in_task) == ("", group, group) and group
