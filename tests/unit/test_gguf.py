"""GGUF checkpoints (asyncllm/models/gguf_config.py, gguf_loader.py): tiny float32 models written as GGUF files by
tests/gguf_reference.py (llama.cpp's renaming and q/k permutation, F32, Q8_0 or Q4_0 weights), loaded by asyncllm and
by transformers: the weights must be equal exactly, on one rank and on both of tensor_parallel_size=2. The tokenizer
built from the file and what is refused are checked here too; the engine is in tests/engine/test_gguf_engine.py.
A rope-scaled Llama (llama3 as llama.cpp stores it: rope_freqs.weight; linear: rope.scaling metadata), written F32,
is compared with transformers' model of the ORIGINAL checkpoint (transformers' own GGUF reader drops the scaling).
Gemma 2, Gemma 3 (text) and Phi-3 files: quantized ones give transformers' logits of the same file (Gemma's norms
stored plus one by llama.cpp); F32 ones with the keys transformers' reader drops (Gemma 2's softcapping, Gemma 3's
global rope scaling, Phi-3's partial rotary and sliding window) give the original checkpoint's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import random_prompts
import gguf_reference
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf_reference import LINEAR_ROPE, LLAMA3_ROPE, hf_gguf_state_dict, with_rope_parameters, write_gguf
from hf_reference import _hf_model, hf_logits
from model_utils import PagedRun

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import load_hf_config, prequantized_config, resolve_model_path
from asyncllm.models.gguf_config import GgufCheckpointConfig
from asyncllm.models.gguf_loader import load_gguf_weights
from asyncllm.models.layers import TensorParallel
from asyncllm.models.registry import get_model_class
from asyncllm.models.rotary import compute_inv_freq

CPU = torch.device("cpu")
GEMMA_AS_READ = {"query_pre_attn_scalar": 256}  # transformers' default; no GGUF key holds it
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CASES = {  # tiny arch, its overrides, stored type of 2-D weights
    "llama-q8_0": ("llama", {}, GGMLQuantizationType.Q8_0),
    "llama-f32": ("llama", {}, GGMLQuantizationType.F32),
    "qwen2-q4_0": ("qwen2", {}, GGMLQuantizationType.Q4_0),
    "qwen2-tied-q8_0": ("qwen2", {"tie_word_embeddings": True}, GGMLQuantizationType.Q8_0),  # no output.weight
    # transformers reads no head_dim from a qwen3 GGUF (its default, 128, is every Qwen3's)
    "qwen3-q8_0": ("qwen3", {"head_dim": 128}, GGMLQuantizationType.Q8_0),
    # what transformers' reader gives a Gemma (its defaults), so that its model of the file is the original's
    "gemma2-q8_0": ("gemma2", {**GEMMA_AS_READ, "attn_logit_softcapping": 50.0}, GGMLQuantizationType.Q8_0),
    "gemma2-f16": ("gemma2", {**GEMMA_AS_READ, "attn_logit_softcapping": 50.0}, GGMLQuantizationType.F16),
    "gemma3-q4_0": ("gemma3", GEMMA_AS_READ, GGMLQuantizationType.Q4_0),
    "phi3-q8_0": ("phi3", {"rope_parameters": DEFAULT_ROPE}, GGMLQuantizationType.Q8_0),  # no LongRoPE
}
NEW_FAMILIES = ("gemma2-q8_0", "gemma3-q4_0", "phi3-q8_0")


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
        if f".{target}." in name and name not in hf:  # Phi-3's are fused in transformers too
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


def _bare_gguf(path: str, arch: str, strings: dict[str, str] | None = None, floats: dict[str, float] | None = None,
               rope_freqs: bool = False, tensors: tuple[str, ...] = (), raw_dtype: GGMLQuantizationType | None = None,
               split_max_tensors: int = 0) -> str:
    """A GGUF file of metadata only (and a rope_freqs tensor, or ``tensors`` of 8 ones; of one zero block of
    ``raw_dtype``): enough for what is refused before transformers (split in files of ``split_max_tensors``)."""
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(1)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    for key, value in (floats or {}).items():
        writer.add_float32(key, value)
    for name in ("rope_freqs.weight",) * rope_freqs + tensors:
        if raw_dtype is None:
            writer.add_tensor(name, np.ones(8, dtype=np.float32))
        else:
            writer.add_tensor(name, np.zeros((1, GGML_QUANT_SIZES[raw_dtype][1]), np.uint8), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["starcoder2", "gemma", "phi2"])
def test_other_gguf_architectures_are_not_built(tmp_path, arch: str) -> None:
    with pytest.raises(NotBuiltError, match=f"'{arch}' architecture"):
        load_hf_config(_bare_gguf(str(tmp_path / f"{arch}.gguf"), arch))


@pytest.mark.parametrize("arch, strings, floats, rope_freqs, message", [
    ("llama", {"llama.rope.scaling.type": "yarn"}, {"llama.rope.scaling.factor": 4.0}, False, "type 'yarn'"),
    ("qwen2", {"qwen2.rope.scaling.type": "longrope"}, {}, False, "type 'longrope'"),
    ("llama", {"llama.rope.scaling.type": "linear"}, {"llama.rope.scaling.attn_factor": 2.0}, False,
     "keys llama.rope.scaling.attn_factor"),
    ("qwen2", {}, {}, True, "rope_freqs.weight in a 'qwen2' file"),
    ("llama", {}, {"llama.rope.scaling.factor": 2.0}, True, "together with a linear"),
], ids=["yarn", "longrope", "attn-factor", "qwen2-rope-freqs", "rope-freqs-and-linear"])
def test_rope_scaling_not_read_is_not_built(tmp_path, arch, strings, floats, rope_freqs, message) -> None:
    with pytest.raises(NotBuiltError, match=message):
        load_hf_config(_bare_gguf(str(tmp_path / "scaled.gguf"), arch, strings, floats, rope_freqs))


# ------------------------------------------------------------------ rope scaling
ROPES = {"llama3": LLAMA3_ROPE, "linear": LINEAR_ROPE}
SEQUENCES = random_prompts(2, seed=5, max_len=60)  # 42 and 51 tokens: past original_max_position_embeddings (32)
VS_ORIGINAL = 1e-4  # |logits - the original checkpoint's| (float32, F32 file)


@pytest.fixture(scope="module")
def scaled(tiny_llama: str, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """kind -> (the original checkpoint with that rope scaling, its F32 GGUF file as llama.cpp writes it)."""
    folder = tmp_path_factory.mktemp("scaled")
    out = {}
    for kind, rope in ROPES.items():
        original = with_rope_parameters(tiny_llama, rope, str(folder / kind))
        out[kind] = original, write_gguf(original, str(folder / f"{kind}.gguf"), qtype=GGMLQuantizationType.F32)
    return out


def _paged_logits(model: torch.nn.Module, hf_config, sequences: list[list[int]]) -> list[torch.Tensor]:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    run = PagedRun(model, sequences)
    run.new_kv_caches(hf_config.num_hidden_layers, hf_config.num_key_value_heads, head_dim, torch.float32)
    return run.run([[20, len(sequences[1])], [len(sequences[0]) - 20, 0]])


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_scaled_file_equals_the_original_checkpoint(scaled, gguf_files, kind: str) -> None:
    """Inverse frequencies (within float32 rounding: llama.cpp divides by 1 / ((1 - s) / factor + s) where
    transformers multiplies by (1 - s) / factor + s) and logits at every position."""
    original, path = scaled[kind]
    hf_config = load_hf_config(path)
    inv_freq, scaling = compute_inv_freq(hf_config, hf_config.head_dim)
    assert scaling == 1.0
    torch.testing.assert_close(inv_freq, _hf_model(original).model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    unscaled, _ = compute_inv_freq(load_hf_config(gguf_files["llama-f32"]), hf_config.head_dim)
    assert int((inv_freq != unscaled).sum()) >= 6  # the scaling is there
    for seq, logits in zip(SEQUENCES, _paged_logits(_load(path, 0, 1), hf_config, SEQUENCES)):
        assert float((logits - hf_logits(original, seq)).abs().max()) < VS_ORIGINAL


def test_without_a_tokenizer_it_is_built_from_the_file(gguf_files, tiny_llama: str) -> None:
    from asyncllm.generation_config import read_generation_config
    from asyncllm.tokenizer import eos_token_ids, load_tokenizer

    ours, original = load_tokenizer(gguf_files["llama-q8_0"]), load_tokenizer(tiny_llama)
    for text in ("def f(x):\n    return x + 1\n", "import os, sys  # 42", "hello world"):
        ids = ours(text).input_ids
        assert ids == original(text).input_ids and ours.decode(ids) == original.decode(ids), text
    assert eos_token_ids(ours, read_generation_config("auto", gguf_files["llama-q8_0"])) == [original.eos_token_id]


def test_rope_freqs_need_the_config_that_carries_them(scaled, gguf_files) -> None:
    """The loader checks the file's rope_freqs against the config's instead of dropping them."""
    path = scaled["llama3"][1]
    factors = load_hf_config(path).rope_freq_factors  # the 3 bands: kept, smoothed, divided by the factor
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and factors[2:] == [8.0] * 6
    model = _load(gguf_files["llama-f32"], 0, 1)
    with pytest.raises(ConfigError, match="rope_freq_factors are the file's rope_freqs.weight"):
        load_gguf_weights(model, path, load_hf_config(gguf_files["llama-f32"]))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_a_mixture_of_experts_file_equals_the_original_checkpoint(arch: str, tmp_path) -> None:
    """Qwen2-MoE / Qwen3-MoE GGUF files (F32): each layer's experts stacked in one tensor (``ffn_gate_exps``, ...)
    are split back by expert; the expert sizes and Qwen3-MoE's renormalized top-k, which transformers' GGUF config
    reader drops, are read from the file as llama.cpp reads them; the logits equal transformers' of the original
    checkpoint at every position."""
    from asyncllm.tiny import tiny_checkpoint

    original = tiny_checkpoint(arch)
    path = write_gguf(original, str(tmp_path / f"tiny-{arch}.gguf"), arch.replace("_", ""), GGMLQuantizationType.F32)
    hf_config = load_hf_config(path)
    assert (hf_config.moe_intermediate_size, hf_config.norm_topk_prob) == (32, arch == "qwen3_moe")
    model = _load(path, 0, 1)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches(hf_config.num_hidden_layers, hf_config.num_key_value_heads, head_dim, torch.float32)
    logits = run.run([[20, len(SEQUENCES[1])], [len(SEQUENCES[0]) - 20, 0]])
    for seq, got in zip(SEQUENCES, logits):
        torch.testing.assert_close(got, hf_logits(original, seq), atol=1e-4, rtol=0)


# ------------------------------------------------------------------ Gemma 2, Gemma 3 (text), Phi-3
@pytest.mark.parametrize("case", NEW_FAMILIES)
def test_gemma_and_phi3_logits_equal_transformers_from_the_same_file(gguf_files, case: str) -> None:
    """Quantized files (Q8_0, Q4_0): the logits at every position equal transformers' model of the same file (both
    dequantize with gguf; a Gemma file's norms lose llama.cpp's +1, Phi-3's fused qkv / gate_up load as fused)."""
    path = gguf_files[case]
    hf_config = load_hf_config(path)
    for seq, got in zip(SEQUENCES, _paged_logits(_load(path, 0, 1), hf_config, SEQUENCES)):
        want = hf_logits(path, seq)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


