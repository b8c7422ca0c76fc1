"""A structured request whose allowed_token_ids / bad_words forbid what its grammar allows next (the workers then
sample token 0, which the grammar refuses): where the grammar may end (it is complete and only EOS, forbidden, is
left) the request ends "stop" without that token; anywhere else it fails naming the fields."""

from __future__ import annotations

import time

import numpy as np
import pytest

from asyncllm import SamplingParams, StructuredOutputs, protocol
from asyncllm.sched.request import Request
from asyncllm.structured.narrowing import stop_before

A, B, C, EOS = 70, 71, 72, 1  # 'a', 'b', 'c', </s> of the tiny tokenizer
pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def manager(tiny_llama: str):
    from asyncllm.structured.manager import StructuredOutputManager

    manager = StructuredOutputManager(tiny_llama, 512, compile_timeout_s=60.0, max_drafts=4)
    yield manager
    manager.shutdown()


def _scheduled(manager, req_id: str, structured: StructuredOutputs, **params) -> None:
    """Add a request and wait until its matcher is made."""
    message = protocol.AddRequest(req_id, [5, 6, 7], SamplingParams(max_tokens=20, structured=structured, **params),
                                  [EOS], time.time())
    manager.add(Request.from_add_request(message, b"c"))
    deadline = time.monotonic() + 60
    while req_id not in manager.matchers:
        ready, failed = manager.poll()
        assert not failed and time.monotonic() < deadline
        time.sleep(0.01)


def _accept(manager, req_id: str, tokens: list[int], finish_reason: str | None = None):
    """(the step's outputs after `accept`, the requests it finished)."""
    outputs = [(b"c", protocol.RequestOutputDelta(req_id, tokens, finish_reason))]
    finished: list[list[str]] = []
    manager.accept(outputs, finished.append)
    return [(client, delta.new_token_ids, delta.finish_reason, delta.error) for client, delta in outputs], finished


@pytest.mark.parametrize("structured, allowed, tokens, extra", [
    (StructuredOutputs(choice=["a", "b"]), [A, B], [A], {}),
    (StructuredOutputs(choice=["a", "b"]), [A, B], [A], {"ignore_eos": True}),
    (StructuredOutputs(regex="[a-c]{1,3}"), [A, B, C], [C, B, A], {}),
    (StructuredOutputs(choice=["a", "b"]), None, [B], {"bad_words_token_ids": [[EOS]]}),
])
def test_a_complete_grammar_whose_eos_is_forbidden_ends_stop(manager, structured, allowed, tokens, extra) -> None:
    _scheduled(manager, "r", structured, allowed_token_ids=allowed, **extra)
    assert _accept(manager, "r", tokens) == ([(b"c", tokens, None, None)], [])
    assert _accept(manager, "r", [0]) == ([(b"c", [], "stop", None)], [["r"]])  # token 0 dropped
    assert "r" not in manager.matchers and "r" not in manager.narrowed


def test_drafted_tokens_end_before_the_refused_one_on_an_ending_delta(manager) -> None:
    """A step's accepted drafts then the refused token: the drafts stay (not finished: the host would take the
    last token of a "stop" delta for its EOS), an empty "stop" delta follows."""
    _scheduled(manager, "d", StructuredOutputs(regex="[a-c]{1,3}"), allowed_token_ids=[A, B, C])
    assert _accept(manager, "d", [A, B, C, 0]) == ([(b"c", [A, B, C], None, None), (b"c", [], "stop", None)],
                                                  [["d"]])
    _scheduled(manager, "l", StructuredOutputs(choice=["a", "b"]), allowed_token_ids=[A, B])
    # the scheduler ended it by length with the refused token: it ends "stop" without it, not finished again
    assert _accept(manager, "l", [A, 0], "length") == ([(b"c", [A], None, None), (b"c", [], "stop", None)], [])
    assert not manager.matchers


@pytest.mark.parametrize("structured, allowed, tokens", [
    (StructuredOutputs(regex="[0-9]"), [A], []),  # nothing written yet
    (StructuredOutputs(choice=["ab", "b"]), [A], [A]),  # 'a' is not a whole choice
    (StructuredOutputs(regex="[a-c]{2,3}"), [A, B, C], [C]),
])
def test_a_grammar_that_cannot_end_there_still_fails_the_request(manager, structured, allowed, tokens) -> None:
    _scheduled(manager, "f", structured, allowed_token_ids=allowed)
    outputs, finished = _accept(manager, "f", tokens + [0])
    [(_, new_tokens, finish_reason, error)] = outputs
    assert (new_tokens, finish_reason, finished) == (tokens + [0], "abort", [["f"]])
    assert error.startswith("allowed_token_ids: forbids every token the grammar (structured output) allows next")


@pytest.mark.parametrize("tokens, dropped", [([A, B, C, 0], 1), ([A, 0, B], 2), ([0, A], 2)])
def test_the_trimmed_delta_keeps_one_logprobs_row_per_token(tokens, dropped) -> None:
    width, kept = 2, len(tokens) - dropped
    ids = np.int32([[token, token + 1] for token in tokens])
    arrays = protocol.LogprobsArrays(width, ids.tobytes(), (-ids).astype("<f4").tobytes(),
                                     np.int32(range(1, len(tokens) + 1)).tobytes())
    delta = protocol.RequestOutputDelta("t", list(tokens), logprobs=arrays)
    stop_before(b"c", delta, dropped)
    if not kept:
        assert delta.logprobs is None and delta.finish_reason == "stop"
        return
    assert np.frombuffer(delta.logprobs.token_ids, "<i4").reshape(-1, width).tolist() == ids[:kept].tolist()
    assert np.frombuffer(delta.logprobs.logprobs, "<f4").tolist() == (-ids[:kept]).ravel().tolist()
    assert np.frombuffer(delta.logprobs.ranks, "<i4").tolist() == list(range(1, kept + 1))
