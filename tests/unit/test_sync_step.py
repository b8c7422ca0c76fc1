"""The core's synchronous step (asyncllm/engine/sync_step.py) over a real scheduler and a stub executor: a step
that admits a request sends a fresh stats snapshot (and the timeouts) before it runs; a step that moves no
request sends once, after it. The engine-level checks: tests/engine/test_async_scheduling.py and
tests/engine/test_spec_decode_engine.py (`snapshot_before_first_output`)."""

from __future__ import annotations

from types import SimpleNamespace

from asyncllm.config import EngineConfig
from asyncllm.engine.sync_step import sync_step
from asyncllm.protocol import ModelRunnerOutput, RequestOutputDelta, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler
from asyncllm.sched.step_outputs import StepOutputs


def test_a_step_that_admits_sends_fresh_stats_before_it_runs() -> None:
    scheduler = Scheduler(EngineConfig.create("/nonexistent/fake-model", max_model_len=64, device="cpu"), 16, 64)
    sent: list[tuple[list[str], int, int]] = []  # (request ids of the deltas, running, waiting) per send
    sent_before_step: list[int] = []

    def send_outputs(outputs: StepOutputs | list) -> None:
        deltas = outputs.deltas if isinstance(outputs, StepOutputs) else outputs
        stats = scheduler.get_stats()
        sent.append(([delta.request_id for _, delta in deltas], stats.num_requests_running, stats.num_requests_waiting))

    def execute_model(sched_out: SchedulerOutput) -> ModelRunnerOutput:
        sent_before_step.append(len(sent))
        req_ids = list(sched_out.num_scheduled_tokens)
        return ModelRunnerOutput(sched_out.step_id, req_ids, [[100] for _ in req_ids])

    core = SimpleNamespace(scheduler=scheduler, executor=SimpleNamespace(execute_model=execute_model),
                           structured=SimpleNamespace(matchers={}), send_outputs=send_outputs,
                           forget_failed=lambda failed: None)
    scheduler.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=2), [0], 0.0))
    timed_out = (b"h", RequestOutputDelta("t", []))
    sync_step(core, [timed_out], False)  # type: ignore[arg-type] - admits "a"
    assert sent_before_step == [1] and sent[0] == (["t"], 1, 0)  # "a" runs and the timeout went out with it
    sync_step(core, [], False)  # type: ignore[arg-type] - decodes "a" (its last token): one send, after the step
    assert sent_before_step == [1, 2] and len(sent) == 3
    assert not scheduler.has_unfinished_requests()
