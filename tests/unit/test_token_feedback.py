"""Deferred sampled tokens: a step launched before the previous one's ids reach the host.

The pipelined driver plays an async-scheduling core: it sends decode step
N+1 (counts advanced past step N's token) before finishing step N, as the
worker's `StepPipeline` does. The fake model reads its whole context back
from the KV cache, so a wrong or late id anywhere changes the tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model_runner import CPU, FAKE_SPEC, PROMPTS, FakeCore, FakeModel, make_config, tiny_checkpoints  # noqa: F401

from asyncllm.protocol import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.model_runner import ModelRunner
from asyncllm.workers.step_pipeline import StepPipeline
from asyncllm.workers.token_feedback import PENDING_TOKEN, InFlightStep


def _runner(tmp_path: Path) -> ModelRunner:
    runner = ModelRunner(make_config(tmp_path), rank=0, tp_size=1, device=CPU)
    runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
    runner.init_cache(80)
    return runner


def _decode_step(core: FakeCore, order: list[str], computed: dict[str, int]) -> SchedulerOutput:
    """One decode token for each request of ``order``, at the counts the core has advanced to."""
    cached = CachedRequestData()
    for req_id in order:
        new_blocks = core._allocate(req_id, computed[req_id] + 1)
        cached.req_ids.append(req_id)
        cached.num_computed_tokens.append(computed[req_id])
        if new_blocks:
            cached.new_block_ids[req_id] = new_blocks
        computed[req_id] += 1
    core.step_id += 1
    return SchedulerOutput(core.step_id, [], cached, dict.fromkeys(order, 1), len(order))


def _collect(core: FakeCore, out: ModelRunnerOutput) -> None:
    for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
        assert len(sampled) == 1 and sampled[0] != PENDING_TOKEN
        core.tokens[req_id] += sampled


def _prefill(runner: ModelRunner, params: SamplingParams | None = None) -> tuple[FakeCore, dict[str, int]]:
    core = FakeCore(runner, 80)
    for req_id, prompt in PROMPTS.items():
        core.add(req_id, prompt) if params is None else core.add(req_id, prompt, params)
    core.step({req_id: len(p) for req_id, p in PROMPTS.items()})  # each samples its first token
    return core, {req_id: len(p) for req_id, p in PROMPTS.items()}


SCHEDULES = {
    "steady": [list(PROMPTS)] * 8,  # the same requests in the same order: one device copy
    "reordered": [list(PROMPTS), list(reversed(PROMPTS))] * 4,  # ids scattered by index
    "subset": [["a", "b", "c"], ["c", "a"], ["b"], ["a", "b", "c"], ["b", "c", "a"], ["a", "b", "c"]],
}


def _pipelined(runner: ModelRunner, core: FakeCore, computed: dict[str, int], schedule: list[list[str]]) -> None:
    """Launch each decode step before finishing the one before it (as `StepPipeline` does)."""
    inflight = None
    for order in schedule:
        result = runner.launch_step(_decode_step(core, order, computed))
        assert isinstance(result, InFlightStep)
        rows = [runner.input_batch.requests[r].token_ids for r in order]
        assert all(tokens[-1] == PENDING_TOKEN for tokens in rows)  # deferred: not on the host yet
        if inflight is not None:
            _collect(core, runner.finish_step(inflight))
        inflight = result
    assert inflight is not None
    _collect(core, runner.finish_step(inflight))
    for req_id in PROMPTS:
        assert runner.input_batch.requests[req_id].token_ids == core.tokens[req_id]  # every hole filled


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_pipelined_decode_gives_the_reference_tokens(tmp_path: Path, schedule: list[list[str]]) -> None:
    runner = _runner(tmp_path)
    core, computed = _prefill(runner)
    _pipelined(runner, core, computed, schedule)
    for req_id, prompt in PROMPTS.items():
        steps = 1 + sum(req_id in order for order in schedule)
        assert core.outputs(req_id) == runner.model.greedy(prompt, steps)


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(("device", "enforce_eager"), [
    ("cpu", True),
    pytest.param("cuda", False, marks=_CUDA, id="cuda-graphs"),
    pytest.param("cuda", True, marks=_CUDA, id="cuda-eager"),
])
@pytest.mark.parametrize("schedule", ["steady", "reordered"])
def test_pipelined_decode_of_a_real_model_gives_transformers_tokens(
    request: pytest.FixtureRequest, device: str, enforce_eager: bool, schedule: str
) -> None:
    """On CUDA the real path: ids copied to pinned memory under an event, filled by a device op, graphs replayed."""
    path, reference = request.getfixturevalue("tiny_checkpoints")["llama"]
    config = make_config(path, dtype="float32", device=device, enforce_eager=enforce_eager)
    runner = ModelRunner(config, rank=0, tp_size=1, device=torch.device(device))
    runner.load_model()
    runner.init_cache(80)
    assert (runner.cuda_graphs is None) == (enforce_eager or device == "cpu")
    core, computed = _prefill(runner)
    _pipelined(runner, core, computed, SCHEDULES[schedule])
    for req_id, prompt in PROMPTS.items():
        assert core.outputs(req_id) == reference(prompt, 1 + sum(req_id in o for o in SCHEDULES[schedule]))


def test_a_step_that_reads_output_tokens_resolves_the_pending_one_first(tmp_path: Path) -> None:
    """Penalties read each row's outputs on the host: the pending ids are fetched before the build."""
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2)
    expected_runner = _runner(tmp_path / "sync")
    expected, _ = _prefill(expected_runner, penalised)
    expected.decode(list(PROMPTS), 5)
    runner = _runner(tmp_path / "pipelined")
    core, computed = _prefill(runner, penalised)
    inflight = None
    for _ in range(5):
        result = runner.launch_step(_decode_step(core, list(PROMPTS), computed))
        assert isinstance(result, InFlightStep)
        if inflight is not None:
            assert inflight.pending.tokens is not None  # resolved inside launch_step, before the build
            _collect(core, runner.finish_step(inflight))
        inflight = result
    _collect(core, runner.finish_step(inflight))
    assert core.tokens == expected.tokens


