"""Bidirectional image rows (Gemma 3): no prefill chunk ends inside them (the scheduler), a step's per-token
attention limits (the worker), an image longer than a step refused at arrival."""

from __future__ import annotations

import numpy as np
import pytest

from asyncllm import protocol
from asyncllm.errors import InvalidRequestError
from asyncllm.mm.embeddings import ScheduledSpan
from asyncllm.sched.chunking import whole_spans
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request
from asyncllm.workers.mm_runner import attend_limit
from test_scheduler import make_scheduler, run_step


def image(offset: int, length: int, bidirectional: bool = True) -> protocol.MultiModalItem:
    return protocol.MultiModalItem(f"h{offset}", offset, length, bidirectional=[0, length] if bidirectional else [])


@pytest.mark.parametrize(("computed", "new", "budget", "expected"), [
    (0, 12, 12, 10),   # would end inside rows 10..25: cut before them
    (10, 12, 20, 16),  # starts at them: stretched to their end (past a long-prefill threshold's 12)
    (10, 12, 12, 0),   # ... but the budget cannot hold them: wait
    (14, 4, 20, 12),   # starts inside them (a prefix-cache hit): the rest at once
    (0, 26, 40, 26),   # ends right after them
    (0, 8, 8, 8),      # ends before them
    (26, 12, 12, 4),   # past the first, would end inside the second (30..45)
])
def test_a_chunk_never_ends_inside_bidirectional_rows(computed, new, budget, expected):
    items = [image(10, 16), image(30, 16), image(50, 16, bidirectional=False)]
    assert whole_spans(items, computed, new, budget) == expected
    assert whole_spans(items[2:], 48, 10, 10) == 10  # causal rows split anywhere


def test_the_scheduler_cuts_prefill_chunks_at_image_rows():
    sched = make_scheduler(max_num_batched_tokens=12)
    prompt = list(range(100, 140))
    items = [image(6, 10), image(20, 12)]
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=2), [2], 0.0, mm_items=items))
    chunks = [run_step(sched)[0].num_scheduled_tokens.get("a") for _ in range(5)]
    assert chunks == [6, 12, 2, 12, 8]  # 0..5, 6..17 (the first image whole), 18..19, the second image, the rest


def test_an_image_longer_than_a_step_is_refused_at_arrival():
    sched = make_scheduler(max_num_batched_tokens=8)
    request = Request("a", list(range(100, 120)), SamplingParams(max_tokens=2), [2], 0.0, mm_items=[image(2, 10)])
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens=8"):
        sched.add_request(request)


def test_attend_limits_reach_each_image_rows_end():
    items = {"a": [image(2, 4)], "b": [image(0, 3, bidirectional=False)]}
    spans = [ScheduledSpan("a", 0, 8, 0), ScheduledSpan("b", 5, 2, 8)]
    flat = np.array([0, 1, 2, 3, 4, 5, 6, 7, 5, 6], np.int64)
    limit = attend_limit(items, spans, flat, 12, "cpu")
    assert limit.tolist() == [0, 1, 5, 5, 5, 5, 6, 7, 5, 6, 0, 0]  # padding rows past the step: 0
    assert attend_limit({"b": items["b"]}, spans[1:], flat[8:], 2, "cpu") is None  # no bidirectional rows: causal
