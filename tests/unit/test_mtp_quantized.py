"""An MTP layer's entry projection (DeepSeek's ``eh_proj``, Qwen's ``fc``) under a pre-quantized checkpoint: a float
linear, as vLLM builds it and the released fp8 checkpoints store it (bf16 beside block-fp8 decoder weights); one
stored in fp8 with its scale is dequantized as it loads, one in another quantized format refused by name."""

from __future__ import annotations


import pytest
import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.mtp import float_entry_weights
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.model_runner import ModelRunner
from eagle_utils import add_mtp_layer
from fp8_checkpoint_reference import dequantize_blocks, quantize_blocks, write_fp8_checkpoint

BLOCK, K, PROMPT = (16, 16), 2, list(range(40, 52))
GREEDY = SamplingParams(temperature=0.0)


def _runner(path: str, **fields) -> ModelRunner:
    config = EngineConfig.create(path, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, **fields)
    runner = ModelRunner(config, 0, 1, torch.device("cpu"))
    runner.load_model()
    runner.init_cache(8)
    return runner


def _greedy(runner: ModelRunner, n: int) -> tuple[list[int], int]:
    """``n`` greedy tokens after `PROMPT`, each step verifying the runner's own drafts (none without speculation);
    (the tokens, how many drafts were accepted)."""
    new = NewRequestData("r", PROMPT, len(PROMPT), GREEDY, [3, 4, 5], 0)
    out = runner.execute_model(SchedulerOutput(0, [new], CachedRequestData(), {"r": len(PROMPT)}, len(PROMPT)))
    tokens, computed, accepted = out.sampled_token_ids[0], len(PROMPT), 0
    while len(tokens) < n:
        drafts = (out.draft_token_ids or {}).get("r", [])
        out = runner.execute_model(SchedulerOutput(
            len(tokens), [], CachedRequestData(["r"], [computed], {"r": []}), {"r": 1 + len(drafts)},
            1 + len(drafts), spec_token_ids={"r": drafts} if drafts else {}))
        sampled = out.sampled_token_ids[0]
        tokens, computed, accepted = tokens + sampled, computed + len(sampled), accepted + len(sampled) - 1
    return tokens[:n], accepted


@pytest.mark.parametrize("stored", ["bf16", "fp8"])
def test_a_block_fp8_deepseek_v3_checkpoint_drafts_with_its_mtp_layer(stored, tmp_path):
    """DeepSeek-V3's release layout: the MTP layer's ``eh_proj`` float, no ``weight_scale_inv`` (or, as a third-party
    quantization might store it, block fp8 with its scales); the draft's ``eh_proj`` is the checkpoint's (dequantized),
    and greedy tokens verified against its drafts equal the target's alone."""
    from safetensors.torch import save_file

    from asyncllm.tiny import tiny_checkpoint

    src = add_mtp_layer(tiny_checkpoint("deepseek_v3"), str(tmp_path / "float"))
    tensors = write_fp8_checkpoint(src, tmp_path / "fp8", BLOCK)
    name = "model.layers.2.eh_proj.weight"
    assert name + "_scale_inv" not in tensors and tensors[name].dtype == torch.float32
    eh_proj = tensors[name]
    if stored == "fp8":
        tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name], BLOCK)
        eh_proj = dequantize_blocks(tensors[name], tensors[name + "_scale_inv"], BLOCK).float()
        save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    spec = _runner(str(tmp_path / "fp8"), speculative_config={"method": "mtp", "num_speculative_tokens": K})
    draft = spec.drafter.model.model.layers[0]
    assert draft.eh_proj.weight.dtype == torch.float32 and torch.equal(draft.eh_proj.weight, eh_proj)
    assert draft.self_attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn  # the rest of the layer stays fp8
    want, _ = _greedy(_runner(str(tmp_path / "fp8")), 8)
    tokens, _ = _greedy(spec, 8)
    assert tokens == want


