"""The executor and its worker processes, driven through a fake runner (and once the real one).

Workers load this file by path (``--runner file.py:Class``), so the fake
runners below run inside real worker processes: real spawn, real
torch.distributed (gloo) group, real ring and result socket, no model.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, EngineDeadError
from asyncllm.protocol import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.executor import Executor


class FakeRunner:
    """Samples ``1000 * step_id + num_scheduled_tokens + 100 * tp_sum`` for every request.

    ``tp_sum`` is an all_reduce of (rank + 1) over the group, so the output
    proves the TP group works; the request id "slow" makes a step hang.
    """

    def __init__(self, config: EngineConfig, rank: int, tp_size: int, device: torch.device) -> None:
        self.rank, self.tp_size, self.device = rank, tp_size, device
        self.num_gpu_blocks = 0

    def load_model(self) -> None:
        pass

    def determine_num_available_blocks(self) -> int:
        return 100 + 10 * self.rank

    def init_cache(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.num_gpu_blocks > 0, "init_cache() first"
        if "slow" in sched_out.num_scheduled_tokens:
            time.sleep(60)
        if sched_out.step_id < 0:
            raise RuntimeError(f"boom at step {sched_out.step_id}")
        tp_sum = torch.tensor([self.rank + 1])
        dist.all_reduce(tp_sum)
        req_ids = sorted(sched_out.num_scheduled_tokens)
        base = 1000 * sched_out.step_id + 100 * int(tp_sum.item())
        return ModelRunnerOutput(sched_out.step_id, req_ids, [[base + sched_out.num_scheduled_tokens[r]] for r in req_ids])


class FailingLoadRunner(FakeRunner):
    """Rank tp_size - 1 cannot load its weights."""

    def load_model(self) -> None:
        if self.rank == self.tp_size - 1:
            raise RuntimeError(f"cannot read shard {self.rank}: truncated file")


class ConfigErrorRunner(FakeRunner):
    def load_model(self) -> None:
        raise ConfigError("dtype", "float16", "float32 or bfloat16 on this device")


def fake(cls: type) -> str:
    return f"{__file__}:{cls.__name__}"


def make_config(tp: int, model: str = "/nonexistent/fake-model", **kwargs: object) -> EngineConfig:
    return EngineConfig.create(model, max_model_len=64, device="cpu", tensor_parallel_size=tp, **kwargs)


def step(step_id: int, tokens: dict[str, int]) -> SchedulerOutput:
    new = [NewRequestData(r, [1] * n, n, SamplingParams(), [0], 0) for r, n in tokens.items()]
    return SchedulerOutput(step_id, new, CachedRequestData(), tokens, sum(tokens.values()))


def alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_all_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def own_shm_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"asyncllm-{os.getpid()}-")] if os.path.isdir("/dev/shm") else []


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Private socket folders go here, so a test can see that shutdown removed them.

    (A short path: ipc:// socket paths must fit in 107 bytes.)
    """
    path = Path(tempfile.mkdtemp(prefix="al-"))
    monkeypatch.setenv("ASYNCLLM_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trips_and_clean_shutdown(tp: int, runtime_dir: Path) -> None:
    executor = Executor(make_config(tp), runner=fake(FakeRunner))
    assert executor.start() == 100  # the min over ranks (100 + 10 * rank)
    pids = executor.worker_pids
    assert len(pids) == tp and all(alive(p) for p in pids)
    # Every worker connected and mapped the ring: the socket folder and the
    # segment's name are already gone, so a crash cannot leak them.
    assert list(runtime_dir.iterdir()) == [] and own_shm_segments() == []
    executor.init_cache(42)
    tp_sum = tp * (tp + 1) // 2
    for step_id in range(5):
        out = executor.execute_model(step(step_id, {"b": 1, "a": 3 + step_id}))
        base = 1000 * step_id + 100 * tp_sum
        assert out == ModelRunnerOutput(step_id, ["a", "b"], [[base + 3 + step_id], [base + 1]])
    executor.shutdown()
    executor.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down"):
        executor.execute_model(step(5, {"a": 1}))
    assert not any(alive(p) for p in pids)
    assert list(runtime_dir.iterdir()) == [] and own_shm_segments() == []


def test_large_step_goes_through_the_overflow_path(runtime_dir: Path) -> None:
    with Executor(make_config(1), runner=fake(FakeRunner), ring_slot_bytes=256) as executor:
        executor.start()
        executor.init_cache(1)
        tokens = {f"req-{i}": 1 + i for i in range(200)}  # far more than 256 bytes encoded
        out = executor.execute_model(step(7, tokens))
        assert out.req_ids == sorted(tokens)
        assert out.sampled_token_ids == [[7100 + tokens[r]] for r in sorted(tokens)]


def test_worker_killed_mid_step_raises_engine_dead(runtime_dir: Path) -> None:
    with Executor(make_config(2), runner=fake(FakeRunner)) as executor:
        executor.start()
        executor.init_cache(8)
        executor.execute_model(step(0, {"a": 1}))
        victim = executor.worker_pids[1]
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)

        threading.Timer(0.5, kill).start()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
            executor.execute_model(step(1, {"slow": 1}))
        assert time.monotonic() - killed_at[0] < 2.0
        with pytest.raises(EngineDeadError, match="already failed"):
            executor.execute_model(step(2, {"a": 1}))
        pids = executor.worker_pids
    assert not any(alive(p) for p in pids)


