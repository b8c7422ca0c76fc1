"""`StepOutputs`: one-token outputs travel as per-host id/token lists, everything else as full deltas (exact)."""

from __future__ import annotations

import msgspec

from asyncllm import protocol
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request
from asyncllm.sched.step_outputs import StepOutputs
from test_scheduler import make_request, make_scheduler


def _step(sched, tokens: dict[str, list[int]]) -> StepOutputs:  # type: ignore[no-untyped-def]
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    return sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, req_ids, [tokens[r] for r in req_ids]))


def test_decode_tokens_go_into_per_host_lists_and_the_rest_stays_deltas() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, client_id=b"h1", max_tokens=3))
    sched.add_request(make_request("b", 3, client_id=b"h2"))
    sched.add_request(make_request("c", 3, client_id=b"h1"))
    sched.add_request(make_request("d", 3, client_id=b"h1", logprobs=1))
    first = _step(sched, {"a": [7], "b": [8], "c": [9], "d": [10]})
    # first tokens carry the events and prefix-cache hits: full deltas, no lists
    assert [(c, d.request_id, d.new_token_ids) for c, d in first.deltas] == [
        (b"h1", "a", [7]), (b"h2", "b", [8]), (b"h1", "c", [9]), (b"h1", "d", [10])]
    assert first.tokens == {}
    second = _step(sched, {"a": [11], "b": [12], "c": [13], "d": [14]})
    assert second.tokens == {b"h1": (["a", "c"], [11, 13]), b"h2": (["b"], [12])}
    assert [(c, d.request_id) for c, d in second.deltas] == [(b"h1", "d")]  # logprobs attach to a delta
    third = _step(sched, {"a": [15], "b": [16], "c": [17], "d": [18]})
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for _, d in third.deltas] == [
        ("a", [15], "length"), ("d", [18], None)]
    assert third.tokens == {b"h1": (["c"], [17]), b"h2": (["b"], [16])}
    assert sched.get_stats().generation_tokens_total == 12


def test_iteration_length_and_concatenation() -> None:
    outs = StepOutputs([(b"h1", protocol.RequestOutputDelta("x", [1], "stop"))])
    outs.token_lists(b"h1")[0].append("y")
    outs.token_lists(b"h1")[1].append(2)
    assert len(outs) == 2 and outs
    assert [(c, d.request_id, d.new_token_ids) for c, d in outs] == [(b"h1", "x", [1]), (b"h1", "y", [2])]
    timeout = [(b"h2", protocol.RequestOutputDelta("t", [], "timeout"))]
    combined = timeout + outs
    assert isinstance(combined, StepOutputs)
    assert [d.request_id for _, d in combined] == ["t", "x", "y"]
    assert [d.request_id for _, d in outs + timeout] == ["x", "t", "y"]
    assert not StepOutputs() and len(StepOutputs()) == 0


def test_outputs_carry_the_token_lists_on_the_wire() -> None:
    message = protocol.Outputs([], None, 1.0, token_req_ids=["a", "b"], token_ids=[5, 6])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=protocol.CoreMessage)
    assert decoded == message
    bare = msgspec.msgpack.encode(protocol.Outputs([], None, 1.0))
    assert msgspec.msgpack.decode(bare, type=protocol.CoreMessage).token_req_ids == []


def test_requests_with_logprobs_or_a_grammar_never_use_the_lists() -> None:
    assert Request("a", [1], SamplingParams(), [2], 0.0).plain_outputs
    assert not Request("a", [1], SamplingParams(logprobs=0), [2], 0.0).plain_outputs
    assert not Request("a", [1], SamplingParams(prompt_logprobs=0), [2], 0.0).plain_outputs
    assert not Request("a", [1], SamplingParams(structured={"regex": "a+"}), [2], 0.0).plain_outputs
