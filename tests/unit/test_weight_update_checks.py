"""One rank's weight update in process (workers/weight_update.py): the checks touch no parameter, the copy is in
place, what is not built is refused by name, and a refusal crosses the wire typed (docs/weight-updates.md)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.weight_tensors import pack_tensors
from asyncllm.engine.weight_update import OTHER_RANK_REFUSED, weights_error, weights_error_reply
from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.lora import LoRAContext, attach_lora_layers
from asyncllm.models.quantization import fp8_to_float, quantize_fp8_per_tensor
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers.weight_update import check_update, update_weights

CPU = torch.device("cpu")


def _runner(path: str, **fields) -> SimpleNamespace:
    """What `update_weights` reads of a `ModelRunner`, with the model of `path` loaded on the CPU."""
    config = EngineConfig.create(path, max_model_len=256, **fields)
    hf_config = load_hf_config(path)
    model = load_model(config, hf_config, CPU, torch.float32)
    return SimpleNamespace(config=config, hf_config=hf_config, model=model, device=CPU, dtype=torch.float32,
                           rank=0, tp_size=1)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.fixture(scope="module")
def runner() -> SimpleNamespace:
    return _runner(tiny_checkpoint("llama"))


def _altered_copy(tmp_path: Path, change) -> str:
    """A copy of the tiny llama checkpoint B whose tensors `change` edits (a dict of name -> tensor)."""
    source = Path(tiny_checkpoint("llama", seed=1))
    folder = tmp_path / "altered"
    shutil.copytree(source, folder)
    [file] = folder.glob("*.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)
    return str(folder)


def test_checks_refuse_missing_and_misshapen_tensors_and_touch_nothing(runner, tmp_path: Path) -> None:
    before = _params(runner.model)
    name = "model.layers.1.mlp.down_proj.weight"
    missing = _altered_copy(tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(InvalidRequestError, match=f"missing: {name}") as info:
        check_update(runner, missing, None)
    assert info.value.field == "model_path"
    misshapen = _altered_copy(tmp_path / "shape", lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(InvalidRequestError, match=r"model.layers.1.mlp.down_proj.weight.*has shape \(64, 127\)"):
        check_update(runner, misshapen, None)
    truncated = _altered_copy(tmp_path / "cut", lambda t: None)
    [file] = Path(truncated).glob("*.safetensors")
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(InvalidRequestError, match="model_path"):
        check_update(runner, truncated, None)
    after = _params(runner.model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_an_update_copies_in_place_under_lora_layers(tmp_path: Path) -> None:
    runner = _runner(tiny_checkpoint("llama"))
    attach_lora_layers(runner.model, 1, 8, LoRAContext())  # adapter slots are buffers: they stay as they are
    addresses = {name: param.data_ptr() for name, param in runner.model.named_parameters()}
    path = tiny_checkpoint("llama", seed=1)
    reply = update_weights(runner, protocol.UpdateWeights("u1", path))
    assert reply == protocol.WeightsUpdated("u1")
    expected = _params(_runner(path).model)
    for name, param in runner.model.named_parameters():
        assert param.data_ptr() == addresses[name], f"{name} was replaced, not copied into"
        assert torch.equal(param, expected[name]), name


def test_what_is_not_built_is_refused_by_name(runner) -> None:
    with pytest.raises(NotBuiltError, match="GGUF"):
        check_update(runner, "/models/tiny.gguf", None)


def test_a_revision_of_a_local_folder_is_refused_by_name(runner) -> None:
    for path in (tiny_checkpoint("llama"), "./no-such-folder-is-checked-first"):
        with pytest.raises(InvalidRequestError) as info:
            check_update(runner, path, "main")
        assert info.value.field == ("revision" if path.startswith("/") else "model_path")


def test_a_refusal_crosses_the_wire_typed() -> None:
    for error in (InvalidRequestError("model_path", "differs: hidden_size=128 (served: 64)"),
                  NotBuiltError("quantization", "fp8", "update_weights of a quantized model")):
        reply = weights_error_reply("u", error, rank=1)
        back = weights_error(protocol.WeightsUpdated(**{f: getattr(reply, f) for f in reply.__struct_fields__}))
        assert type(back) is type(error) and str(back) == str(error) and back.field == error.field
    assert weights_error(protocol.WeightsUpdated("u", weights_version=3)) is None


class _Executor:
    """The core's executor as `WeightUpdater` sees it: the ranks' replies, or the error of a failed copy."""

    def __init__(self, outcome: list[protocol.WeightsUpdated] | BaseException) -> None:
        self.outcome = outcome

    def update_weights(self, message: protocol.UpdateWeights) -> list[protocol.WeightsUpdated]:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def test_the_core_counts_updates_and_restarts_workers_on_the_last_one() -> None:
    from asyncllm.engine.core_weights import WeightUpdater
    from asyncllm.errors import EngineDeadError
    from asyncllm.sched.scheduler import Scheduler

    config = EngineConfig.create(tiny_checkpoint("llama"), load_format="dummy", max_model_len=256)
    sent: list[object] = []
    recovered: list[BaseException] = []
    core = SimpleNamespace(config=config, overlap=None, scheduler=Scheduler(config, 16, 256), restarter=SimpleNamespace(config=config),
                           recover_workers=recovered.append, send_outputs=lambda outputs: sent.append("stats"),
                           io=SimpleNamespace(send=lambda client_id, message: sent.append(message)),
                           sleep=SimpleNamespace(refuse_update=lambda field: None, weights_loaded=lambda: None))  # awake
    updater = WeightUpdater(core)
    refusal = weights_error_reply("u1", InvalidRequestError("model_path", "differs: hidden_size"), rank=1)
    core.executor = _Executor([weights_error_reply("u1", InvalidRequestError("model_path", OTHER_RANK_REFUSED)), refusal])
    updater.update(b"host", protocol.UpdateWeights("u1", "/ckpt/b"))
    assert sent == ["stats", refusal] and updater.weights_version == 0  # the refusing rank's own reason
    assert core.restarter.config is config
    sent.clear()
    core.executor = _Executor([protocol.WeightsUpdated("u2", rank=0), protocol.WeightsUpdated("u2", rank=1)])
    updater.update(b"host", protocol.UpdateWeights("u2", "/ckpt/b", "main"))
    assert sent == ["stats", protocol.WeightsUpdated("u2", weights_version=1)]  # every host's stats, then the answer
    model = core.restarter.config.model_config
    assert (model.model, model.revision, model.load_format) == ("/ckpt/b", "main", "auto")  # a restart loads it
    sent.clear()
    core.executor = _Executor(EngineDeadError("worker rank 1 was killed by SIGKILL"))
    updater.update(b"host", protocol.UpdateWeights("u3", "/ckpt/c"))
    [_, reply] = sent
    assert isinstance(weights_error(reply), InvalidRequestError) and "failed while loading '/ckpt/c'" in reply.error
    assert len(recovered) == 1 and updater.weights_version == reply.weights_version == 1
    assert core.restarter.config.model_config.model == "/ckpt/b"  # the last update that loaded whole


def _push(runner: SimpleNamespace, named_tensors) -> protocol.WeightsUpdated:
    """One rank's `update_weights_from_tensors`, in process: the host's packing and the worker's check and copy."""
    packed = pack_tensors(named_tensors)
    try:
        return update_weights(runner, protocol.UpdateWeights("t", "", segment=packed.segment.name,
                                                             tensors=packed.tensors))
    finally:
        packed.close()