DROPPED = {  # case -> (tiny arch, overrides): keys llama.cpp writes and reads, transformers' GGUF reader drops
    "gemma2-softcapping": ("gemma2", GEMMA_AS_READ),  # attn_logit_softcapping 5.0 (transformers: 50.0)
    "gemma3-global-rope": ("gemma3", {**GEMMA_AS_READ, "num_layers": 6,  # llama.cpp's pattern: layer 5 is global
                                      "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "phi3-partial-rotary-window": ("phi3", {"rope_parameters": {**DEFAULT_ROPE, "partial_rotary_factor": 0.75},
                                            "sliding_window": 8}),
}


@pytest.mark.parametrize("case", list(DROPPED))
def test_keys_transformers_drops_are_read_as_llama_cpp_reads_them(case: str, tmp_path) -> None:
    """F32 files of checkpoints with Gemma 2's softcapping, Gemma 3's linear rope on its global layers (factor 8)
    and Phi-3's partial rotary and sliding window: the logits equal the ORIGINAL checkpoint's, where transformers'
    own model of the file (which drops those keys) differs."""
    from asyncllm.tiny import tiny_checkpoint

    arch, overrides = DROPPED[case]
    original = tiny_checkpoint(arch, **overrides)
    path = write_gguf(original, str(tmp_path / f"{case}.gguf"), arch, GGMLQuantizationType.F32)
    for seq, got in zip(SEQUENCES, _paged_logits(_load(path, 0, 1), load_hf_config(path), SEQUENCES)):
        torch.testing.assert_close(got, hf_logits(original, seq), atol=1e-4, rtol=0)
    assert float((hf_logits(path, SEQUENCES[0]) - hf_logits(original, SEQUENCES[0])).abs().max()) > 1e-2


