"""Pipeline parallelism over pre-quantized checkpoints (fp8 block-wise and per-tensor, AWQ, GPTQ, compressed-tensors,
GGUF), each stage built through the real loader in one process: it holds exactly its parts, each quantized parameter
equal to the unsplit model's (scales, zero points and repacked / requantized weights included), it reads only its
own checkpoint tensors, and the chained stages' logits are bit-equal to the unsplit quantized model's (every stage
runs the same layers on the same inputs with the same kernels; only the hand-over between stages is new).
``load_format="dummy"`` stages take the checkpoint's formats too."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors_reference import FP8_STATIC, INT8_STATIC, MIXED, int_weights, write_ct_checkpoint
from fp8_checkpoint_reference import write_fp8_checkpoint
from gguf import GGMLQuantizationType
from gguf_reference import write_gguf
from int4_reference import write_int4_checkpoint
from pipeline_utils import MemoryChannel, ReadSpy, Stages, paged_logits, stage_params

from asyncllm.config import EngineConfig
from asyncllm.models import gguf_loader, loader
from asyncllm.models.linear import LinearBase
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.pipeline import PipelineStage, StageModel
from asyncllm.pipeline_parallel import check_pipeline_model, get_pp_indices
from asyncllm.tiny import tiny_checkpoint

CPU = torch.device("cpu")
_ONE_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fp8(dst: Path, src: str, block: tuple[int, int] | None, ignored: tuple[str, ...] = ()) -> str:
    write_fp8_checkpoint(src, dst, block, ignored)
    return str(dst)


def _int4(dst: Path, src: str, method: str, desc_act: bool) -> str:
    write_int4_checkpoint(src, dst, method, 16, desc_act=desc_act)
    return str(dst)


def _ct(dst: Path, src: str, groups: dict[str, dict]) -> str:
    return str(write_ct_checkpoint(src, dst, groups))


def _gguf(dst: Path, src: str, arch: str) -> str:
    return write_gguf(src, str(dst.with_suffix(".gguf")), arch, GGMLQuantizationType.Q8_0)


CASES: dict[str, tuple[str, dict[str, Any], int, int, Any]] = {  # tiny arch, overrides, layers, stages, writer
    "fp8-block-3L-pp2": ("llama", {"num_layers": 3}, 3, 2,
                         lambda d, s: _fp8(d, s, (32, 48), ("layers.1.mlp",))),  # layer 1's MLP stays float
    "fp8-per-tensor": ("llama", {}, 2, 2, lambda d, s: _fp8(d, s, None)),
    "awq-g16-3L-pp3": ("llama", {"num_layers": 3}, 3, 3, lambda d, s: _int4(d, s, "awq", False)),
    "gptq-act-order-g16": ("llama", {}, 2, 2, lambda d, s: _int4(d, s, "gptq", True)),
    # stage 0: layer 0's fp8-dynamic and W4A16 layers; stage 1: layer 1's int8 W8A8 and fp8-block layers
    "ct-mixed": ("llama", {}, 2, 2, lambda d, s: _ct(d, s, MIXED)),
    "ct-static-3L-pp2": ("llama", {"num_layers": 3}, 3, 2,  # calibrated input scales; zero points
                         lambda d, s: _ct(d, s, {"fp8": {**FP8_STATIC, "targets": ["re:.*self_attn.*"]},
                                                 "int8": {**INT8_STATIC, "targets": ["re:.*mlp.down_proj$"]},
                                                 "w4a16": {**int_weights(4, 16, symmetric=False),
                                                           "targets": ["re:.*mlp.(gate|up)_proj$"]}})),
    "gguf-llama-q8_0-3L-pp2": ("llama", {"num_layers": 3}, 3, 2, lambda d, s: _gguf(d, s, "llama")),
    "gguf-qwen2-tied-q8_0": ("qwen2", {"tie_word_embeddings": True}, 2, 2, lambda d, s: _gguf(d, s, "qwen2")),
}
_written: dict[str, str] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case -> the path of its pre-quantized checkpoint, each written once."""
    def get(case: str) -> str:
        if case not in _written:
            arch, overrides, _, _, write = CASES[case]
            _written[case] = write(tmp_path_factory.mktemp("pp-quantized") / case, tiny_checkpoint(arch, **overrides))
        return _written[case]
    return get


def _stage(rank: int, pp: int, num_layers: int) -> PipelineStage:
    return PipelineStage(rank, pp, *get_pp_indices(num_layers, rank, pp))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype in _ONE_BYTE_FLOATS:  # no torch.equal for float8 on the CPU: compare the bytes
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got, want)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, shared ones under each of their names (a rotary cache serves every layer)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def _methods(model: torch.nn.Module) -> dict[str, str]:
    """Each parallel linear's product (its quant_method's class; None: the float matmul)."""
    return {name: type(module.quant_method).__name__ for name, module in model.named_modules()
            if isinstance(module, LinearBase)}


