"""Draft-model speculation's parts: the config keys, the core's proposer, and the runner with a draft in-process
(its KV sizing, and its proposals against transformers' greedy tokens, with exact values)."""

from __future__ import annotations

import functools

import pytest
import torch

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.spec.config import SpeculativeConfig
from asyncllm.spec.draft_model import DraftModelProposer, prepare_draft_model
from asyncllm.workers.model_runner import ModelRunner
from hf_reference import hf_greedy

K = 3
GREEDY = SamplingParams(temperature=0.0)


# ------------------------------------------------------------------ config
def test_a_model_key_means_a_draft_model_and_vllm_s_keys_are_read():
    spec = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 4})
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.uses_draft_model) == \
        ("draft_model", "some/draft", 4, True)
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
                                        "draft_tensor_parallel_size": 1, "max_model_len": 64, "revision": "main",
                                        "quantization": "fp8"})
    assert (spec.draft_tensor_parallel_size, spec.max_model_len, spec.revision, spec.quantization) == \
        (1, 64, "main", "fp8")
    assert not SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).uses_draft_model


@pytest.mark.parametrize("value, error, words", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, ConfigError, "'model'"),
    ({"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, ConfigError, "unknown: prompt_lookup_max"),
    ({"model": "d", "num_speculative_tokens": 3, "disable_by_batch_size": 4}, ConfigError,
     "unknown: disable_by_batch_size"),
    ({"model": "d"}, ConfigError, "num_speculative_tokens"),
    ({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 0}, ConfigError,
     "draft_tensor_parallel_size"),
    ({"model": "d", "num_speculative_tokens": 3, "quantization": 8}, ConfigError, "quantization"),
    ({"model": "d", "num_speculative_tokens": 3, "quantization": "awq"}, NotBuiltError, "quantization='awq'"),
    ({"method": "medusa", "model": "d", "num_speculative_tokens": 3}, NotBuiltError, "method='medusa'"),
])
def test_a_bad_draft_model_config_is_refused_by_name(value, error, words):
    with pytest.raises(error, match="speculative_config") as info:
        EngineConfig.create("m", speculative_config=value)
    assert type(info.value) is error and words in str(info.value)


def test_a_yarn_draft_drafts_to_its_scaled_length(tmp_path):
    from transformers import LlamaConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 64}
    draft = LlamaConfig(max_position_embeddings=64, rope_parameters=yarn, architectures=["LlamaForCausalLM"])
    draft.save_pretrained(tmp_path)  # the config is all the host reads of a draft
    spec_dict = {"model": str(tmp_path), "num_speculative_tokens": 2}
    spec = SpeculativeConfig.from_dict(spec_dict)
    assert prepare_draft_model(spec_dict, spec, draft, 1, 256, False)["max_model_len"] == 256  # 64 x 4
    with pytest.raises(ConfigError, match=r"max_model_len at most .* rope scaling factor: 256"):
        prepare_draft_model({**spec_dict, "max_model_len": 257}, SpeculativeConfig.from_dict(
            {**spec_dict, "max_model_len": 257}), draft, 1, 512, False)


def test_the_core_takes_the_last_step_s_drafts_within_its_room():
    proposer = DraftModelProposer()
    proposer.update({"a": [5, 6, 7], "b": [8, 9, 10]})
    assert proposer.take("a", 2) == [5, 6]
    assert proposer.take("a", 2) == []  # taken once
    assert proposer.take("b", 0) == []
    proposer.update({"c": [1]})  # a new step's drafts replace the last step's
    assert proposer.take("b", 3) == [] and proposer.take("c", 3) == [1]


# ------------------------------------------------------------------ the runner with a draft
@functools.lru_cache(maxsize=None)
def _runner(path: str) -> ModelRunner:
    config = EngineConfig.create(path, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                                 speculative_config={"model": path, "num_speculative_tokens": K})
    runner = ModelRunner(config, 0, 1, torch.device("cpu"))
    runner.load_model()
    return runner


def test_a_block_costs_the_draft_s_bytes_too(tiny_llama, monkeypatch):
    runner = _runner(tiny_llama)
    assert runner.drafter is not None
    target = runner.kv_spec.bytes_per_block(runner.block_size, runner.kv_cache_dtype)  # type: ignore[union-attr]
    assert runner.drafter.bytes_per_block == target  # the same checkpoint
    assert runner.bytes_per_block == 2 * target
    assert runner.drafter.num_scratch_blocks == 4 * 1  # max_num_seqs x ceil(K / block_size)
    monkeypatch.setenv(envs.CPU_KVCACHE_SPACE_GB.name, "0.001")
    budget = int(0.001 * 2**30)
    assert runner.determine_num_available_blocks() == (budget - 4 * target) // (2 * target)


def _step(step_id: int, req_id: str, new: NewRequestData | None, computed: int, num: int,
          new_blocks: list[int], drafts: list[int]) -> SchedulerOutput:
    cached = CachedRequestData() if new else CachedRequestData([req_id], [computed], {req_id: new_blocks})
    return SchedulerOutput(step_id, [new] if new else [], cached, {req_id: num}, num,
                           spec_token_ids={req_id: drafts} if drafts else {})


def test_the_draft_proposes_the_target_s_greedy_tokens_past_its_blocks(tiny_llama):
    """Draft = target: the drafts are the target's next greedy tokens, and all are accepted. The prompt fills
    one block exactly, so the proposals' KV goes to scratch blocks."""
    runner = _runner(tiny_llama)
    runner.init_cache(8)
    prompt = list(range(40, 56))  # 16 tokens: one block
    want = hf_greedy(tiny_llama, prompt, 3 + 2 * K)
    new = NewRequestData("r", prompt, len(prompt), GREEDY, [3], 0)
    out = runner.execute_model(_step(0, "r", new, 0, 16, [], []))
    assert out.sampled_token_ids == [want[:1]]
    assert out.draft_token_ids == {"r": want[1 : 1 + K]}
    drafts = out.draft_token_ids["r"]
    out = runner.execute_model(_step(1, "r", None, 16, 1 + K, [6], drafts))
    assert out.sampled_token_ids == [want[1 : 2 + K]]  # every draft accepted, then the target's token
    assert out.draft_token_ids == {"r": want[2 + K : 2 + 2 * K]}
    wrong = [0] * K  # rejected at once: the target's own token instead, and drafts from there
    out = runner.execute_model(_step(2, "r", None, 17 + K, 1 + K, [], wrong))
    assert out.sampled_token_ids == [want[2 + K : 3 + K]]
    assert out.draft_token_ids == {"r": want[3 + K : 3 + 2 * K]}


@pytest.mark.parametrize("spec_dict, tp, multimodal, words", [
    ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, 4, False,
     "draft_tensor_parallel_size=2 other than 1 or the target's tensor_parallel_size=4"),
    ({"method": "eagle", "model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, 2, False,
     "draft_tensor_parallel_size=1 for an eagle head"),
    ({"model": "d", "num_speculative_tokens": 2}, 1, True, "multimodal target"),
])
def test_what_is_not_built_is_refused_before_the_draft_is_read(spec_dict, tp, multimodal, words):
    spec = SpeculativeConfig.from_dict(spec_dict)
    with pytest.raises(NotBuiltError, match="speculative_config") as info:
        prepare_draft_model(spec_dict, spec, object(), tp, 128, multimodal)
    assert words in str(info.value)
