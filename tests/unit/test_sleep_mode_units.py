"""Sleep mode in process (docs/sleep-mode.md): one rank's moves on a CPU `ModelRunner` (weights kept or
discarded, the KV cache freed and reallocated with as many blocks, CUDA graphs dropped and captured again once
both are back), what is not built refused by name, and the core's state (refused without enable_sleep_mode,
steps held, restarted workers put back to sleep)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.core_sleep import SleepController
from asyncllm.engine.sleep import check_level, check_tags, sleep_error
from asyncllm.errors import ConfigError, EngineDeadError, InvalidRequestError, NotBuiltError
from asyncllm.sched.scheduler import Scheduler
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers import cuda_graphs
from asyncllm.workers.model_runner import ModelRunner
from asyncllm.workers.sleep import RunnerSleep

CPU = torch.device("cpu")
NUM_BLOCKS = 8


@pytest.fixture()
def runner(monkeypatch) -> ModelRunner:
    """A CPU runner of the tiny Llama with its KV cache, whose graph captures are recorded (a CPU runner has none:
    the fake stands for the CUDA one, so that the recapture on wake-up is seen)."""
    config = EngineConfig.create(tiny_checkpoint("llama"), max_model_len=64, max_num_seqs=4, device="cpu")
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    runner.init_cache(NUM_BLOCKS)
    runner.captures = []
    monkeypatch.setattr(cuda_graphs, "capture_decode_graphs",
                        lambda r: r.captures.append([c.data_ptr() for c in r.kv_caches]) or f"graphs {len(r.captures)}")
    runner.cuda_graphs = "graphs 0"
    return runner


def _params(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in runner.model.named_parameters()}


def test_level_1_keeps_the_weights_and_both_parts_come_back_in_two_calls(runner) -> None:
    before, num_layers = _params(runner), len(runner.kv_caches)
    sleeper = RunnerSleep(runner)
    sleeper.sleep(1, ["weights", "kv_cache"])
    assert runner.kv_caches == [] and runner.cuda_graphs is None
    sleeper.wake_up(["weights"])
    assert runner.captures == []  # the KV cache still sleeps: nothing to capture over
    after = _params(runner)
    assert all(torch.equal(before[name], after[name]) for name in before)
    sleeper.wake_up(["kv_cache"])
    assert [tuple(c.shape[:2]) for c in runner.kv_caches] == [(2, NUM_BLOCKS)] * num_layers  # as many blocks
    assert all(not c.any() for c in runner.kv_caches)
    assert runner.captures == [[c.data_ptr() for c in runner.kv_caches]] and runner.cuda_graphs == "graphs 1"
    sleeper.wake_up(["weights", "kv_cache"])  # awake already: no second capture
    assert len(runner.captures) == 1


def test_level_2_discards_the_weights_and_brings_back_their_shapes(runner) -> None:
    shapes = {name: (p.shape, p.dtype) for name, p in runner.model.named_parameters()}
    loaders = {name: getattr(p, "weight_loader", None) for name, p in runner.model.named_parameters()}
    sleeper = RunnerSleep(runner)
    sleeper.sleep(2, ["weights", "kv_cache"])
    assert all(p.numel() == 0 for p in runner.model.parameters())
    sleeper.wake_up(["weights", "kv_cache"])
    assert {name: (p.shape, p.dtype) for name, p in runner.model.named_parameters()} == shapes
    assert {name: getattr(p, "weight_loader", None) for name, p in runner.model.named_parameters()} == loaders
    assert len(runner.captures) == 1


def test_what_is_not_built_is_refused_by_name_and_changes_nothing() -> None:
    path = tiny_checkpoint("llama")
    runner = SimpleNamespace(config=EngineConfig.create(path, max_model_len=64), model=torch.nn.Linear(2, 2),
                             hf_config=SimpleNamespace(quantization_config={"quant_method": "awq"}), kv_caches=["kept"])
    reply = RunnerSleep(runner).handle(protocol.Sleep("s1", 2), rank=0)  # level 1 is built (test_sleep_quantized.py)
    error = sleep_error(reply)
    assert isinstance(error, NotBuiltError) and "pre-quantized checkpoint (awq)" in str(error)
    assert "sleep(level=2)" in str(error)
    assert runner.kv_caches == ["kept"]


@pytest.mark.parametrize("level", [1, 2])
def test_a_draft_model_sleeps_in_cpu_memory_with_its_kv_cache_freed(level: int, monkeypatch) -> None:
    """The draft's own weights go to CPU memory at either level (update_weights loads the served model's only) and
    come back equal; its KV cache (the target's block ids and its scratch blocks) is freed and allocated again."""
    monkeypatch.setattr(cuda_graphs, "capture_decode_graphs", lambda r: None)
    path = tiny_checkpoint("llama")
    config = EngineConfig.create(path, max_model_len=64, max_num_seqs=4, device="cpu",
                                 speculative_config={"model": path, "num_speculative_tokens": 2})
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    runner.init_cache(NUM_BLOCKS)
    drafter = runner.drafter
    before = {name: p.detach().clone() for name, p in drafter.model.named_parameters()}
    shape = drafter.kv_caches[0].shape
    sleeper = RunnerSleep(runner)
    assert sleep_error(sleeper.handle(protocol.Sleep("s", level), rank=0)) is None
    assert drafter.kv_caches == [] and sleeper.draft is not None
    moved = dict(drafter.model.named_parameters())
    assert all(moved[name].data_ptr() != value.data_ptr() for name, value in before.items())  # copied out
    sleeper.wake_up(["weights", "kv_cache"])
    after = dict(drafter.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert drafter.kv_caches[0].shape == shape and sleeper.draft is None


def test_levels_and_tags_are_checked_by_name() -> None:
    assert check_level(2) == 2 and check_tags(None) == [] and check_tags(("weights", "weights")) == ["weights"]
    for level in (0, 3, True, "1"):
        with pytest.raises(InvalidRequestError, match="level"):
            check_level(level)
    for tags in ("weights", [], ["optimizer"]):
        with pytest.raises(InvalidRequestError, match="tags"):
            check_tags(tags)


class _Executor:
    """The core's executor as `SleepController` sees it: records the commands, answers each rank."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.commands: list[protocol.Sleep | protocol.WakeUp] = []
        self.fail = fail

    def sleep_mode(self, command: protocol.Sleep | protocol.WakeUp) -> list[protocol.SleepModeDone]:
        self.commands.append(command)
        if self.fail is not None:
            raise self.fail
        return [protocol.SleepModeDone(command.call_id)]


def _core(enable: bool) -> SimpleNamespace:
    config = EngineConfig.create(tiny_checkpoint("llama"), load_format="dummy", max_model_len=256,
                                 enable_sleep_mode=enable)
    sent: list[object] = []
    return SimpleNamespace(config=config, overlap=None, scheduler=Scheduler(config, 16, 256), executor=_Executor(),
                           sent=sent, send_outputs=lambda outputs: sent.append("stats"),
                           io=SimpleNamespace(send=lambda client_id, message: sent.append(message)),
                           weights=SimpleNamespace(pushed=False))  # the WeightUpdater: no weights pushed


def test_the_core_refuses_without_enable_sleep_mode_by_name() -> None:
    core = _core(enable=False)
    controller = SleepController(core)
    controller.handle(b"host", protocol.Sleep("s1", 1))
    [stats, reply] = core.sent
    error = sleep_error(reply)
    assert stats == "stats" and isinstance(error, ConfigError) and error.field == "enable_sleep_mode"
    assert str(error).startswith("enable_sleep_mode=False is not allowed: sleep() and wake_up() need True: start")
    assert core.executor.commands == [] and not controller.holds_steps
    core.config = core.config.replace(enable_sleep_mode=True)
    controller.handle(b"peer", protocol.Sleep("s2", 3))  # checked in the core too: not every peer is an AsyncEngine
    assert sleep_error(core.sent[-1]).field == "level" and core.executor.commands == []


def _refused_naming_their_source(core: SimpleNamespace, controller: SleepController) -> None:
    """An update during a level-2 sleep is refused naming what it came from, and reaches no worker."""
    from asyncllm.engine.core_weights import WeightUpdater
    from asyncllm.engine.weight_update import weights_error

    core.sleep, updater = controller, WeightUpdater(core)
    pushed = protocol.UpdateWeights("u2", "", segment="asyncllm-weights-x", tensors=[])
    for message, field in ((protocol.UpdateWeights("u1", "/ckpt/b"), "model_path"), (pushed, "named_tensors")):
        updater.update(b"host", message)
        error = weights_error(core.sent[-1])
        assert isinstance(error, InvalidRequestError) and error.field == field and "sleep(level=2)" in str(error)
    assert updater.weights_version == 0  # the executor (no update_weights) was never asked


def test_the_core_holds_steps_and_puts_restarted_workers_back_to_sleep() -> None:
    core = _core(enable=True)
    controller = SleepController(core)
    controller.handle(b"host", protocol.Sleep("s1", 2))
    assert core.sent[-1] == protocol.SleepModeDone("s1", sleep_level=2) and controller.holds_steps
    _refused_naming_their_source(core, controller)  # nothing to copy into
    controller.handle(b"host", protocol.WakeUp("w1", ["weights"]))
    assert controller.is_sleeping and controller.refuse_update("model_path") is None
    core.executor = _Executor()  # restarted: awake, with the last weights
    controller.after_restart()
    assert core.executor.commands == [protocol.Sleep("restart", 1, ["kv_cache"])]
    assert not controller.awaiting_weights  # the restart loaded real weights
    controller.handle(b"host", protocol.WakeUp("w2"))
    assert not controller.holds_steps and core.sent[-1] == protocol.SleepModeDone("w2")
    recovered: list[BaseException] = []
    core.recover_workers = recovered.append
    core.executor = _Executor(EngineDeadError("rank 0 ran out of memory"))
    controller.handle(b"host", protocol.Sleep("s2", 1))
    assert isinstance(sleep_error(core.sent[-1]), EngineDeadError) and len(recovered) == 1
    assert not controller.is_sleeping  # the state before the call
    core.weights.pushed = True  # the last update came from a host's tensors: restarted workers have dummy weights
    core.executor = _Executor()
    controller.after_restart()
    assert controller.awaiting_weights and controller.holds_steps and core.executor.commands == []


@pytest.mark.parametrize("level", [1, 2])
def test_the_lora_slots_go_with_the_weights_and_come_back_empty(level: int) -> None:
    config = EngineConfig.create(tiny_checkpoint("llama"), max_model_len=64, max_num_seqs=4, device="cpu",
                                 enable_lora=True, max_loras=2)
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    lora = runner.lora_runner
    shapes = {name: (layer.a.shape, layer.b.shape) for name, layer in lora.layers.items()}
    lora.slots[7] = 0  # adapter 7 set in slot 0
    next(iter(lora.layers.values())).a.fill_(1.0)
    sleeper = RunnerSleep(runner)
    sleeper.sleep(level, ["weights"])
    sleeper.sleep(2, ["weights"])  # a second sleep finds them released
    assert all(layer.a.numel() == layer.b.numel() == 0 for layer in lora.layers.values()) and not lora.slots
    sleeper.wake_up(["weights"])
    assert {name: (layer.a.shape, layer.b.shape) for name, layer in lora.layers.items()} == shapes
    assert not any(layer.a.any() or layer.b.any() for layer in lora.layers.values())
