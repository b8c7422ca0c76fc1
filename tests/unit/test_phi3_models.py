"""Phi-3 (asyncllm/models/phi3.py) against transformers' forward over a paged KV cache, and its fused weights.

The tiny checkpoint (asyncllm.tiny "phi3") is shaped as Phi-4-mini: rotary on 12 of each head's 16 dims and
LongRoPE pretrained on 64 positions, its short and long factors far apart. transformers uses the short factors
for a sequence of at most 64 tokens and the long ones for a longer sequence; asyncllm uses the short ones at
every position when max_model_len <= 64 and the long ones otherwise (docs/phi3.md), so each regime is compared
on the sequences transformers treats the same way. Requests run as chunked prefills mixed with decodes, and
every position's float32 logits must match transformers' within 1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint
from safetensors.torch import load_file

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import checkpoint_files, iterate_safetensors, load_hf_config, load_model
from asyncllm.models.phi3 import Phi3ForCausalLM
from asyncllm.tiny import tiny_checkpoint

ATOL = 1e-4
SHORT = ([12, 20, 27], [[5, 9, 0], [4, 9, 16], [1, 1, 9], [1, 1, 1], [1, 0, 1]])
"""Sequences within the 64 pretrained positions (transformers: short factors), chunked, with decodes."""
LONG = ([70, 66, 81], [[33, 40, 16], [36, 25, 32], [1, 1, 32], [0, 0, 1]])
"""Sequences past them (transformers: long factors for the whole sequence)."""
CASES = {  # name: (tiny_checkpoint overrides, max_model_len, sequences)
    "short_factors": ({}, 64, SHORT),
    "long_factors": ({}, None, LONG),  # max_model_len: max_position_embeddings, 2048
    "sliding_window": ({"sliding_window": 8}, 64, SHORT),  # as some Phi-3-mini-4k configs (2047)
}


def _load(path: str, max_model_len: int | None = None) -> Phi3ForCausalLM:
    config = EngineConfig.create(path, max_model_len=max_model_len)
    return load_model(config, load_hf_config(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str) -> None:
    overrides, max_model_len, (seq_lens, schedule) = CASES[case]
    path = tiny_checkpoint("phi3", **overrides)
    model = _load(path, max_model_len)
    assert type(model) is Phi3ForCausalLM
    assert_paged_logits_match_checkpoint(model, path, seq_lens, schedule, seed=len(case), atol=ATOL)


def test_partial_rotary_and_window_reach_the_layers() -> None:
    model = _load(tiny_checkpoint("phi3", sliding_window=8), 64)
    attn = model.model.layers[0].self_attn
    assert (attn.rotary_emb.head_dim, attn.rotary_emb.rotary_dim) == (16, 12)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, 8]


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_weights_split_per_shard_over_two_ranks(rank: int) -> None:
    """Each TP rank keeps its q heads, its k heads and its v heads of the fused ``qkv_proj`` (and its rows of
    gate and of up), read from the safetensors slices lazily; the checkpoint's names are the ones required."""
    path = tiny_checkpoint("phi3")
    hf_config = load_hf_config(path)
    backend = get_attention_backend("torch_sdpa", torch.device("cpu"), torch.float32)
    model = Phi3ForCausalLM(hf_config, dtype=torch.float32, tp=TensorParallel(rank, 2), attn_backend=backend,
                            max_position=2048)
    files = checkpoint_files(path)
    assert model.load_weights(iterate_safetensors(files)) == model.checkpoint_weight_names()
    full = {k: v for f in files for k, v in load_file(f).items()}
    qkv, gate_up = full["model.layers.1.self_attn.qkv_proj.weight"], full["model.layers.1.mlp.gate_up_proj.weight"]
    q, k, v = qkv.split([64, 32, 32])  # 4 query heads, 2 KV heads, 16 dims: rank r keeps q heads 2r, 2r+1, KV head r
    gate, up = gate_up.split([128, 128])
    layer = model.model.layers[1]
    expected_qkv = torch.cat([q[32 * rank:32 * (rank + 1)], k[16 * rank:16 * (rank + 1)], v[16 * rank:16 * (rank + 1)]])
    assert torch.equal(layer.self_attn.qkv_proj.weight, expected_qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate[64 * rank:64 * (rank + 1)],
                                                                 up[64 * rank:64 * (rank + 1)]]))
    with pytest.raises(ConfigError, match="fused weight of 64 \\+ 32 \\+ 32 rows"):
        model.load_weights([("model.layers.0.self_attn.qkv_proj.weight", qkv[:96])])


def test_prequantized_checkpoint_is_not_built() -> None:
    hf_config = copy.copy(load_hf_config(tiny_checkpoint("phi3")))
    hf_config.quantization_config = {"quant_method": "fp8"}
    backend = get_attention_backend("torch_sdpa", torch.device("cpu"), torch.float32)
    with pytest.raises(NotBuiltError, match="pre-quantized Phi-3"):
        Phi3ForCausalLM(hf_config, dtype=torch.float32, tp=TensorParallel(), attn_backend=backend, max_position=64)


def test_legacy_su_rope_is_longrope_in_every_config() -> None:
    """The engine's default max_model_len (`longrope_original`), the workers' factors (`fix_longrope_factors`) and
    frequencies (`compute_inv_freq`) read the legacy ``su`` as ``longrope`` in any config, as vLLM's
    ``patch_rope_parameters`` renames it: Phi-3's config (which transformers renames too) and a remote-code one
    (phi3_v's) alike."""
    from transformers import Phi3Config, PretrainedConfig

    from asyncllm.models.rope_config import longrope_original
    from asyncllm.models.rotary import compute_inv_freq, fix_longrope_factors, rope_parameters

    su = {"type": "su", "original_max_position_embeddings": 64, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 256}
    phi3 = Phi3Config.from_dict({**sizes, "num_key_value_heads": 4, "original_max_position_embeddings": 64,
                                 "rope_scaling": dict(su)})  # top-level as in Phi-3's config.json (5.25 prefers it)
    remote = PretrainedConfig.from_dict({**sizes, "rope_scaling": dict(su), "rope_theta": 1e4})
    assert remote.rope_parameters["rope_type"] == "su"  # what transformers leaves a config it does not know
    for config in (phi3, remote):
        assert longrope_original(config) == 64 and rope_parameters(config)["rope_type"] == "longrope"
        fixed = fix_longrope_factors(config, 64)
        assert fixed is not config and fixed.rope_parameters["long_factor"] == [1.0] * 8
        assert compute_inv_freq(fixed, 16)[0].shape == (8,)
    linear = PretrainedConfig.from_dict({**sizes, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert longrope_original(linear) is None
