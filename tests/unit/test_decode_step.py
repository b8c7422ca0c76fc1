"""The vectorized decode step (asyncllm/sched/decode_step.py) against the scheduler's per-request loops.

The same random workload runs twice, once with `schedule_decodes` /
`update_decodes` and once with them declining every step: every
`SchedulerOutput` and every output for the hosts must be equal, step by step
(several hosts, EOS and stop tokens, min_tokens, length limits, aborts between
`schedule()` and `update_from_output()`, preemption, prefix caching, the
overlapped schedule's placeholders). `RequestRows` itself is tested below.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.sampling import SamplingParams
from asyncllm.sched import scheduler as scheduler_module
from asyncllm.sched.placeholders import OutputPlaceholders
from asyncllm.sched.request import Request
from asyncllm.sched.rows import RequestRows
from asyncllm.sched.scheduler import Scheduler

VOCAB = 40
EOS = 2


def fake_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens[-6:])) + len(tokens)) % VOCAB


class Worker:
    """Token lists from the step diffs; samples `fake_token` at the end of each request's known tokens."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def execute(self, out: protocol.SchedulerOutput) -> protocol.ModelRunnerOutput:
        """Steps run in order, so a step's token is known to the next (as a placeholder's is to a real worker)."""
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.tokens.pop(req_id, None)
        computed = {new.req_id: new.num_computed_tokens for new in out.new_reqs}
        for new in out.new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
        computed.update(zip(out.cached_reqs.req_ids, out.cached_reqs.num_computed_tokens))
        req_ids, sampled = [], []
        for req_id, num in out.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            req_ids.append(req_id)
            if computed[req_id] + num >= len(tokens):
                token = fake_token(tokens)
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return protocol.ModelRunnerOutput(out.step_id, req_ids, sampled)


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randint(1, 30), min_tokens=rng.choice([0, 0, 3]),
                          stop_token_ids=rng.choice([[], [], [7], [7, 11]]), ignore_eos=rng.random() < 0.3)