def test_exception_in_a_step_is_reported_with_its_message(runtime_dir: Path) -> None:
    with Executor(make_config(1), runner=fake(FakeRunner)) as executor:
        executor.start()
        executor.init_cache(8)
        with pytest.raises(EngineDeadError, match=r"worker rank 0 failed: RuntimeError: boom at step -3"):
            executor.execute_model(step(-3, {"a": 1}))


def test_load_failure_on_one_rank_fails_start_promptly(runtime_dir: Path) -> None:
    executor = Executor(make_config(2), runner=fake(FailingLoadRunner))
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1 failed: RuntimeError: cannot read shard 1: truncated file"):
        executor.start()
    assert time.monotonic() - start < 30  # spawn + torch import of two workers on 2 busy cores
    assert not any(alive(p) for p in executor.worker_pids)
    assert list(runtime_dir.iterdir()) == [] and own_shm_segments() == []


def test_config_error_in_a_worker_stays_a_config_error(runtime_dir: Path) -> None:
    executor = Executor(make_config(1), runner=fake(ConfigErrorRunner))
    with pytest.raises(ConfigError, match="float32 or bfloat16 on this device") as info:
        executor.start()
    assert info.value.field == "dtype"
    executor.shutdown()


_PARENT_SCRIPT = """
import sys, time
sys.path.insert(0, {test_dir!r})
from test_executor import FakeRunner, fake, make_config
from asyncllm.workers.executor import Executor
executor = Executor(make_config(2), runner=fake(FakeRunner))
executor.start()
print(" ".join(map(str, executor.worker_pids)), flush=True)
time.sleep(600)
"""


def test_workers_die_with_a_killed_parent(runtime_dir: Path) -> None:
    script = _PARENT_SCRIPT.format(test_dir=os.path.dirname(__file__))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    parent.kill()
    parent.wait()
    assert wait_all_gone(pids, timeout=5.0)
    assert list(runtime_dir.iterdir()) == []
    if os.path.isdir("/dev/shm"):
        assert not any(n.startswith(f"asyncllm-{parent.pid}-") for n in os.listdir("/dev/shm"))


def test_real_model_runner_at_tp2_matches_transformers(tiny_llama: str, runtime_dir: Path) -> None:
    """Two ranks through the executor's own step path (one rank: every engine test)."""
    from hf_reference import hf_greedy

    prompt = [7, 300, 41, 9, 250, 12, 88]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    expected = hf_greedy(tiny_llama, prompt, 4)
    for tp in (2,):
        with Executor(make_config(tp, model=tiny_llama, dtype="float32", block_size=4)) as executor:
            assert executor.start() > 0
            executor.init_cache(8)
            new = NewRequestData("r", prompt, len(prompt), greedy, [0, 1], 0)
            out = executor.execute_model(SchedulerOutput(0, [new], CachedRequestData(), {"r": len(prompt)}, len(prompt)))
            tokens = out.sampled_token_ids[0]
            for i in range(1, 4):
                computed = len(prompt) + i - 1
                cached = CachedRequestData(["r"], [computed], {"r": [2]} if computed == 8 else {})
                out = executor.execute_model(SchedulerOutput(i, [], cached, {"r": 1}, 1))
                tokens += out.sampled_token_ids[0]
        assert tokens == expected, f"tp={tp}"


class _QueuedSocket:
    """A result socket holding these worker messages, in order."""

    def __init__(self, messages: list) -> None:
        import msgspec

        self.queue = [msgspec.msgpack.encode(message) for message in messages]

    def poll(self, timeout_ms: int, flags: int) -> bool:
        return bool(self.queue)

    def recv(self) -> bytes:
        return self.queue.pop(0)


def test_a_step_output_takes_its_first_stage_report_even_when_a_later_output_comes_first() -> None:
    """Pipeline stages of an image-text model: the first stage's rank 0 reports every step (its encoder-cache counts
    and the requests it failed) on its own socket, which does not order its messages against the last stage's."""
    from asyncllm.protocol import FirstStageReport

    executor = Executor(EngineConfig.create("m", pipeline_parallel_size=2, max_model_len=64))
    executor._first_stage_reports = True
    executor._pending.extend([(1, 0.0), (2, 0.0)])
    executor._results = _QueuedSocket([ModelRunnerOutput(1, ["a", "b"], [[5], []]), ModelRunnerOutput(2, ["a"], [[6]]),
                                       FirstStageReport(1, 2, 1, {"b": "mm_items[0]: laid wrong"}),
                                       FirstStageReport(2, 1, 0)])
    first = executor.collect()
    assert (first.step_id, first.failed_requests) == (1, {"b": "mm_items[0]: laid wrong"})
    assert (first.mm_encoder_cache_queries, first.mm_encoder_cache_hits) == (2, 1)
    second = executor.collect()
    assert (second.step_id, second.failed_requests, second.mm_encoder_cache_queries) == (2, {}, 1)
    assert not executor._reports and not executor._early and not executor._results.queue
