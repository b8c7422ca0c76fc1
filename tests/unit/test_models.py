"""The in-house models against transformers' forward, over a paged KV cache.

Each family's tiny random float32 checkpoint is loaded with `load_model`; three
requests of different lengths run either as one flattened prefill step or as
chunked prefills mixed with decodes (blocks of 4 tokens handed out shuffled),
and every position's logits must match HF's unbatched forward within 1e-4 with
the same argmax.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import FAMILIES, PagedRun, hf_logits, save_tiny_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.qwen2 import Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.registry import kv_cache_spec

ATOL = 1e-4  # float32, same op order as HF: observed differences are ~1e-5
SEQ_LENS = [8, 14, 20]
ONE_STEP_PREFILL = [[5, 11, 17], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
CHUNKED = [[3, 6, 0], [2, 5, 9], [1, 1, 8], [1, 1, 1], [1, 1, 1], [0, 0, 1]]

EXPECTED_CLASS = {
    "llama": LlamaForCausalLM,
    "llama_bias": LlamaForCausalLM,
    "llama3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_checkpoint(path, request.param, seed=len(request.param))
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path)), hf_config, torch.device("cpu"), torch.float32)
    return request.param, hf_model, hf_config, model


def _sequences(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 101, (n,), generator=gen).tolist() for n in SEQ_LENS]


@pytest.mark.parametrize("schedule", [ONE_STEP_PREFILL, CHUNKED], ids=["one_step_prefill", "chunked"])
def test_logits_match_transformers(family_model, schedule):
    family, hf_model, hf_config, model = family_model
    assert type(model) is EXPECTED_CLASS[family]
    spec = kv_cache_spec(hf_config, 1)
    sequences = _sequences(seed=7)
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    for tokens, logits in zip(sequences, run.run(schedule)):
        expected = hf_logits(hf_model, tokens)
        assert expected.std() > 0.5  # logits far from uniform, so the comparison means something
        assert logits.dtype == torch.float32 and logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_greedy_decode_matches_transformers_generate(family_model):
    """Our own argmax fed back step by step gives HF's greedy continuation."""
    _, hf_model, hf_config, model = family_model
    spec = kv_cache_spec(hf_config, 1)
    prompts = [seq[:n] for seq, n in zip(_sequences(seed=3), [4, 9, 6])]
    num_new = 6
    run = PagedRun(model, [p + [0] * num_new for p in prompts], block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    run.step([len(p) for p in prompts])
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(num_new):
        for i, parts in enumerate(run.logits):
            token = int(parts[-1][-1].argmax())
            generated[i].append(token)
            run.sequences[i][run.num_computed[i]] = token  # feed our own sample back
        if len(generated[0]) < num_new:
            run.step([1, 1, 1])
    hf_model.generation_config.eos_token_id = None  # tiny random models emit "eos" by chance
    for prompt, tokens in zip(prompts, generated):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()


def test_family_specific_structure(family_model):
    family, _, hf_config, model = family_model
    params = dict(model.named_parameters())
    layer = "model.layers.0."
    assert (layer + "self_attn.qkv_proj.bias" in params) == (family in ("llama_bias", "qwen2"))
    assert (layer + "self_attn.o_proj.bias" in params) == (family == "llama_bias")
    assert (layer + "mlp.gate_up_proj.bias" in params) == (family == "llama_bias")
    assert (layer + "self_attn.q_norm.weight" in params) == (family == "qwen3")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (family == "qwen2") and ("lm_head.weight" in params) == (not tied)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == ([7, 7] if family == "mistral" else [None, None])
    head_dim = {"mistral": 24, "qwen3": 32}.get(family, 16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * head_dim, 64)
