"""Compressed-tensors fp8 experts (asyncllm/models/compressed_tensors_experts.py): tiny mixtures of experts whose
experts are written in the format (tests/compressed_tensors_reference.py: fp8 weights with bfloat16 scales per row,
per matrix or per 16x16 block; the rest float) loaded through the real loader and compared with transformers' model
holding the dequantized experts, each product's input fake-quantized per token (block: in groups of 16), the served
path's (docs/quantization.md). Mixtral at hidden 192 and intermediate 160: each product's input wider than the
fused-MoE kernel's 128-column K step, one scale per token. Both tensor-parallel ranks' experts against the reference
on their slice; dummy weights; static fp8 activation scales (llm-compressor's FP8: one ``input_scale`` per expert
matrix, the largest of the experts' per product served, vLLM's); static int8 W8A8 ones and a layer's experts in two
schemes refused (the int8 W8A8 experts served: tests/unit/test_compressed_tensors_int8_experts.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors_reference import write_ct_fp8_experts
from fp8_checkpoint_reference import _EXPERT, _EXPERT_PART, _expert_input_scales, _fp8_experts_forward, _set_expert
from hf_reference import model_logits
from model_utils import PagedRun
from served_inputs import ServedInputs, snap_reference

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.compressed_tensors_experts import finish_ct_w8a8_experts, make_ct_w8a8_expert_params
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import build_model, load_checkpoint, load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
SEQUENCES = [[7, 62, 8, 301, 9, 11, 42, 13, 200, 14, 15], [50, 41, 42]]
"""Sequences where no value the model quantizes lies within float32 summation noise of an fp8 rounding midpoint (with
one input scale per token, as channel and tensor experts are served since 2026-11-30): in ``[5, 60, 7, 300, ...]``,
``[7, 61, 8, 301, ...]`` and ``[40, 41, 42]`` one does, and a flipped rounding moves a logit by 4e-3 to 0.4."""
VS_REFERENCE = 1e-4
"""|logits - reference|, float32: the same products summed per input group, in another order (measured up to 8.1e-6
with 1 and 2 threads)."""
BLOCK = (16, 16)
CASES = {  # strategy -> (architecture, its sizes), the served fp8_block, the reference's input group (None: per token)
    "channel": (("mixtral", {"hidden_size": 192, "intermediate_size": 160}), (1, 192), None),  # one scale per row
    "tensor": (("qwen3_moe", {}), (32, 64), None),  # one per (I, H) block: a matrix (hidden 64)
    "block": (("qwen3_moe", {}), BLOCK, BLOCK[1]),
}


class ExpertsReference:
    """transformers' float32 model of ``src`` with the dequantized experts, their inputs fake-quantized per token in
    groups of ``group`` features (None: whole), or with the static scales of the checkpoint ``tensors`` (their
    ``input_scale``s)."""

    def __init__(self, src: str, dequantized: dict[str, torch.Tensor], group: int | None,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for name, weight in dequantized.items():
                prefix, index, part = _EXPERT.match(name).groups()
                experts = modules.get(prefix) or modules[prefix.replace("block_sparse_moe", "mlp")]
                static = None if tensors is None else _expert_input_scales(tensors, prefix)
                _set_expert(experts, int(index), _EXPERT_PART.get(part, part), weight, group, static)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return model_logits(self.model, token_ids)


_written: dict[str, tuple[str, str, dict[str, torch.Tensor]]] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """strategy -> (float source, fp8-experts copy, its dequantized experts), each written once."""
    from asyncllm.tiny import tiny_checkpoint

    def get(strategy: str) -> tuple[str, str, dict[str, torch.Tensor]]:
        if strategy not in _written:
            arch, sizes = CASES[strategy][0]
            src, path = tiny_checkpoint(arch, **sizes), tmp_path_factory.mktemp("ct") / strategy
            _written[strategy] = (src, str(path), write_ct_fp8_experts(src, path, strategy, BLOCK))
        return _written[strategy]
    return get


@pytest.mark.parametrize("strategy", CASES)
def test_fp8_experts_equal_the_reference(checkpoint, strategy: str, monkeypatch) -> None:
    src, path, dequantized = checkpoint(strategy)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, CPU, torch.float32)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    served = ServedInputs(model, monkeypatch)
    ref = ExpertsReference(src, dequantized, CASES[strategy][2])
    served_logits = run.run([[6, 3], [5, 0]])
    snap_reference(ref.model, served)
    for seq, logits in zip(SEQUENCES, served_logits):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8 and experts.fp8_block == CASES[strategy][1]
    assert not hasattr(experts, "gate_weight_scale")  # the staging scales are gone


@pytest.mark.parametrize("strategy, rank", [("channel", 0), ("channel", 1), ("block", 1)])
def test_each_tensor_parallel_rank_computes_its_slice(checkpoint, strategy: str, rank: int) -> None:
    """tp=2: a rank holds the gate and up rows [I r, I r + I) of every expert (their scales: those rows', block
    rows) and the down's columns (per row: every row's scale; block-wise: those block columns); its partial output
    is the reference's on its slice, the down product's input (groups) over its columns."""
    src, path, dequantized = checkpoint(strategy)
    hf_config = load_hf_config(path)
    cfg = prequantized_config(hf_config, path, None)
    model = build_model(EngineConfig.create(path), hf_config, CPU, torch.float32, rank, 2)
    assert make_ct_w8a8_expert_params(model, cfg) == 2
    load_checkpoint(model, path)
    finish_ct_w8a8_experts(model, cfg)
    moe = model.model.layers[0].mlp.experts
    num_experts, inter = moe.w13_weight.shape[0], moe.intermediate
    rows, hidden = slice(inter * rank, inter * rank + inter), moe.w2_weight.shape[1]
    prefix, (gate, up, down) = ("model.layers.0.block_sparse_moe.experts", ("w1", "w3", "w2")) if "mixtral" in src \
        else ("model.layers.0.mlp.experts", ("gate_proj", "up_proj", "down_proj"))
    sliced = SimpleNamespace(act_fn=F.silu, gate_up_proj=torch.stack([torch.cat(
        [dequantized[f"{prefix}.{e}.{gate}.weight"][rows], dequantized[f"{prefix}.{e}.{up}.weight"][rows]])
        for e in range(num_experts)]), down_proj=torch.stack([dequantized[f"{prefix}.{e}.{down}.weight"][:, rows]
                                                             for e in range(num_experts)]))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, hidden, generator=gen)
    ids = torch.randint(0, num_experts, (6, 2), generator=gen)
    topk = torch.rand(6, 2, generator=gen)
    moe.tp = TensorParallel()  # this rank's partial sum, not all-reduced
    want = _fp8_experts_forward(sliced, x, ids, topk, CASES[strategy][2])
    torch.testing.assert_close(moe(x, topk, ids), want, atol=1e-5, rtol=1e-5)


def test_static_fp8_input_scales_equal_the_reference(checkpoint, tmp_path) -> None:
    """FP8 with static per-tensor activations: each expert matrix's bfloat16 ``input_scale`` (gate and up 3 / 448,
    down 16 / 448, times 1 + e / 4 for expert e; the inputs reach 3.5 to 4.2, the activations 12 to 16), the
    experts' inputs quantized with the largest gate/up and down ones."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, written, dequantized = checkpoint("tensor")
    path = shutil.copytree(written, tmp_path / "ct")
    tensors = load_file(str(path / "model.safetensors"))
    for name in dequantized:
        scale = (16 if ".down_proj." in name else 3) / 448 * (1 + int(name.split(".experts.")[1].split(".")[0]) / 4)
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([scale], dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["experts"]
    group["input_activations"].update(strategy="tensor", dynamic=False)
    (path / "config.json").write_text(json.dumps(config))
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path)), hf_config, CPU, torch.float32)
    experts = model.model.layers[0].mlp.experts
    last = experts.num_experts - 1
    assert experts.w13_input_scale == tensors[f"model.layers.0.mlp.experts.{last}.up_proj.input_scale"].float()
    assert experts.w2_input_scale == tensors[f"model.layers.0.mlp.experts.{last}.down_proj.input_scale"].float()
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    ref = ExpertsReference(src, dequantized, None, tensors)
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE


def test_dummy_weights_give_fp8_experts(checkpoint) -> None:
    _, path, _ = checkpoint("channel")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, load_format="dummy"), hf_config, CPU, torch.float32)
    experts = model.model.layers[0].mlp.experts
    w13, scales = experts.w13_weight, experts.w13_weight_scale_inv
    assert w13.dtype == FP8 and scales.shape == (4, 320, 1) and experts.w2_weight_scale_inv.shape == (4, 192, 1)
    assert w13.float().abs().amax(-1).eq(448).all()  # each row by its own scale
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    assert all(torch.isfinite(logits).all() for logits in run.run([[6, 3], [5, 0]]))


@pytest.mark.parametrize("change, error, refused", [
    ({"input_activations": {"strategy": "tensor", "dynamic": False}}, ConfigError,  # static without input_scale
     r"missing: model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.input_scale"),
    ({"input_activations": {"type": "int", "strategy": "tensor", "dynamic": False}, "weights": {"type": "int"}},
     NotBuiltError, "static int8 activation scales"),
    ({"targets": ["re:.*experts.*w[13]$"]}, ConfigError, "one compressed-tensors scheme for all of a layer's"),
])
def test_other_expert_schemes_are_refused_by_name(checkpoint, tmp_path, change: dict, error: type,
                                                  refused: str) -> None:
    """Static input scales (fp8; int8 W8A8, ``int-quantized``), a layer whose down matrices are left float."""
    import shutil

    _, written, _ = checkpoint("channel")
    path = shutil.copytree(written, tmp_path / "ct")
    config = json.loads((path / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["experts"]
    for key, value in change.items():
        group[key] = {**group[key], **value} if isinstance(value, dict) else value
    if "weights" in change:
        config["quantization_config"]["format"] = "int-quantized"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=refused):
        load_model(EngineConfig.create(str(path)), load_hf_config(str(path)), CPU, torch.float32)