def _spy_reads(monkeypatch: pytest.MonkeyPatch, read: set[str]) -> None:
    """Record the safetensors tensors whose data were read and the GGUF tensors dequantized (as checkpoint-style
    names: ``blk.N.`` -> ``model.layers.N.``, ``token_embd`` -> the embeddings, ``output*`` -> the last stage's)."""
    real_iterate, real_dequantized = loader.iterate_safetensors, gguf_loader._dequantized

    def iterate(files: list[str]):
        return ((name, ReadSpy(name, weight, read)) for name, weight in real_iterate(files))

    def dequantized(tensor: Any, *args: Any) -> Any:
        name = re.sub(r"^blk\.(\d+)\.", r"model.layers.\1.", tensor.name)
        read.add({"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}.get(name, name))
        return real_dequantized(tensor, *args)

    monkeypatch.setattr(loader, "iterate_safetensors", iterate)
    monkeypatch.setattr(gguf_loader, "_dequantized", dequantized)


@pytest.mark.parametrize("case", list(CASES))
def test_stages_hold_their_quantized_parts_and_equal_the_unsplit_model(checkpoint, monkeypatch, case: str) -> None:
    _check_stages(checkpoint(case), case, monkeypatch)


@pytest.mark.parametrize("case", ["awq-g16-3L-pp3", "gptq-act-order-g16", "ct-mixed", "ct-static-3L-pp2"])
def test_packed_int_layers_repack_on_each_stage(checkpoint, monkeypatch, case: str) -> None:
    """The GPU's finishing step on the CPU: AWQ / GPTQ / W4A16 layers kept packed in the GEMM's layout (computed
    through the torch reference) rather than dequantized; each stage repacks only its layers, as the unsplit model."""
    from asyncllm.models import compressed_tensors, int4_checkpoint

    for module, finish in ((int4_checkpoint, "finish_int4_params"),
                           (compressed_tensors, "finish_compressed_tensors_params")):
        monkeypatch.setattr(module, finish, functools.partial(getattr(module, finish), keep_packed=True))
    methods = _check_stages(checkpoint(case), case, monkeypatch)
    assert "Int4LinearMethod" in methods.values()


def _check_stages(path: str, case: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Each stage's parts, their tensors, products and reads against the unsplit model's, and the chained logits;
    returns the unsplit model's products."""
    _, _, num_layers, pp, _ = CASES[case]
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=pp)
    check_pipeline_model(config, hf_config.architectures[0], hf_config)  # not refused
    read_full: set[str] = set()
    with monkeypatch.context() as patch:
        _spy_reads(patch, read_full)
        full = load_model(config, hf_config, CPU, torch.float32)
    full_tensors, full_methods = _tensors(full), _methods(full)
    channel, stages = MemoryChannel(), []
    for rank in range(pp):
        stage, read = _stage(rank, pp, num_layers), set()
        with monkeypatch.context() as patch:
            _spy_reads(patch, read)
            model = load_model(config, hf_config, CPU, torch.float32, pipeline=stage)
        held = _tensors(model)
        assert set(held) == stage_params(set(full_tensors), stage, full.tie_word_embeddings)
        assert [name for name, tensor in held.items() if not _same(tensor, full_tensors[name])] == []
        assert _methods(model) == {name: full_methods[name] for name in _methods(model)}
        assert read == stage_params(read_full, stage, full.tie_word_embeddings) and read  # its own tensors only
        stages.append(StageModel(model, stage, channel))
    for got, want in zip(paged_logits(Stages(stages), path), paged_logits(full, path), strict=True):
        assert torch.equal(got, want)
    assert not channel.queue
    return full_methods


@pytest.mark.parametrize("case", ["fp8-block-3L-pp2", "fp8-per-tensor", "awq-g16-3L-pp3", "gptq-act-order-g16",
                                  "ct-mixed", "ct-static-3L-pp2", "gguf-llama-q8_0-3L-pp2"])
def test_dummy_stages_take_the_checkpoints_formats(checkpoint, case: str) -> None:
    """``load_format="dummy"``: each stage draws its own parts in the unsplit dummy model's formats (parameter
    names, dtypes, shapes, products); the chained stages run to finite logits (the draws differ: one generator
    walks each model's own parameters)."""
    path, (_, _, num_layers, pp, _) = checkpoint(case), CASES[case]
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, load_format="dummy", pipeline_parallel_size=pp)
    full = load_model(config, hf_config, CPU, torch.float32)
    full_tensors, full_methods = _tensors(full), _methods(full)
    channel, stages = MemoryChannel(), []
    for rank in range(pp):
        stage = _stage(rank, pp, num_layers)
        model = load_model(config, hf_config, CPU, torch.float32, pipeline=stage)
        held = _tensors(model)
        assert set(held) == stage_params(set(full_tensors), stage, full.tie_word_embeddings)
        assert {name: (t.dtype, t.shape) for name, t in held.items()} == \
            {name: (full_tensors[name].dtype, full_tensors[name].shape) for name in held}
        assert _methods(model) == {name: full_methods[name] for name in _methods(model)}
        stages.append(StageModel(model, stage, channel))
    assert all(torch.isfinite(logits).all() for logits in paged_logits(Stages(stages), path))