def _stream(**parts: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [("model.layers.0.enorm.weight", torch.ones(4)),
            *((f"model.layers.0.eh_proj.{part}", t) for part, t in parts.items())]


def test_an_fp8_stored_entry_projection_is_dequantized_and_other_formats_are_refused():
    """A third-party fp8 quantization of ``eh_proj`` (its block ``weight_scale_inv``, or a per-tensor
    ``weight_scale``) loads as the dequantized float weight; AWQ's ``qweight`` and a scale-less fp8 weight are
    refused; a float one passes as stored."""
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_blocks(w, BLOCK)
    proj = "model.layers.0.eh_proj"
    out = dict(float_entry_weights(_stream(weight=q, weight_scale_inv=scale), proj, BLOCK))
    assert set(out) == {"model.layers.0.enorm.weight", proj + ".weight"}
    assert torch.equal(out[proj + ".weight"], dequantize_blocks(q, scale, BLOCK).float())
    assert torch.equal(dict(float_entry_weights(_stream(weight=q, weight_scale_inv=scale), proj, None))[
        proj + ".weight"], out[proj + ".weight"])  # the block read off the scale's shape
    tensor_scale = torch.tensor(0.5)
    per_tensor = dict(float_entry_weights(_stream(weight=q, weight_scale=tensor_scale), proj, None))
    assert torch.equal(per_tensor[proj + ".weight"], q.float() * 0.5)
    assert dict(float_entry_weights(_stream(weight=w), proj, BLOCK))[proj + ".weight"] is w
    with pytest.raises(NotBuiltError, match=r"eh_proj is stored quantized .*eh_proj.qweight"):
        list(float_entry_weights(_stream(qweight=torch.zeros(4, 4, dtype=torch.int32)), proj, None))
    with pytest.raises(ConfigError, match="weight_scale_inv or weight_scale"):
        list(float_entry_weights(_stream(weight=q), proj, BLOCK))
    with pytest.raises(NotBuiltError, match=r"eh_proj is stored as torch.int8"):  # W8A8: not read as a float weight
        list(float_entry_weights(_stream(weight=torch.zeros(4, 4, dtype=torch.int8), weight_scale=scale), proj, None))
    with pytest.raises(ConfigError, match=r"one per block \(\(16, 16\)\) of its \[32, 48\] fp8 weight; got shape"):
        list(float_entry_weights(_stream(weight=q, weight_scale_inv=scale[:, :2]), proj, BLOCK))


def test_without_a_block_in_the_config_partial_128_blocks_are_read_as_128():
    """A 300 x 200 weight in 128 x 128 blocks has a 3 x 2 scale, which a block read off the shape would take for
    100 x 100: the released checkpoints' 128 comes first."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_blocks(w, (128, 128))
    proj = "model.layers.0.eh_proj"
    out = dict(float_entry_weights(_stream(weight=q, weight_scale_inv=scale), proj, None))[proj + ".weight"]
    assert torch.equal(out, dequantize_blocks(q, scale, (128, 128)).float())


def test_both_layouts_mark_their_entry_projection_float_for_every_pre_quantized_format():
    """DeepSeek's ``eh_proj`` and Qwen's ``fc`` are passed over by `quantized_layers` (fp8, AWQ / GPTQ and
    compressed-tensors alike); the layer's other linears are not."""
    from torch import nn

    from asyncllm.models.layers import TensorParallel
    from asyncllm.models.linear import ColumnParallelLinear
    from asyncllm.models.mtp import MTPHead
    from asyncllm.models.qwen_mtp import QwenMTPHead
    from asyncllm.models.quantization import quantize_fp8_linears
    from asyncllm.models.quantized_layers import quantized_layers

    class Config:
        hidden_size, rms_norm_eps, vocab_size = 16, 1e-6, 32

    for head in (MTPHead, QwenMTPHead):
        layer = nn.Module()
        for name, module in head.layer_modules(None, Config(), torch.float32, TensorParallel(), None).items():
            setattr(layer, name, module)
        layer.o_proj = ColumnParallelLinear(16, 16, False, TensorParallel(), torch.float32)
        assert [name for name, _ in quantized_layers(layer, lambda _: False)] == ["o_proj"]
        assert isinstance(getattr(layer, head.entry_proj), ColumnParallelLinear)
        quantize_fp8_linears(layer)  # online fp8 (quantization="fp8") passes it over too, as vLLM's nn.Linear
        assert layer.o_proj.weight.dtype == torch.float8_e4m3fn
        assert getattr(layer, head.entry_proj).weight.dtype == torch.float32
