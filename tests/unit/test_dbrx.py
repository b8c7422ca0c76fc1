"""DBRX (asyncllm/models/dbrx.py) against transformers' forward over a paged KV cache, alone and over two
tensor-parallel ranks.

The tiny DBRX (asyncllm.tiny "dbrx") clamps q, k and v at 1.0 (most of them bind), routes each token to 2 of 6
experts weighted by their 2-norm, and keeps transformers' checkpoint layout (the fused ``Wqkv``, the experts as
three ``[E * I, H]`` matrices). Requests run as chunked prefills mixed with decodes, and every position's float32
logits must match transformers' within 1e-4; each special feature is switched off once to show the match needs it.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from hf_reference import hf_logits
from model_utils import PagedRun, free_port, spawn_ranks, tp_worker

from asyncllm.config import EngineConfig
from asyncllm.models.dbrx import DbrxForCausalLM, llama_view
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

ATOL = 1e-4
SEQ_LENS = [12, 20, 11]
SCHEDULE = [[5, 9, 0], [4, 9, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]
"""Prefill chunks beside decodes, then decode-only steps."""
_EXPERTS = dict(ffn_hidden_size=32, moe_num_experts=6, moe_top_k=2)
VARIANTS = {
    "tiny": {},
    # the releases' routing (the 1-norm: the sum), their clamp at 8 (it binds nowhere here), one KV head
    "released_routing": dict(ffn_config=dict(_EXPERTS, moe_normalize_expert_weights=1.0),
                             attn_config=dict(kv_n_heads=1, clip_qkv=8.0, rope_theta=500_000.0)),
    # no normalisation, a KV head per head (transformers 5 cannot run without a clip_qkv: its clamp takes two Nones)
    "unnormalised": dict(ffn_config=dict(_EXPERTS, moe_normalize_expert_weights=None),
                         attn_config=dict(kv_n_heads=4, clip_qkv=2.0, rope_theta=500_000.0)),
}


def _sequences(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 512, (n,), generator=gen).tolist() for n in SEQ_LENS]


def _load(path: str) -> tuple[DbrxForCausalLM, object]:
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert type(model) is DbrxForCausalLM
    return model, hf_config


def _paged_logits(model: DbrxForCausalLM, hf_config: object, sequences: list[list[int]]) -> list[torch.Tensor]:
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    return run.run(SCHEDULE)


def _max_error(path: str, sequences: list[list[int]], all_logits: list[torch.Tensor]) -> float:
    return max((logits - hf_logits(path, tokens)).abs().max().item()
               for tokens, logits in zip(sequences, all_logits, strict=True))


def _assert_match_transformers(path: str, sequences: list[list[int]], all_logits: list[torch.Tensor]) -> None:
    for tokens, logits in zip(sequences, all_logits, strict=True):
        expected = hf_logits(path, tokens)
        assert expected.std() > 0.5  # far from uniform: matching means something
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant: str) -> None:
    path = tiny_checkpoint("dbrx", **VARIANTS[variant])
    model, hf_config = _load(path)
    sequences = _sequences(len(variant))
    _assert_match_transformers(path, sequences, _paged_logits(model, hf_config, sequences))


def test_checkpoint_is_transformers_fused_layout() -> None:
    """The tiny checkpoint holds what transformers saves (``Wqkv``, the experts fused per layer) and every tensor
    of it is read."""
    from safetensors import safe_open

    path = tiny_checkpoint("dbrx")
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight"] == (64 + 2 * 2 * 16, 64)
    assert shapes["transformer.blocks.0.ffn.experts.mlp.w2"] == (6 * 32, 64)
    assert shapes["transformer.blocks.0.ffn.router.layer.weight"] == (6, 64)
    model, _ = _load(path)
    assert model.model.layers[0].mlp.experts.w13_weight.shape == (6, 64, 64)
    assert model.model.layers[0].mlp.experts.w2_weight.shape == (6, 64, 32)


@pytest.mark.parametrize("feature", ["clip_qkv", "expert_weight_norm", "norm_weights"])
def test_each_feature_is_needed_to_match(feature: str) -> None:
    """Without the clamp, with the sum instead of the 2-norm, or with unit LayerNorm weights, the logits differ
    from transformers' by far more than the tolerance."""
    path = tiny_checkpoint("dbrx")
    model, hf_config = _load(path)
    for layer in model.model.layers:
        if feature == "clip_qkv":
            layer.self_attn.clip = None
        elif feature == "expert_weight_norm":
            layer.mlp.norm_p = 1.0
        else:
            layer.input_layernorm.weight.data.fill_(1.0)
    sequences = _sequences(1)
    assert _max_error(path, sequences, _paged_logits(model, hf_config, sequences)) > 100 * ATOL


def test_rope_base_is_read_from_attn_config() -> None:
    """The releases' config.json gives ``rope_theta`` in ``attn_config`` only (transformers 5 reads the top-level
    ``rope_parameters``, its default 10000): the attention's base wins, as vLLM reads it."""
    import transformers

    config = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=2, attn_config=dict(kv_n_heads=2,
                                     clip_qkv=8.0, rope_theta=500_000.0))
    assert config.rope_parameters["rope_theta"] == 10_000.0
    view = llama_view(config)
    assert view.rope_parameters == {"rope_type": "default", "rope_theta": 500_000.0}
    assert (view.num_key_value_heads, view.clip_qkv, view.hidden_act) == (2, 8.0, "silu")
    assert config.attn_config.clip_qkv == 8.0 and not hasattr(config, "clip_qkv")  # the host's config untouched


def test_an_expert_activation_other_than_silu_is_refused() -> None:
    from asyncllm.errors import NotBuiltError

    path = tiny_checkpoint("dbrx")
    hf_config = load_hf_config(path)
    hf_config.ffn_config.ffn_act_fn = {"name": "gelu"}
    with pytest.raises(NotBuiltError, match="gelu"):
        load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)


@pytest.mark.slow
def test_tp2_logits_match_transformers(tmp_path) -> None:
    """Two gloo ranks: each holds half the heads (the fused ``Wqkv`` cut, then each rank's rows; with one KV head
    both hold it) and half of every expert's intermediate rows; every rank's logits equal transformers'."""
    paths = [tiny_checkpoint("dbrx"), tiny_checkpoint("dbrx", **VARIANTS["released_routing"])]
    sequences = _sequences(2)
    spawn_ranks(tp_worker, (2, free_port(), paths, str(tmp_path), sequences, SCHEDULE))
    for index, path in enumerate(paths):
        for rank in range(2):
            _assert_match_transformers(path, sequences, torch.load(tmp_path / f"rank{rank}_{index}.pt"))


def test_a_config_transformers_refuses_is_a_config_error(tmp_path) -> None:
    """transformers' strict DBRX config refuses an int where it types a float: a `ConfigError` naming the folder."""
    import json

    from asyncllm.errors import ConfigError

    config = json.loads((pathlib.Path(tiny_checkpoint("dbrx")) / "config.json").read_text())
    config["ffn_config"]["moe_normalize_expert_weights"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="moe_normalize_expert_weights"):
        load_hf_config(str(tmp_path))