def test_gemma3_scales_the_global_layers_rope_only(tmp_path) -> None:
    from asyncllm.tiny import tiny_checkpoint

    path = write_gguf(tiny_checkpoint("gemma3"), str(tmp_path / "gemma3.gguf"), "gemma3", GGMLQuantizationType.F32)
    rope = load_hf_config(path).rope_parameters
    assert rope["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}


def _gemma_header(path: str, arch: str, layers: int, hidden: int, heads: int) -> str:
    """A Gemma GGUF file of metadata only, enough for transformers' config reader."""
    writer = GGUFWriter(path, arch)
    for add, value in ((writer.add_block_count, layers), (writer.add_embedding_length, hidden),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, heads // 2),
                       (writer.add_key_length, 128), (writer.add_value_length, 128),
                       (writer.add_feed_forward_length, 4 * hidden), (writer.add_vocab_size, 512)):
        add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch, layers, hidden, heads, scalar", [
    ("gemma2", 46, 4608, 32, 144), ("gemma3", 62, 5376, 32, 168),  # the 27B models: hidden / heads
    ("gemma2", 42, 3584, 16, 256), ("gemma3", 48, 3840, 16, 256),  # 9B, 12B: transformers' default
])
def test_a_27b_gemma_scales_queries_as_llama_cpp(tmp_path, arch, layers, hidden, heads, scalar) -> None:
    path = _gemma_header(str(tmp_path / f"{arch}.gguf"), arch, layers, hidden, heads)
    assert load_hf_config(path).query_pre_attn_scalar == scalar


