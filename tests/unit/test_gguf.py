"""GGUF checkpoints (asyncllm/models/gguf_config.py, gguf_loader.py): tiny float32 models written as GGUF files by
tests/gguf_reference.py (llama.cpp's renaming and q/k permutation, F32, Q8_0 or Q4_0 weights), loaded by asyncllm and
by transformers: the weights must be equal exactly, on one rank and on both of tensor_parallel_size=2. The tokenizer
built from the file and what is refused are checked here too; the engine is in tests/engine/test_gguf_engine.py."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_reference import hf_gguf_state_dict, write_gguf

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import load_hf_config, prequantized_config, resolve_model_path
from asyncllm.models.gguf_config import GgufCheckpointConfig
from asyncllm.models.gguf_loader import load_gguf_weights
from asyncllm.models.layers import TensorParallel
from asyncllm.models.registry import get_model_class

CPU = torch.device("cpu")
CASES = {  # tiny arch, its overrides, stored type of 2-D weights
    "llama-q8_0": ("llama", {}, GGMLQuantizationType.Q8_0),
    "llama-f32": ("llama", {}, GGMLQuantizationType.F32),
    "qwen2-q4_0": ("qwen2", {}, GGMLQuantizationType.Q4_0),
    "qwen2-tied-q8_0": ("qwen2", {"tie_word_embeddings": True}, GGMLQuantizationType.Q8_0),  # no output.weight
    # transformers reads no head_dim from a qwen3 GGUF (its default, 128, is every Qwen3's)
    "qwen3-q8_0": ("qwen3", {"head_dim": 128}, GGMLQuantizationType.Q8_0),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, str]:
    from asyncllm.tiny import tiny_checkpoint

    folder = tmp_path_factory.mktemp("gguf")
    return {case: write_gguf(tiny_checkpoint(arch, **overrides), str(folder / f"tiny-{case}.gguf"), arch, qtype)
            for case, (arch, overrides, qtype) in CASES.items()}


def _load(path: str, rank: int, tp: int) -> torch.nn.Module:
    hf_config = load_hf_config(path)
    model = get_model_class(hf_config)(hf_config, dtype=torch.float32, tp=TensorParallel(rank, tp),
                                       attn_backend=get_attention_backend(None, CPU, torch.float32), max_position=128)
    load_gguf_weights(model, path, hf_config)
    return model


def _expected(hf: dict[str, torch.Tensor], name: str, rank: int, tp: int) -> torch.Tensor:
    """transformers' tensor(s) behind our parameter ``name``, rank ``rank``'s slice of them."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for target, parts in fused.items():
        if f".{target}." in name:
            return torch.cat([hf[name.replace(target, part)].chunk(tp)[rank] for part in parts])
    weight = hf[name]
    if any(f".{row}." in name for row in ("o_proj", "down_proj")):
        return weight.chunk(tp, dim=1)[rank]
    if "embed_tokens" in name or "lm_head" in name:
        return weight.chunk(tp)[rank]
    return weight


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_weights_equal_transformers(gguf_files, case: str) -> None:
    """Bit for bit: both dequantize with gguf and un-permute llama's q and k rows; no tensor of either is left."""
    path = gguf_files[case]
    hf = hf_gguf_state_dict(path)
    model = _load(path, 0, 1)
    tied = {"lm_head.weight"} if load_hf_config(path).tie_word_embeddings else set()  # no output.weight in the file
    assert model.checkpoint_weight_names() == set(hf) - tied
    for name, param in model.named_parameters():
        assert torch.equal(param, _expected(hf, name, 0, 1)), name


def test_both_ranks_hold_their_slices(gguf_files) -> None:
    path = gguf_files["llama-q8_0"]
    hf = hf_gguf_state_dict(path)
    for rank in range(2):
        for name, param in _load(path, rank, 2).named_parameters():
            assert torch.equal(param, _expected(hf, name, rank, 2)), (name, rank)


def test_the_config_names_what_asyncllm_builds(gguf_files) -> None:
    hf_config = load_hf_config(gguf_files["llama-q8_0"])
    assert hf_config.architectures == ["LlamaForCausalLM"]
    assert (hf_config.num_hidden_layers, hf_config.num_key_value_heads, hf_config.vocab_size) == (2, 2, 512)
    assert load_hf_config(gguf_files["qwen2-q4_0"]).architectures == ["Qwen2ForCausalLM"]
    assert load_hf_config(gguf_files["qwen3-q8_0"]).architectures == ["Qwen3ForCausalLM"]
    path = gguf_files["llama-q8_0"]
    assert resolve_model_path(path) == path
    assert prequantized_config(hf_config, path, None) == prequantized_config(hf_config, path, "gguf") \
        == GgufCheckpointConfig(path)


def test_a_llama_file_named_mistral_is_mistral(tiny_llama: str, gguf_files, tmp_path) -> None:
    """transformers reads it as MistralForCausalLM (and cannot load its weights itself: gguf-py has no "mistral"
    name table); asyncllm loads the same weights as from the file named otherwise."""
    path = write_gguf(tiny_llama, str(tmp_path / "mistral.gguf"), name="mistral")
    assert load_hf_config(path).architectures == ["MistralForCausalLM"]
    llama = dict(_load(gguf_files["llama-q8_0"], 0, 1).named_parameters())
    for name, param in _load(path, 0, 1).named_parameters():
        assert torch.equal(param, llama[name]), name


def test_quantization_must_match_the_model(gguf_files, tiny_llama: str) -> None:
    assert EngineConfig.create("m", quantization="gguf").quantization == "gguf"
    path = gguf_files["llama-q8_0"]
    for other in ("fp8", "awq", "gptq"):
        with pytest.raises(ConfigError, match="None or 'gguf'"):
            prequantized_config(None, path, other)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        prequantized_config(load_hf_config(tiny_llama), tiny_llama, "gguf")
    with pytest.raises(ConfigError, match="that exists"):
        resolve_model_path(path + ".missing.gguf")
    with pytest.raises(NotBuiltError, match="'repo:quant'"):
        resolve_model_path("TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF:Q4_K_M")


def test_other_gguf_architectures_are_not_built(tmp_path) -> None:
    path = str(tmp_path / "phi.gguf")
    writer = GGUFWriter(path, "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotBuiltError, match="'phi3' architecture"):
        load_hf_config(path)


def test_without_a_tokenizer_it_is_built_from_the_file(gguf_files, tiny_llama: str) -> None:
    from asyncllm.tokenizer import eos_token_ids, load_tokenizer

    ours, original = load_tokenizer(gguf_files["llama-q8_0"]), load_tokenizer(tiny_llama)
    for text in ("def f(x):\n    return x + 1\n", "import os, sys  # 42", "hello world"):
        ids = ours(text).input_ids
        assert ids == original(text).input_ids and ours.decode(ids) == original.decode(ids), text
    assert eos_token_ids(ours, gguf_files["llama-q8_0"]) == [original.eos_token_id]
