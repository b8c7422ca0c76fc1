"""Sleep mode's level 1 over pre-quantized checkpoints (docs/sleep-mode.md), in process on CPU `ModelRunner`s: every
tensor the model holds (parameters, buffers: repacked int4 weights, scales, zero points, ``g_idx``; tensor
attributes) leaves its memory at sleep and comes back bit-identical at wake-up, aliases and views kept, and the
greedy tokens after the wake-up equal those before. Level 2 stays refused by name (update_weights cannot reload
these)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from compressed_tensors_reference import MIXED, write_ct_checkpoint
from fp8_checkpoint_reference import write_fp8_checkpoint
from gguf import GGMLQuantizationType
from gguf_reference import write_gguf
from int4_reference import write_int4_checkpoint
from step_driver import StepDriver

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.sleep import sleep_error
from asyncllm.errors import NotBuiltError
from asyncllm.models import compressed_tensors, int4_checkpoint
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers import cuda_graphs
from asyncllm.workers.model_runner import ModelRunner
from asyncllm.workers.sleep import RunnerSleep
from asyncllm.workers.sleep_tensors import Offloaded, held_tensors

CPU = torch.device("cpu")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs a CUDA device")])]


def _fp8_block(src: str, dst: Path) -> str:
    write_fp8_checkpoint(src, dst, (32, 48))
    return str(dst)


def _gptq(src: str, dst: Path) -> str:
    write_int4_checkpoint(src, dst, "gptq", 16, desc_act=True)  # act-order: a g_idx buffer
    return str(dst)


CASES = {  # case -> (writer, a quant_method class the model must use)
    "fp8-block": (_fp8_block, "Fp8BlockLinearMethod"),
    "fp8-per-tensor": (lambda src, dst: write_fp8_checkpoint(src, dst, None) and str(dst), "Fp8LinearMethod"),
    "gptq-act-order": (_gptq, "Int4LinearMethod"),
    "ct-mixed": (lambda src, dst: str(write_ct_checkpoint(src, dst, MIXED)), "Int8LinearMethod"),
    "gguf-q8_0": (lambda src, dst: write_gguf(src, str(dst.with_suffix(".gguf")), "llama",
                                              GGMLQuantizationType.Q8_0), None),
}


@pytest.fixture()
def runner_for(tmp_path, monkeypatch):
    """(case, device) -> a runner of its checkpoint with a KV cache; int4 layers kept packed on the CPU too (the GPU's
    buffers, computed by the torch reference) rather than dequantized."""
    for module, finish in ((int4_checkpoint, "finish_int4_params"),
                           (compressed_tensors, "finish_compressed_tensors_params")):
        monkeypatch.setattr(module, finish, functools.partial(getattr(module, finish), keep_packed=True))
    monkeypatch.setattr(cuda_graphs, "capture_decode_graphs", lambda r: None)

    def make(case: str, device: str = "cpu") -> ModelRunner:
        write, method = CASES[case]
        path = write(tiny_checkpoint("llama"), tmp_path / case)
        config = EngineConfig.create(path, max_model_len=64, max_num_seqs=4, device=device)
        runner = ModelRunner(config, rank=0, tp_size=1, device=torch.device(device))
        runner.load_model()
        runner.init_cache(16)
        methods = {type(getattr(m, "quant_method", None)).__name__ for m in runner.model.modules()}
        assert method is None or method in methods, methods
        return runner
    return make


def _greedy(driver: StepDriver, tag: str) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for i, prompt in enumerate(([5, 9, 31, 7, 100, 3], [42, 17, 8])):
        driver.add(f"{tag}{i}", prompt, 3, params)
    return [req.outputs for name, req in driver.run().items() if name.startswith(tag)]


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8).clone() if tensor.numel() else tensor.new_empty(0)


def _sharing(tensors: dict[str, torch.Tensor]) -> list[set[str]]:
    """The names grouped by storage (aliases)."""
    groups: dict[int, set[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(tensor.untyped_storage().data_ptr(), set()).add(name)
    return sorted(groups.values(), key=sorted)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_level_1_moves_every_tensor_and_keeps_the_greedy_tokens(runner_for, case: str, device: str) -> None:
    runner = runner_for(case, device)
    driver = StepDriver(runner, 16)
    before_tokens = _greedy(driver, "a")
    named = _named(runner.model)
    values, sharing = {name: _bytes(t) for name, t in named.items()}, _sharing(named)
    old = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in named.values() if t.numel()}
    sleeper = RunnerSleep(runner)
    assert sleep_error(sleeper.handle(protocol.Sleep("s", 1), rank=0)) is None
    # nothing but this test holds the device memory any more (a tensor left behind, or a view of one, would)
    assert [s for s in old.values() if torch._C._storage_Use_Count(s._cdata) != 1] == []
    assert all(copy.is_pinned() == (device == "cuda") for copy, _ in sleeper.offloaded.groups if copy.nbytes())
    sleeper.wake_up(["weights", "kv_cache"])
    after = _named(runner.model)
    assert all(t.device.type == device and t.untyped_storage().data_ptr() not in old
               for t in after.values() if t.numel())
    assert [name for name, t in after.items() if not torch.equal(_bytes(t), values[name])] == []
    assert _sharing(after) == sharing
    assert _greedy(driver, "b") == before_tokens


def test_level_2_of_a_pre_quantized_checkpoint_is_refused_by_name(runner_for) -> None:
    runner = runner_for("fp8-block")
    error = sleep_error(RunnerSleep(runner).handle(protocol.Sleep("s", 2), rank=0))
    assert isinstance(error, NotBuiltError) and error.field == "model" and "(fp8)" in str(error)
    assert len(runner.kv_caches) > 0  # nothing changed
    sleeper = RunnerSleep(runner)
    assert sleep_error(sleeper.handle(protocol.Sleep("s", 2, tags=["kv_cache"]), rank=0)) is None  # no weights
    assert sleeper.kv_asleep and sleeper.weights == "awake"


class _Method:
    """A quant_method keeping tensors of its own."""

    def __init__(self, table: torch.Tensor) -> None:
        self.tables = (table, table[1:])


def test_aliases_views_and_plain_attributes_are_moved_and_stay_shared() -> None:
    layer = torch.nn.Linear(4, 3)
    layer.register_buffer("scale", torch.rand(3, 1))
    layer.register_buffer("scale_row", layer.scale.reshape(1, 3))  # aliases scale (fp8's weight_scale_row)
    layer.rows = layer.weight[1:]  # a plain attribute viewing a parameter
    with torch.inference_mode():  # DeepSeek's expansions, made in a step
        layer.absorbed = (torch.rand(2, 2), torch.rand(2))
    layer.quant_method = _Method(torch.arange(4.0))
    model = torch.nn.Sequential(layer)
    tensors = held_tensors(model, CPU)
    assert len(tensors) == 9
    before = [(t.clone(), t.untyped_storage().data_ptr()) for t in tensors]
    offloaded = Offloaded(tensors)
    assert all(t.untyped_storage().data_ptr() != ptr for t, (_, ptr) in zip(tensors, before))
    offloaded.restore(CPU)
    assert all(torch.equal(t, value) for t, (value, _) in zip(tensors, before))
    assert [t.is_inference() for t in layer.absorbed] == [True, True] and not layer.weight.is_inference()
    with torch.inference_mode():
        layer.absorbed[1].copy_(torch.ones(2))  # refreshed in place in a step, as DeepSeek's are
    assert repr(layer.absorbed[1]) == "tensor([1., 1.])"
    assert layer.rows._base is layer.weight and layer.rows.data_ptr() == layer.weight[1].data_ptr()
    assert layer.scale_row.data_ptr() == layer.scale.data_ptr()
    table, part = layer.quant_method.tables
    assert part.data_ptr() == table[1:].data_ptr()
    with torch.no_grad():
        layer.weight[1, 0] = 7.0
    assert layer.rows[0, 0] == 7.0 and not offloaded.groups
    other = Offloaded([layer.scale])
    layer.scale.data = torch.zeros(3, 1)  # pointed elsewhere meanwhile (a level 2): left as it is, its copy dropped
    assert other.held() == [] and not layer.scale.any()


def test_a_level_2_after_a_level_1_keeps_the_buffers_and_drops_the_parameters_copies(monkeypatch) -> None:
    monkeypatch.setattr(cuda_graphs, "capture_decode_graphs", lambda r: None)
    config = EngineConfig.create(tiny_checkpoint("llama"), max_model_len=64, max_num_seqs=4, device="cpu")
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    runner.init_cache(8)
    buffers = {name: b.clone() for name, b in runner.model.named_buffers()}
    sleeper = RunnerSleep(runner)
    sleeper.sleep(1, ["weights", "kv_cache"])
    sleeper.sleep(2, ["weights"])
    held = {id(t) for _, members in sleeper.offloaded.groups for t in members}
    assert held == {id(b) for b in runner.model.buffers()}  # the parameters' CPU copies are gone
    sleeper.wake_up(["weights", "kv_cache"])
    assert all(torch.equal(b, buffers[name]) for name, b in runner.model.named_buffers())
    assert all(p.numel() > 0 for p in runner.model.parameters()) and sleeper.offloaded is None
    assert sleeper.weights == "awake"
