"""MEAN and CLS pooling (``pooler_config``, or the checkpoint's sentence-transformers config): embeddings equal
transformers' hidden states mean- or first-token-pooled, under chunked prefill, beside generations, and for a
prompt whose blocks are cached (MEAN/CLS requests take no prefix-cache hits); bad configs refused by name."""

from __future__ import annotations

import asyncio
import functools
import json
import os

import pytest

from asyncllm import AsyncEngine, PoolingParams, SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.engine.pooling_model import sentence_transformers_pooling
from asyncllm.errors import ConfigError, NotBuiltError
from engine_helpers import random_prompts

TOLERANCE = 1e-5


@functools.lru_cache(maxsize=None)
def _hf_base(path: str):
    import torch
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def _reference(path: str, prompt: list[int], pooling: str, normalize: bool = True) -> list[float]:
    """transformers' last hidden states of the prompt, mean-pooled (MEAN) or the first token's (CLS)."""
    import torch

    with torch.no_grad():
        states = _hf_base(path)(torch.tensor([prompt])).last_hidden_state[0]
    hidden = states.mean(dim=0) if pooling == "MEAN" else states[0]
    return (torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden).tolist()


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < TOLERANCE


def _with_st_pooling(source: str, folder: str, **modes: bool) -> str:
    """``source``'s files linked into ``folder`` plus a sentence-transformers ``modules.json`` and pooling config."""
    os.makedirs(os.path.join(folder, "1_Pooling"))
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), os.path.join(folder, name))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, **modes}
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(config, f)
    return folder


async def test_mean_pooling_from_the_sentence_transformers_config(tiny_llama: str, tmp_path) -> None:
    path = _with_st_pooling(tiny_llama, str(tmp_path / "st"), pooling_mode_mean_tokens=True)
    assert sentence_transformers_pooling(path) == "MEAN"
    prompts = random_prompts(4, seed=5, stem_len=40, max_len=70)  # every other one shares a 40-token stem
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    async with AsyncEngine(path, tensor_parallel_size=2, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        embedded, _ = await asyncio.gather(asyncio.gather(*(engine.embed(p) for p in prompts)),
                                           asyncio.gather(*(engine.generate(p, greedy) for p in prompts)))
        again = await engine.embed(prompts[3])  # its blocks are cached: a LAST request would hit them
        raw = await engine.embed(prompts[1], PoolingParams(normalize=False))
    for prompt, out in zip(prompts, embedded):
        assert _close(out.embedding, _reference(path, prompt, "MEAN"))
    assert again.num_cached_tokens == 0 and _close(again.embedding, _reference(path, prompts[3], "MEAN"))
    assert _close(raw.embedding, _reference(path, prompts[1], "MEAN", normalize=False))


async def test_cls_pooling_from_pooler_config_overrides_the_checkpoint(tiny_llama: str, tmp_path) -> None:
    path = _with_st_pooling(tiny_llama, str(tmp_path / "st"), pooling_mode_mean_tokens=True)
    prompts = random_prompts(3, seed=8, stem_len=20, max_len=40)
    async with AsyncEngine(path, pooler_config={"pooling_type": "CLS", "normalize": False},
                           max_num_batched_tokens=16, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.embed(p) for p in prompts))
        unit = await engine.embed(prompts[0], PoolingParams(normalize=True))
    for prompt, out in zip(prompts, outs):
        assert _close(out.embedding, _reference(path, prompt, "CLS", normalize=False))
    assert _close(unit.embedding, _reference(path, prompts[0], "CLS"))


@pytest.mark.parametrize("pooler_config, error, match", [
    ({"pooling_type": "max"}, ConfigError, "pooling_type one of LAST, MEAN, CLS"),
    ({"pooling_type": "STEP"}, NotBuiltError, "STEP pooling"),
    ({"pooling_type": "ALL"}, NotBuiltError, "ALL pooling"),
    ({"normalise": True}, ConfigError, "'normalise' is not one"),
    ({"step_tag_id": 3}, NotBuiltError, "step_tag_id"),
    ({"normalize": "yes"}, ConfigError, "normalize True or False"),
    ("MEAN", ConfigError, "a dict of PoolerConfig fields"),
])
def test_bad_pooler_configs_are_refused(pooler_config, error, match) -> None:
    with pytest.raises(error, match=match) as info:
        EngineConfig.create("some/model", pooler_config=pooler_config)
    assert info.value.field == "pooler_config"


def test_sentence_transformers_modes(tiny_llama: str, tmp_path) -> None:
    assert sentence_transformers_pooling(tiny_llama) is None  # no modules.json: LAST
    cls = _with_st_pooling(tiny_llama, str(tmp_path / "cls"), pooling_mode_cls_token=True)
    assert sentence_transformers_pooling(cls) == "CLS"
    last = _with_st_pooling(tiny_llama, str(tmp_path / "last"), pooling_mode_lasttoken=True)
    assert sentence_transformers_pooling(last) == "LAST"
    weird = _with_st_pooling(tiny_llama, str(tmp_path / "max"), pooling_mode_max_tokens=True)
    with pytest.raises(NotBuiltError, match="pooling_mode_max_tokens"):
        sentence_transformers_pooling(weird)
