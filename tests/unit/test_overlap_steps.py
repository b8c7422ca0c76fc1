"""The core's overlapped step (asyncllm/engine/overlap.py) over a real scheduler and real worker processes
running a fake runner: the core schedules and submits step N+1 before it collects step N.

The runner holds step 0 until a gate file exists, and the test opens the gate only when the core schedules
step 1: a core that waited for step 0 before scheduling step 1 would never get it back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncllm.config import EngineConfig
from asyncllm.engine.overlap import OverlappedSteps
from asyncllm.errors import EngineDeadError
from asyncllm.protocol import ModelRunnerOutput, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler
from asyncllm.workers.executor import Executor

_GATE_ENV = "ASYNCLLM_TEST_OVERLAP_GATE"


class GatedRunner:
    """Samples ``1000 * step_id + 100 + tokens scheduled`` for every request (as test_executor's FakeRunner);
    step 0 waits for the file named by $ASYNCLLM_TEST_OVERLAP_GATE (workers load this file by path)."""

    def __init__(self, config: EngineConfig, rank: int, tp_size: int, device: object) -> None:
        pass

    def load_model(self) -> None:
        pass

    def determine_num_available_blocks(self) -> int:
        return 100

    def init_cache(self, num_gpu_blocks: int) -> None:
        pass

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        if sched_out.step_id == 0:
            gate, deadline = Path(os.environ[_GATE_ENV]), time.monotonic() + 60
            while not gate.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("step 0 waited 60 s for the core to schedule step 1")
                time.sleep(0.01)
        req_ids = list(sched_out.num_scheduled_tokens)
        base = 1000 * sched_out.step_id + 100
        return ModelRunnerOutput(sched_out.step_id, req_ids, [[base + sched_out.num_scheduled_tokens[r]] for r in req_ids])


def make_config(**kwargs: object) -> EngineConfig:
    return EngineConfig.create("/nonexistent/fake-model", max_model_len=64, device="cpu", async_scheduling=True,
                               **kwargs)


def _fake_core(scheduler: Scheduler, executor: Executor) -> SimpleNamespace:
    sent: list = []

    def recover_workers(exc: EngineDeadError) -> None:
        raise exc

    return SimpleNamespace(scheduler=scheduler, executor=executor, structured=SimpleNamespace(matchers={}),
                           send_outputs=sent.extend, recover_workers=recover_workers, sent=sent,
                           forget_failed=lambda failed: None)  # (no multimodal items here)


def test_step_n_plus_1_is_submitted_before_step_n_is_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "gate"
    monkeypatch.setenv(_GATE_ENV, str(gate))
    config = make_config(worker_step_timeout_s=90.0)
    with Executor(config, runner=f"{__file__}:GatedRunner") as executor:
        executor.init_cache(executor.start())
        scheduler = Scheduler(config, 16, config.max_model_len)
        core = _fake_core(scheduler, executor)
        overlap = OverlappedSteps(core)  # type: ignore[arg-type]
        schedule = scheduler.schedule

        def schedule_and_open_the_gate() -> SchedulerOutput:
            if scheduler._step_id == 1:
                assert executor.num_steps_in_flight == 1 and not gate.exists()  # step 0 is still held
                gate.touch()
            return schedule()

        scheduler.schedule = schedule_and_open_the_gate  # type: ignore[method-assign]
        for req_id, prompt, max_tokens in (("a", [5, 6, 7, 8], 3), ("b", [9, 10], 1)):
            scheduler.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), [0], 0.0))
        while scheduler.has_unfinished_requests():
            overlap.step([], False)
        overlap.drain([])
        assert executor.num_steps_in_flight == 0 and gate.exists()
    tokens: dict[str, list[int]] = {}
    for _, delta in core.sent:
        tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    # FakeRunner's token: 1000 * step + 100 + tokens scheduled. "a" decoded in step 3 and "b" in step 1
    # (scheduled before their last tokens were known): those tokens were dropped.
    assert tokens == {"a": [104, 1101, 2101], "b": [102]}
    assert scheduler.num_steps_total == 4 and scheduler.kv_cache_manager.num_used_blocks == 0
    assert overlap.num_sync_steps == 0


def test_a_worker_failure_with_two_steps_in_flight_rewinds_both(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Step 0 fails (the gate never opens before the watchdog) after step 1 was submitted: nothing is applied."""
    monkeypatch.setenv(_GATE_ENV, str(tmp_path / "never"))
    config = make_config(worker_step_timeout_s=1.0)
    with Executor(config, runner=f"{__file__}:GatedRunner") as executor:
        executor.init_cache(executor.start())
        scheduler = Scheduler(config, 16, config.max_model_len)
        core = _fake_core(scheduler, executor)
        lost: list[EngineDeadError] = []
        core.recover_workers = lost.append
        overlap = OverlappedSteps(core)  # type: ignore[arg-type]
        request = Request("a", [5, 6, 7], SamplingParams(max_tokens=4), [0], 0.0)
        scheduler.add_request(request)
        overlap.step([], False)  # step 0: submitted, held by the runner
        assert (request.num_computed_tokens, request.num_tokens) == (3, 4)
        overlap.step([], False)  # step 1 submitted, then step 0 times out
        assert len(lost) == 1 and "worker_step_timeout_s=1.0" in str(lost[0])
        assert not overlap.in_flight
        assert (request.num_computed_tokens, request.num_tokens, request.all_token_ids) == (0, 3, [5, 6, 7])
        assert not [delta for _, delta in core.sent if delta.new_token_ids]


def test_submitted_steps_come_back_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "open"
    gate.touch()
    monkeypatch.setenv(_GATE_ENV, str(gate))
    with Executor(make_config(worker_step_timeout_s=30.0), runner=f"{__file__}:GatedRunner") as executor:
        executor.init_cache(executor.start())
        for step_id in range(3):
            executor.submit(SchedulerOutput(step_id, [], [], {"a": step_id + 1}, step_id + 1))
        assert executor.num_steps_in_flight == 3
        outs = [executor.collect() for _ in range(3)]
        assert [(o.step_id, o.sampled_token_ids) for o in outs] == [(0, [[101]]), (1, [[1102]]), (2, [[2103]])]
        with pytest.raises(AssertionError, match="no step in flight"):
            executor.collect()
        executor.submit(SchedulerOutput(3, [], [], {"a": 1}, 1))
        with pytest.raises(AssertionError, match="steps still in flight"):
            executor.execute_model(SchedulerOutput(4, [], [], {"a": 1}, 1))
        assert executor.collect().step_id == 3
        assert executor.execute_model(SchedulerOutput(5, [], [], {"a": 2}, 2)).sampled_token_ids == [[5102]]


def test_a_step_that_admits_requests_sends_fresh_stats_before_its_outputs(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step after an idle pipeline collects nothing when it is submitted: the hosts still hear at once
    that its requests left the queue (a long step showed them waiting, aborted or not, until it ended)."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(_GATE_ENV, str(gate))
    with Executor(make_config(worker_step_timeout_s=30.0), runner=f"{__file__}:GatedRunner") as executor:
        executor.init_cache(executor.start())
        scheduler = Scheduler(make_config(), 16, 64)
        core = _fake_core(scheduler, executor)
        snapshots: list = []
        core.send_outputs = lambda outputs: snapshots.append(scheduler.get_stats())
        overlap = OverlappedSteps(core)  # type: ignore[arg-type]
        scheduler.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=1), [0], 0.0))
        overlap.step([], False)  # step 0 admits "a" and is held by the runner
        assert overlap.in_flight and len(snapshots) == 1
        assert (snapshots[0].num_requests_running, snapshots[0].num_requests_waiting) == (1, 0)
        gate.touch()
        overlap.drain([])
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("sync_from", [None, 3])
def test_a_steps_outputs_go_out_after_the_next_step_is_submitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 sync_from: int | None) -> None:
    """Between step N's output reaching the core and step N+2's submission lie only the apply and the schedule:
    step N's outputs (collected while N+1 runs) go to the hosts after N+2 is submitted, none is lost, and each
    message holds one step's (a host applies a message's full deltas before its tokens). With `sync_from`, a
    grammar makes the steps from then on synchronous: the held step goes out before the one collected then."""
    gate = tmp_path / "open"
    gate.touch()
    monkeypatch.setenv(_GATE_ENV, str(gate))
    with Executor(make_config(worker_step_timeout_s=30.0), runner=f"{__file__}:GatedRunner") as executor:
        executor.init_cache(executor.start())
        scheduler = Scheduler(make_config(), 16, 64)
        core = _fake_core(scheduler, executor)
        events: list[tuple[str, int]] = []
        submit = executor.submit

        def logged_submit(sched_out: SchedulerOutput) -> None:
            events.append(("submit", sched_out.step_id))
            if sched_out.step_id == sync_from:  # from now on, steps need every token known
                core.structured = SimpleNamespace(matchers={"a": None}, grammar_bitmask=lambda *args: None,
                                                  accept=lambda *args: None)
            submit(sched_out)

        def logged_send(outputs: object) -> None:
            steps = {token // 1000 for _, delta in outputs for token in delta.new_token_ids}  # the steps that sampled
            assert len(steps) <= 1, f"one message holds the outputs of steps {steps}"
            for _, delta in outputs:
                events.extend(("send", token // 1000) for token in delta.new_token_ids)
                core.sent.append(delta)

        executor.submit, core.send_outputs = logged_submit, logged_send  # type: ignore[method-assign]
        overlap = OverlappedSteps(core)  # type: ignore[arg-type]
        scheduler.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=6), [0], 0.0))
        while scheduler.has_unfinished_requests():
            overlap.step([], False)
        overlap.drain([])
    submitted = [step for what, step in events if what == "submit"]
    sent = [step for what, step in events if what == "send"]
    # step 6: a decode scheduled before "a" finished (overlapped), or the workers told that it finished (sync)
    assert sent == list(range(6)) and submitted == list(range(7))
    for step in sent[:-2] if sync_from is None else sent[:sync_from - 2]:
        assert events.index(("submit", step + 2)) < events.index(("send", step)), events
    assert [token for delta in core.sent for token in delta.new_token_ids] == [103] + [1000 * s + 101 for s in range(1, 6)]
