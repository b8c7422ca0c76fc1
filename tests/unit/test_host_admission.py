"""The host's early admission check: estimates from the core's latest stats plus its own submissions."""

from __future__ import annotations

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


def test_submissions_count_until_the_next_snapshot():
    admission = HostAdmission(max_num_queued_requests=3, max_num_queued_tokens=None)
    stats = SchedulerStats(num_requests_waiting=1)
    admission.admit(stats, "a", chat=False)
    admission.admit(stats, "b", chat=False)  # 1 waiting + 1 submitted < 3
    with pytest.raises(EngineOverloadedError, match="max_num_queued_requests=3: about 3 requests"):
        admission.admit(stats, "c", chat=False)
    admission.admit(SchedulerStats(num_requests_waiting=2), "c", chat=False)  # a new snapshot: counts restart
    with pytest.raises(EngineOverloadedError):
        admission.admit(SchedulerStats(num_requests_waiting=3), "d", chat=False)


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
    stats = SchedulerStats(num_requests_waiting=1, num_waiting_tokens=60)
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


def test_a_failed_request_is_uncounted_until_a_new_snapshot():
    """`Admitted.retract`: a request failing before the next snapshot (refused, never queued) stops counting at once,
    and once only; after a new snapshot it is a no-op (the count restarted from that snapshot)."""
    admission = HostAdmission(max_num_queued_requests=2, max_num_queued_tokens=10)
    stats = SchedulerStats()
    refused = admission.admit(stats, [1] * 40, chat=False, num_samples=2)
    refused.retract()
    refused.retract()
    admission.admit(stats, [1] * 5, chat=False)  # 0 waiting: as if the refused one had never come
    admission.admit(stats, [1] * 5, chat=False)  # 5 + 5 <= 10 tokens, 1 + 1 <= 2 requests
    with pytest.raises(EngineOverloadedError):
        admission.admit(stats, [1], chat=False)
    counted = admission.admit(SchedulerStats(num_requests_waiting=1), [1], chat=False)
    new = SchedulerStats(num_requests_waiting=1)
    admission.admit(new, [1], chat=False)  # a new snapshot: counts 1 waiting + this one
    counted.retract()  # counted on the old snapshot: changes nothing
    with pytest.raises(EngineOverloadedError):
        admission.admit(new, [1], chat=False)