def test_pushed_tensors_are_copied_in_place_and_counted_down_from_dummy_weights() -> None:
    runner = _runner(tiny_checkpoint("llama"), load_format="dummy")
    addresses = {name: param.data_ptr() for name, param in runner.model.named_parameters()}
    weights = load_file(next(Path(tiny_checkpoint("llama", seed=1)).glob("*.safetensors")))
    name = "model.layers.1.mlp.down_proj.weight"
    transposed = weights[name].t().contiguous().t()  # the same values, column-major
    assert _push(runner, [(name, transposed)]).weights_unwritten == len(weights) - 1
    rest = {key: value.to(torch.bfloat16) for key, value in weights.items() if key != name}
    assert _push(runner, rest) == protocol.WeightsUpdated("t")  # every weight written: 0 left
    params = dict(runner.model.named_parameters())
    assert torch.equal(params[name], weights[name])  # exact: float32 in, float32 served
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]  # the fused parameter, both parts written
    assert torch.equal(gate_up, torch.cat([rest["model.layers.0.mlp.gate_proj.weight"],
                                           rest["model.layers.0.mlp.up_proj.weight"]]).float())
    assert all(param.data_ptr() == addresses[key] for key, param in params.items())


def test_a_refused_push_touches_nothing(runner) -> None:
    before = _params(runner.model)
    misshapen = {"model.norm.weight": torch.ones(64), "model.layers.0.mlp.up_proj.weight": torch.ones(3, 3)}
    reply = _push(runner, misshapen)  # the first fits, the second does not: neither is written
    assert "model.layers.0.mlp.up_proj.weight" in reply.error and weights_error(reply).field == "named_tensors"
    assert all(torch.equal(param, before[name]) for name, param in runner.model.named_parameters())
    gone = update_weights(runner, protocol.UpdateWeights("t", "", segment="asyncllm-weights-gone", tensors=[
        protocol.WeightTensor("model.norm.weight", "float32", [64], 0)]))
    assert "cannot map" in gone.error and weights_error(gone).field == "named_tensors"


