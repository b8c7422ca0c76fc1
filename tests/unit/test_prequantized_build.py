"""A pre-quantized checkpoint's model is built without its float weights (asyncllm/models/loader.py): the parameters
are on the meta device until the quantized ones replace the float ones, and only then (`materialize_params`) is
anything allocated; tied embeddings stay one parameter."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors_reference import write_ct_fp8_experts
from fp8_checkpoint_reference import write_fp8_checkpoint
from int4_reference import write_int4_checkpoint
from safetensors.torch import load_file

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models import loader
from asyncllm.tiny import tiny_checkpoint

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
EXPERTS = "model.layers.0.mlp.experts"
CASES = {  # name -> (architecture, writer, {parameter: its dtype before loading})
    "fp8-block": ("qwen3_moe", lambda src, dst: write_fp8_checkpoint(src, dst, (16, 16), ("lm_head",)),
                  {"model.layers.0.self_attn.qkv_proj.weight": FP8, f"{EXPERTS}.w13_weight": FP8,
                   f"{EXPERTS}.w2_weight": FP8}),
    "awq": ("llama", lambda src, dst: write_int4_checkpoint(src, dst, "awq", 32),
            {"model.layers.0.self_attn.qkv_proj.qweight": torch.int32, "model.layers.1.mlp.down_proj.qweight":
             torch.int32}),
    "compressed-tensors-fp8-experts": ("qwen3_moe", lambda src, dst: write_ct_fp8_experts(src, dst, "block", (16, 16)),
                                       {f"{EXPERTS}.w13_weight": FP8, f"{EXPERTS}.w2_weight": FP8}),
}


def _load_watching(path: str, monkeypatch) -> tuple[torch.nn.Module, list[dict[str, tuple[str, torch.dtype]]]]:
    """The loaded model, and each parameter's (device type, dtype) when `materialize_params` was called."""
    seen: list[dict[str, tuple[str, torch.dtype]]] = []
    materialize = loader.materialize_params

    def watch(model: torch.nn.Module, device: torch.device) -> int:
        seen.append({name: (param.device.type, param.dtype) for name, param in model.named_parameters()})
        return materialize(model, device)

    monkeypatch.setattr(loader, "materialize_params", watch)
    model = loader.load_model(EngineConfig.create(path), loader.load_hf_config(path), CPU, torch.float32)
    return model, seen


@pytest.mark.parametrize("case", list(CASES))
def test_the_float_weights_of_quantized_layers_are_never_allocated(tmp_path, monkeypatch, case: str) -> None:
    arch, write, quantized = CASES[case]
    write(tiny_checkpoint(arch), tmp_path / case)
    model, seen = _load_watching(str(tmp_path / case), monkeypatch)
    assert len(seen) == 1
    before = seen[0]
    assert {name for name, (device, _) in before.items() if device != "meta"} == set()  # nothing allocated yet
    assert {name: before[name][1] for name in quantized} == quantized  # the quantized parameters replaced the float
    assert {name for name, param in model.named_parameters() if param.device != CPU} == set()  # then all loaded


def test_tied_embeddings_stay_one_parameter(tmp_path, monkeypatch) -> None:
    path = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_checkpoint("llama", tie_word_embeddings=True), path, (16, 16))
    model, seen = _load_watching(str(path), monkeypatch)
    assert seen[0]["model.embed_tokens.weight"] == ("meta", torch.float32)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding and embedding.device == CPU
    assert torch.equal(embedding, load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"])


def test_materialize_params_zeroes_keeps_attributes_and_refuses_meta_buffers() -> None:
    from torch import nn

    from asyncllm.models.layers import new_param, params_on_meta

    with params_on_meta():
        model = nn.Sequential(nn.Module(), nn.Module())
        model[0].weight = model[1].weight = new_param(3, 2, dtype=torch.float16, loader=print)
    assert loader.materialize_params(model, CPU) == 1  # one parameter, held twice
    weight = model[0].weight
    assert model[1].weight is weight and weight.weight_loader is print and not weight.requires_grad
    assert weight.dtype == torch.float16 and torch.equal(weight, torch.zeros(3, 2, dtype=torch.float16))
    model[1].register_buffer("table", torch.empty(2, device="meta"))
    with pytest.raises(RuntimeError, match=r"buffers \['1.table'\] were made on the meta device"):
        loader.materialize_params(model, CPU)


@pytest.mark.parametrize("case", ["float", *CASES])
def test_load_format_pt_reads_only_pickles_pre_quantized_or_not(tmp_path, case: str) -> None:
    """``load_format='pt'`` on a folder of safetensors only is refused naming load_format, whether the checkpoint
    is pre-quantized (fp8, AWQ, compressed-tensors loaders) or not."""
    if case == "float":
        path = tiny_checkpoint("llama")
    else:
        arch, write, _ = CASES[case]
        write(tiny_checkpoint(arch), tmp_path / case)
        path = str(tmp_path / case)
    config = EngineConfig.create(path, load_format="pt")
    with pytest.raises(ConfigError, match=r"load_format='pt' is not allowed: .*pytorch_model\*\.bin or \*\.pt"):
        loader.load_model(config, loader.load_hf_config(path), CPU, torch.float32)