def test_longrope_is_not_built(tmp_path) -> None:
    path = _bare_gguf(str(tmp_path / "phi3.gguf"), "phi3", tensors=("rope_factors_long.weight",
                                                                  "rope_factors_short.weight"))
    with pytest.raises(NotBuiltError, match="LongRoPE scaling \\(rope_factors_long.weight, rope_factors_short"):
        load_hf_config(path)


@pytest.mark.parametrize("qtype", ["Q8_1", "Q8_K", "I8"])
def test_a_tensor_type_gguf_cannot_dequantize_is_refused_on_the_host(tmp_path, qtype: str) -> None:
    path = _bare_gguf(str(tmp_path / f"u.{qtype}.gguf"), "llama", tensors=("token_embd.weight", "output.weight"),
                      raw_dtype=GGMLQuantizationType[qtype])
    with pytest.raises(NotBuiltError, match=f"dequantizing GGUF {qtype} tensors \\(token_embd.weight: ") as info:
        load_hf_config(path)
    assert info.value.field == "model" and info.value.value == path


def test_a_split_file_is_refused_naming_the_merge_and_a_file_without_architecture_says_so(tmp_path) -> None:
    _bare_gguf(str(tmp_path / "split.gguf"), "llama", tensors=("token_embd.weight", "output.weight"),
               split_max_tensors=1)
    parts = sorted(str(path) for path in tmp_path.glob("split-*.gguf"))
    for number, part in enumerate(parts, 1):
        with pytest.raises(ConfigError, match=f"part {number} of 2 of a split GGUF: .*llama-gguf-split --merge"):
            load_hf_config(part)
    writer = GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    del writer.kv_data[0]["general.architecture"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="a GGUF file with a general.architecture"):
        load_hf_config(str(tmp_path / "bare.gguf"))


def test_a_truncated_or_header_only_file_is_a_config_error(tmp_path) -> None:
    _bare_gguf(str(tmp_path / "whole.gguf"), "llama")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "whole.gguf").read_bytes()[:24])
    writer = GGUFWriter(str(tmp_path / "header.gguf"), "llama")
    writer.write_header_to_file()
    writer.close()
    for name in ("cut.gguf", "header.gguf"):
        with pytest.raises(ConfigError, match="a GGUF file gguf can read \\(IndexError"):
            load_hf_config(str(tmp_path / name))


def test_rope_scaling_type_none_is_served_unscaled(tiny_llama: str, tmp_path, monkeypatch) -> None:
    def none_with_a_factor(writer: GGUFWriter, cfg: dict) -> None:
        writer.add_rope_scaling_type(RopeScalingType.NONE)
        writer.add_rope_scaling_factor(4.0)

    monkeypatch.setattr(gguf_reference, "_rope_scaling_metadata", none_with_a_factor)
    path = write_gguf(tiny_llama, str(tmp_path / "none.gguf"), "llama", GGMLQuantizationType.F32)
    rope = load_hf_config(path).rope_parameters
    assert rope.get("rope_type", "default") == "default" and "factor" not in rope  # llama.cpp: never scaled
