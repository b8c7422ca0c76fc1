"""After a worker restart: the scheduler requeues every running request for recompute (exact state), and the
restart budget counts restarts within a sliding window."""

from __future__ import annotations

import pytest

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import EngineDeadError
from asyncllm.sampling import SamplingParams
from asyncllm.sched.recovery import requeue_all_for_recompute
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.scheduler import Scheduler
from asyncllm.workers.restart import RestartBudget, WorkerRestarter


def _scheduler(**fields) -> Scheduler:
    return Scheduler(EngineConfig.create("dummy-model", block_size=4, **fields), 16, 64)


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8, ignore_eos=True), [2], 0.0, client_id=b"host")


def _step(sched: Scheduler, token: int = 7) -> protocol.SchedulerOutput:
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[token] if sched.requests[r].num_computed_tokens + out.num_scheduled_tokens[r] ==
               sched.requests[r].num_tokens else [] for r in ids]
    sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, ids, sampled))
    return out


def test_running_requests_go_back_to_the_front_in_order_with_no_kv_left() -> None:
    sched = _scheduler()
    for req_id, start in (("a", 100), ("b", 200), ("c", 300)):
        sched.add_request(_request(req_id, list(range(start, start + 9))))
    _step(sched)
    _step(sched)
    sched.add_request(_request("d", list(range(400, 405))))
    _step(sched)  # a, b, c at 12 tokens (11 computed), d at 6 (5 computed)
    assert [r.request_id for r in sched.running] == ["a", "b", "c", "d"]
    outputs = {r.request_id: list(r.output_token_ids) for r in sched.running}
    assert [len(v) for v in outputs.values()] == [3, 3, 3, 1]
    assert sched.kv_cache_manager.num_used_blocks == 3 * 3 + 2
    assert sched.kv_cache_manager.pool.num_cached_blocks == 3 * 2 + 1  # full computed blocks

    preemptions = sched.num_preemptions_total
    assert requeue_all_for_recompute(sched) == 4
    assert sched.num_preemptions_total == preemptions + 4  # engine-wide, as each request's own count
    assert sched.running == []
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c", "d"]
    assert all(r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in sched.waiting)
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert sched.kv_cache_manager.pool.num_cached_blocks == 0  # the new workers' cache holds nothing
    assert sched.kv_cache_manager.pool.free_block_ids() == list(range(16))

    out = _step(sched)  # the new workers get every request whole: prompt + outputs so far, nothing computed
    assert [(n.req_id, n.num_computed_tokens, n.token_ids[n.num_prompt_tokens:]) for n in out.new_reqs] == [
        (req_id, 0, outputs[req_id]) for req_id in ("a", "b", "c", "d")]
    assert {r.request_id: r.output_token_ids for r in sched.running} == {k: v + [7] for k, v in outputs.items()}


def test_swapped_requests_lose_their_cpu_copies() -> None:
    sched = Scheduler(EngineConfig.create("dummy-model", block_size=4, preemption_mode="swap"), 16, 64,
                      num_cpu_blocks=8)
    sched.add_request(_request("a", list(range(100, 109))))
    _step(sched)
    sched.swap_space.swap_out("a", sched.kv_cache_manager.get_block_ids("a"), 9)
    assert sched.swap_space.num_used_blocks == 3
    requeue_all_for_recompute(sched)
    assert sched.swap_space.num_used_blocks == 0 and not sched.swap_space.is_swapped("a")


def test_restart_budget_counts_within_the_window() -> None:
    now = [0.0]
    budget = RestartBudget(2, window_s=600.0, clock=lambda: now[0])
    assert budget.try_take() and budget.try_take()
    assert not budget.try_take()  # a third within 10 minutes: the engine gives up
    now[0] = 599.9
    assert not budget.try_take()
    now[0] = 600.0  # the first restart left the window
    assert budget.try_take() and budget.num_restarts_total == 3
    assert not RestartBudget(0).try_take()  # max 0: fail-stop


class _FakeExecutor:
    """Starts (or dies while loading, like a SIGKILLed new worker) without spawning anything."""

    def __init__(self, dies: bool) -> None:
        self.dies, self.num_cpu_blocks, self.shut_down, self.cache = dies, 0, False, None

    def start(self) -> int:
        if self.dies:
            raise EngineDeadError("worker rank 0 (pid 1) was killed by SIGKILL")
        return 16

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache = (num_gpu_blocks, num_cpu_blocks)

    def shutdown(self) -> None:
        self.shut_down = True


def _restarter(max_worker_restarts: int, deaths: int) -> tuple[WorkerRestarter, list[_FakeExecutor]]:
    made: list[_FakeExecutor] = []

    def factory(config: EngineConfig) -> _FakeExecutor:
        made.append(_FakeExecutor(dies=len(made) < deaths))
        return made[-1]

    config = EngineConfig.create("dummy-model", block_size=4, max_worker_restarts=max_worker_restarts)
    return WorkerRestarter(config, 16, 0, executor_factory=factory), made  # type: ignore[arg-type]


def test_new_workers_that_die_while_loading_spend_the_budget_and_are_started_again() -> None:
    restarter, made = _restarter(max_worker_restarts=3, deaths=2)  # 1 failure + 2 failed starts = 3, allowed
    failed = _FakeExecutor(dies=False)
    executor = restarter.recover(failed, _scheduler(), EngineDeadError("worker rank 0 killed"))
    assert failed.shut_down and executor is made[2] and executor.cache == (16, 0)
    assert [e.shut_down for e in made] == [True, True, False] and restarter.budget.num_restarts_total == 3

    restarter, made = _restarter(max_worker_restarts=3, deaths=3)  # the 4th failure ends the engine
    with pytest.raises(EngineDeadError, match="failed more than max_worker_restarts=3") as info:
        restarter.recover(_FakeExecutor(dies=False), _scheduler(), EngineDeadError("worker rank 0 killed"))
    assert len(made) == 3 and all(e.shut_down for e in made) and "pid 1" in str(info.value)


def test_restarted_workers_short_of_kv_blocks_end_the_engine_without_another_reload() -> None:
    restarter, made = _restarter(max_worker_restarts=3, deaths=0)
    restarter.num_gpu_blocks = 32  # the new workers hold 16: no retry can give more
    with pytest.raises(EngineDeadError, match="hold 16 KV blocks"):
        restarter.recover(_FakeExecutor(dies=False), _scheduler(), EngineDeadError("worker rank 0 killed"))
    assert len(made) == 1 and made[0].shut_down and restarter.budget.num_restarts_total == 1