def test_the_core_restarts_workers_on_dummy_weights_after_a_push_and_waits_for_every_weight() -> None:
    from asyncllm.engine.core_weights import WeightUpdater
    from asyncllm.sched.scheduler import Scheduler

    config = EngineConfig.create(tiny_checkpoint("llama"), max_model_len=256)
    loaded: list[bool] = []
    core = SimpleNamespace(config=config, overlap=None, scheduler=Scheduler(config, 16, 256),
                           restarter=SimpleNamespace(config=config), send_outputs=lambda outputs: None,
                           io=SimpleNamespace(send=lambda client_id, message: None),
                           sleep=SimpleNamespace(refuse_update=lambda field: None, weights_loaded=lambda: loaded.append(True),
                                                 awaiting_weights=True))
    updater = WeightUpdater(core)
    push = protocol.UpdateWeights("p", "", segment="asyncllm-weights-x", tensors=[])
    core.executor = _Executor([protocol.WeightsUpdated("p", rank=0), protocol.WeightsUpdated("p", rank=1,
                                                                                             weights_unwritten=3)])
    updater.update(b"host", push)
    assert updater.pushed and core.restarter.config.model_config.load_format == "dummy"  # on no disk
    assert loaded == []  # rank 1 still has 3 weights to be written
    core.executor = _Executor([protocol.WeightsUpdated("p", rank=0), protocol.WeightsUpdated("p", rank=1)])
    updater.update(b"host", push)
    assert loaded == [True] and updater.weights_version == 2
    core.executor = _Executor([protocol.WeightsUpdated("u", rank=0), protocol.WeightsUpdated("u", rank=1)])
    updater.update(b"host", protocol.UpdateWeights("u", "/ckpt/b"))
    model = core.restarter.config.model_config
    assert not updater.pushed and (model.model, model.load_format) == ("/ckpt/b", "auto")


def test_a_multimodal_checkpoint_must_keep_its_vision_tower_config() -> None:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    from asyncllm.workers.weight_update import _check_config

    def llava(vision_hidden: int, layer: int = -2) -> LlavaConfig:
        vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=28, patch_size=7)
        return LlavaConfig(vision_config=vision, text_config=LlamaConfig(hidden_size=64, num_hidden_layers=2),
                           vision_feature_layer=layer, architectures=["LlavaForConditionalGeneration"])

    _check_config(llava(32), llava(32))
    with pytest.raises(InvalidRequestError, match=r"vision_config.hidden_size=48 \(served: 32\)"):
        _check_config(llava(32), llava(48))
    with pytest.raises(InvalidRequestError, match=r"vision_feature_layer=-1 \(served: -2\)"):
        _check_config(llava(32), llava(32, layer=-1))
    served = LlamaConfig(hidden_size=64, num_hidden_layers=2, architectures=["LlamaForCausalLM"])
    gelu = LlamaConfig(hidden_size=64, num_hidden_layers=2, architectures=["LlamaForCausalLM"], hidden_act="gelu")
    with pytest.raises(InvalidRequestError, match=r"hidden_act='gelu' \(served: 'silu'\)"):  # it computes too
        _check_config(served, gelu)


def _fp8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every fp8 layer's weight bytes and scale, and every other parameter."""
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    state.update({name: buf.clone() for name, buf in model.named_buffers() if name.endswith("weight_scale")})
    return state


def test_online_fp8_weights_are_requantized_in_place_as_a_fresh_load_would() -> None:
    a, b = tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=1)
    runner = _runner(a, quantization="fp8")
    addresses = {name: param.data_ptr() for name, param in runner.model.named_parameters()}
    assert update_weights(runner, protocol.UpdateWeights("u", b)) == protocol.WeightsUpdated("u")
    fresh, got = _fp8_state(_runner(b, quantization="fp8").model), _fp8_state(runner.model)
    assert fresh.keys() == got.keys() and any(t.dtype == torch.float8_e4m3fn for t in got.values())
    for name, tensor in fresh.items():
        assert torch.equal(got[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else got[name],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), name
    assert all(param.data_ptr() == addresses[name] for name, param in runner.model.named_parameters())
    # one part of a fused layer: its rows new, the other parts' values as served (dequantized) under a new scale
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    before = fp8_to_float(qkv.weight.data) * qkv.weight_scale
    other = runner.model.model.layers[1].self_attn.qkv_proj.weight.detach().clone()
    k_new = torch.randn(qkv.kv_size, qkv.weight.shape[1]) * 3
    _push(runner, {"model.layers.0.self_attn.k_proj.weight": k_new})
    after = fp8_to_float(qkv.weight.data) * qkv.weight_scale
    expected = before.clone()
    expected[qkv.q_size:qkv.q_size + qkv.kv_size] = k_new
    w_q, scale = quantize_fp8_per_tensor(expected)
    assert torch.equal(qkv.weight_scale, scale) and torch.equal(after, fp8_to_float(w_q) * scale)
    assert torch.equal(runner.model.model.layers[1].self_attn.qkv_proj.weight.view(torch.uint8),
                       other.view(torch.uint8))  # a layer no tensor came for is untouched