def run_workload(seed: int, vectorized: bool, overlapped: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    """Every step's scheduler output and host outputs, as plain data."""
    if not vectorized:
        monkeypatch.setattr(scheduler_module, "schedule_decodes", lambda sched, step: 0)
        monkeypatch.setattr(scheduler_module, "update_decodes", lambda *args: None)
    rng = random.Random(seed)
    block_size, max_num_seqs = rng.choice([1, 2, 4]), rng.choice([3, 8, 64])
    budget = max(rng.choice([16, 64, 512]), max_num_seqs)  # vLLM's rule: at least max_num_seqs
    config = EngineConfig.create("dummy-model", block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=budget, enable_prefix_caching=rng.random() < 0.7,
                                 preemption_mode=rng.choice(["recompute", "swap"]), max_model_len=64)
    sched = Scheduler(config, num_gpu_blocks=rng.choice([24, 48, 400]), max_model_len=64, num_cpu_blocks=64)
    worker, in_flight, log = Worker(), [], []
    placeholders = OutputPlaceholders(sched) if overlapped else None
    stems = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(3)]
    for step in range(160):
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            prompt = rng.choice(stems)[: rng.randint(0, 12)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
            sched.add_request(Request(f"r{step}-{rng.random():.6f}", prompt, _params(rng), [EOS], float(step),
                                      client_id=rng.choice([b"a", b"b", b"c"])))
        if placeholders is not None and in_flight and placeholders.may_preempt():
            log.append(_outputs(placeholders.commit(worker.execute(in_flight.pop()))))
        out = sched.schedule()
        log.append(msgspec.to_builtins(out))
        if rng.random() < 0.05 and sched.requests:  # an abort that lands while the step runs
            sched.abort_requests([rng.choice(list(sched.requests))])
        if placeholders is None:
            log.append(_outputs(sched.update_from_output(out, worker.execute(out))))
            continue
        placeholders.advance(out)
        in_flight.insert(0, out)
        if len(in_flight) > 1:
            log.append(_outputs(placeholders.commit(worker.execute(in_flight.pop()))))
    return log


def _outputs(step_outputs) -> list:
    """The deltas (their events by type: the timestamps differ between runs) and the token lists by host."""
    deltas = [(client, delta.request_id, delta.new_token_ids, delta.finish_reason, delta.stop_reason,
               delta.num_cached_tokens, delta.error, [event.type for event in delta.events or ()])
              for client, delta in step_outputs.deltas]
    return deltas + sorted((client, ids, tokens) for client, (ids, tokens) in step_outputs.tokens.items())


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("seed", range(10))
def test_vectorized_steps_equal_the_per_request_loops(seed: int, overlapped: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fast = run_workload(seed, True, overlapped, monkeypatch)
    monkeypatch.undo()
    slow = run_workload(seed, False, overlapped, monkeypatch)
    assert len(fast) > 160 and fast == slow


def test_request_rows_hold_the_counters_of_running_requests() -> None:
    rows = RequestRows(capacity=2)
    requests = [Request(f"r{i}", [1, 2, 3][: i + 1], SamplingParams(max_tokens=5, stop_token_ids=[9 + i % 2]), [2], 0.0)
                for i in range(5)]
    for i, request in enumerate(requests):
        request.num_computed_tokens = i
        rows.attach(request)  # the third one doubles the capacity, the fifth doubles it again
    assert rows.capacity == 8
    assert [r.num_computed_tokens for r in requests] == [0, 1, 2, 3, 4]
    assert rows.computed[[r._row for r in requests]].tolist() == [0, 1, 2, 3, 4]
    assert rows.quiet_delta_from[requests[2]._row] == 3 + 5 and rows.delta_from[requests[2]._row] == 0
    assert rows.stop_tokens == {2, 9, 10}
    requests[1].num_tokens += 1  # through the row
    assert rows.tokens[requests[1]._row] == 3
    record = rows.rows_of(requests)
    for request in requests[1::2]:  # stop running: the counters move back into the requests
        rows.detach(request)
    assert requests[1].num_tokens == 3 and requests[3].num_computed_tokens == 3
    assert record.live(rows).tolist() == [True, False, True, False, True]
    rows.attach(requests[1])  # a new serial: the old record does not see it as live
    assert record.live(rows).tolist() == [True, False, True, False, True]
    for request in requests[::2] + [requests[1]]:
        rows.detach(request)
    assert rows.stop_tokens == frozenset()


def test_request_rows_count_the_hosts_of_running_requests_only() -> None:
    """A shared core's hosts come and go: one that has no running request leaves the count (one host: the decode
    step's fast path), and its number goes to the next host, never to two hosts at once."""
    rows = RequestRows(capacity=2)
    params = SamplingParams(max_tokens=5)
    a, b, b2, c = (Request(name, [1], params, [2], 0.0, client_id=client)
                   for name, client in (("a", b"A"), ("b", b"B"), ("b2", b"B"), ("c", b"C")))
    for request in (a, b, b2):
        rows.attach(request)
    assert rows.num_clients == 2 and rows.client[b._row] == rows.client[b2._row] != rows.client[a._row]
    rows.detach(a)
    rows.detach(b)
    assert rows.num_clients == 1  # B still runs b2
    rows.attach(c)  # takes A's number, not B's
    assert rows.num_clients == 2 and rows.client[c._row] != rows.client[b2._row]
    for request in (b2, c):
        rows.detach(request)
    assert rows.num_clients == 0


def test_only_steps_that_run_are_recorded() -> None:
    """The core skips empty steps (no update follows): an idle scheduler keeps no step records."""
    config = EngineConfig.create("dummy-model", block_size=4, max_model_len=64)
    sched = Scheduler(config, num_gpu_blocks=8, max_model_len=64)
    for _ in range(100):
        sched.schedule()
    assert sched.step_records == {}
    sched.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2), [EOS], 0.0))
    out = sched.schedule()
    assert list(sched.step_records) == [out.step_id]
    sched.update_from_output(out, Worker().execute(out))
    assert sched.step_records == {}


def test_a_token_the_worker_sampled_for_another_request_is_never_applied() -> None:
    """A mixed step (one request decodes, another computes a prompt chunk) whose output holds one token, but on the
    chunk's request: the vectorized update must not hand it to the decoding one (the counts alone agree); the
    per-request loop refuses the step instead."""
    config = EngineConfig.create("dummy-model", block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                                 max_model_len=64)
    sched = Scheduler(config, num_gpu_blocks=64, max_model_len=64)
    sched.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=10), [EOS], 0.0))
    first = sched.schedule()
    sched.update_from_output(first, protocol.ModelRunnerOutput(first.step_id, ["a"], [[9]]))
    sched.add_request(Request("b", list(range(3, 23)), SamplingParams(max_tokens=10), [EOS], 1.0))
    mixed = sched.schedule()
    assert mixed.num_scheduled_tokens == {"a": 1, "b": 7}
    tokens_before = list(sched.requests["a"].all_token_ids)
    with pytest.raises(AssertionError, match="sampled no token for a"):
        sched.update_from_output(mixed, protocol.ModelRunnerOutput(mixed.step_id, ["a", "b"], [[], [11]]))
    assert sched.requests["a"].all_token_ids == tokens_before