def test_steps_with_logprobs_are_not_deferred(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    core, computed = _prefill(runner, SamplingParams(temperature=0.0, logprobs=2))
    out = runner.launch_step(_decode_step(core, list(PROMPTS), computed))
    assert isinstance(out, ModelRunnerOutput) and set(out.logprobs) == set(PROMPTS)


class _Pending:
    def __init__(self) -> None:
        self.ready = False
        self.tokens = None

    def done(self) -> bool:
        return self.ready


class _FakeRunner:
    """Launches return in-flight steps whose readiness the test controls."""

    def __init__(self) -> None:
        self.launched: list[InFlightStep] = []
        self.events: list[str] = []

    def launch_step(self, sched_out: SchedulerOutput) -> InFlightStep:
        self.events.append(f"launch {sched_out.step_id}")
        step = InFlightStep(sched_out, None, _Pending())  # type: ignore[arg-type]
        self.launched.append(step)
        return step

    def finish_step(self, step: InFlightStep) -> ModelRunnerOutput:
        self.events.append(f"finish {step.sched_out.step_id}")
        return ModelRunnerOutput(step.sched_out.step_id, [], [])


def _sched(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], CachedRequestData(), {}, 0)


def test_pipeline_launches_the_next_step_before_sending_the_last() -> None:
    runner, sent = _FakeRunner(), []
    pipeline = StepPipeline(runner, lambda out: sent.append(out.step_id))
    pipeline.step(_sched(0))
    pipeline.wait(lambda: True)  # the next command is there: nothing is finished yet
    assert sent == [] and pipeline.inflight is runner.launched[0]
    pipeline.step(_sched(1))
    assert runner.events == ["launch 0", "launch 1", "finish 0"] and sent == [0]
    runner.launched[1].pending.ready = True
    pipeline.wait(lambda: False)  # no command, the GPU is done: finish now (a synchronous core waits for it)
    assert sent == [0, 1] and pipeline.inflight is None
    pipeline.flush()
    assert sent == [0, 1]
    pipeline.step(_sched(2))  # nothing in flight before it
    assert (pipeline.num_steps, pipeline.num_overlapped) == (3, 1)


def test_pipeline_waits_for_whichever_comes_first() -> None:
    runner, sent = _FakeRunner(), []
    pipeline = StepPipeline(runner, lambda out: sent.append(out.step_id))
    pipeline.step(_sched(0))
    polls = iter([False, False, True])
    pipeline.wait(lambda: next(polls))  # neither for two polls, then a command
    assert sent == [] and pipeline.inflight is not None
    pipeline.flush()  # e.g. before InitCache or ShutdownWorker
    assert sent == [0] and pipeline.inflight is None


def test_pipeline_runs_runners_without_launch_step_to_the_end() -> None:
    class Plain:
        def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
            return ModelRunnerOutput(sched_out.step_id, [], [])

    sent: list[int] = []
    pipeline = StepPipeline(Plain(), lambda out: sent.append(out.step_id))
    pipeline.step(_sched(3))
    assert sent == [3] and pipeline.inflight is None


def test_pipeline_off_runs_each_step_to_the_end() -> None:
    """ASYNCLLM_WORKER_PIPELINE=0 (the worker passes ``pipelined=False``): execute_model, never launch_step."""
    class Both(_FakeRunner):
        def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
            self.events.append(f"execute {sched_out.step_id}")
            return ModelRunnerOutput(sched_out.step_id, [], [])

    runner, sent = Both(), []
    pipeline = StepPipeline(runner, lambda out: sent.append(out.step_id), pipelined=False)
    pipeline.step(_sched(0))
    pipeline.step(_sched(1))
    assert runner.events == ["execute 0", "execute 1"] and sent == [0, 1]


@pytest.mark.parametrize(("raw", "on_cpu", "on_cuda"), [
    (None, False, True), ("auto", False, True), ("1", True, True), ("on", True, True), ("0", False, False),
])
def test_worker_pipeline_env(monkeypatch: pytest.MonkeyPatch, raw: str | None, on_cpu: bool, on_cuda: bool) -> None:
    from asyncllm.workers.worker import _pipelined

    if raw is None:
        monkeypatch.delenv("ASYNCLLM_WORKER_PIPELINE", raising=False)
    else:
        monkeypatch.setenv("ASYNCLLM_WORKER_PIPELINE", raw)
    runner = _FakeRunner()
    runner.device = torch.device("cpu")  # type: ignore[attr-defined]
    assert _pipelined(runner) is on_cpu
    runner.device = torch.device("cuda")  # type: ignore[attr-defined]
    assert _pipelined(runner) is on_cuda


def test_worker_pipeline_env_rejects_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm import envs

    from asyncllm.errors import ConfigError

    monkeypatch.setenv("ASYNCLLM_WORKER_PIPELINE", "sometimes")
    with pytest.raises(ConfigError, match="ASYNCLLM_WORKER_PIPELINE='sometimes' is not allowed: expected 1, 0 or auto"):
        envs.WORKER_PIPELINE.get()
