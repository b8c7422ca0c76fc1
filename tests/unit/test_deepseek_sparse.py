"""DeepSeek-V3.2 and GLM-5 (asyncllm/models/deepseek_sparse.py) against transformers: float32 logits within 1e-4
at every position over a paged cache, with the tiny models' ``index_topk`` of 6 far below the prompts (chunked
prefills crossing it, decodes beside them, a first step dense); the sparse choice mattering (every key instead, the
worst keys instead, GLM-5's indexer rope half-split); the caches' shapes; what is refused."""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models import deepseek_sparse
from asyncllm.models.deepseek_sparse import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [40, 23, 9]
SCHEDULE = [[4, 3, 5], [13, 6, 0], [15, 9, 4], [5, 5, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]
"""The first step's contexts fit in 6 keys (the backend's dense step); the next ones cross it, by chunks and by
decodes beside them."""


def _model(arch: str) -> torch.nn.Module:
    path = tiny_checkpoint(arch)
    return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("arch", "cls"), [("deepseek_v32", DeepseekV32ForCausalLM),
                                           ("glm_moe_dsa", GlmMoeDsaForCausalLM)])
def test_logits_match_transformers(arch: str, cls: type) -> None:
    """GLM-5 (glm_moe_dsa): its second layer reuses the first's choice (``indexer_types`` "shared")."""
    model = _model(arch)
    assert type(model) is cls and model.model.layers[0].self_attn.indexer.topk == 6
    assert (model.model.layers[1].self_attn.indexer is None) == (arch == "glm_moe_dsa")
    assert_paged_logits_match_checkpoint(model, tiny_checkpoint(arch), SEQ_LENS, SCHEDULE, seed=len(arch))


@pytest.mark.parametrize("change", ["every key", "worst keys", "indexer rope"])
def test_the_sparse_choice_matters(change: str, monkeypatch) -> None:
    """Attending to every causal key (an ``index_topk`` past the prompts), to the lowest-scored keys, or rotating
    GLM-5's indexer pairs half-split breaks the match (so the test above checks the choice)."""
    arch = "glm_moe_dsa" if change == "indexer rope" else "deepseek_v32"
    model = _model(arch)
    indexers = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    for indexer in indexers:
        if change == "every key":
            indexer.topk = 10**6
        elif change == "indexer rope":
            indexer.interleaved = False
    if change == "worst keys":  # the per-head weights negated: the lowest scores lead
        choose = deepseek_sparse.LightningIndexer._choose
        monkeypatch.setattr(deepseek_sparse.LightningIndexer, "_choose",
                            lambda self, query, weights, *rest: choose(self, query, -weights, *rest))
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(model, tiny_checkpoint(arch), SEQ_LENS, SCHEDULE, seed=len(arch))


def test_each_layer_caches_its_latent_and_its_indexer_keys() -> None:
    """DeepSeek-V3.2's shapes: per layer a 576-wide latent row and a 128-wide indexer key a token, one head each
    on any number of ranks, one-part; GLM-5's "shared" layers keep no indexer cache."""
    import transformers

    v32 = transformers.DeepseekV32Config(architectures=["DeepseekV32ForCausalLM"])
    for tp in (1, 8):
        spec = kv_cache_spec(v32, tp)
        assert (spec.kv_parts, spec.num_layers) == (1, 122)
        assert spec.shapes()[:4] == [(1, 576), (1, 128), (1, 576), (1, 128)]
    assert spec.bytes_per_block(16, torch.bfloat16) == 61 * 16 * (576 + 128) * 2
    glm = kv_cache_spec(load_hf_config(tiny_checkpoint("glm_moe_dsa")), 1)
    assert glm.shapes() == [(1, 8 + 32), (1, 16), (1, 8 + 32)]


def test_refused_settings() -> None:
    path = tiny_checkpoint("glm_moe_dsa")
    hf_config = load_hf_config(path)
    hf_config.indexer_types = ["shared", "full"]
    with pytest.raises(ConfigError, match="indexer_types"):
        load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)


def test_an_adapter_of_the_indexer_is_refused_by_name(tmp_path):
    """The indexer's projections take no adapters: an adapter naming ``wq_b`` is refused, naming the tensor."""
    from lora_utils import make_adapter

    from asyncllm import LoRARequest
    from asyncllm.errors import InvalidRequestError
    from asyncllm.lora import AdapterChecker
    from asyncllm.models.checkpoint import load_hf_config
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("deepseek_v32")
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=1, rank=4, alpha=8, targets=["wq_b", "q_a_proj"])
    with pytest.raises(InvalidRequestError, match=r"indexer\.wq_b"):
        AdapterChecker(load_hf_config(path), 16).check(LoRARequest("a", 1, adapter))
