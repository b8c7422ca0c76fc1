"""Reward models (vLLM's ``convert="reward"``, its ``as_reward_model``): a causal LM's every prompt token's final
hidden state, through vLLM's token_classify activation (softmax over each row; ``use_activation=False``: the raw
rows), gathered across chunked-prefill chunks; STEP pooling's rows (``step_tag_id``) and columns
(``returned_token_ids``) from ``pooler_config`` or the request; /pooling's per-token data; everything else the
model does not serve, and the fields not built, refused by name. References: transformers' hidden states of the
tiny Llama (built with transformers and saved with ``save_pretrained``)."""

from __future__ import annotations

import asyncio
import re
import warnings

import pytest
import torch

from asyncllm import AsyncEngine, ConfigError, EngineConfig, InvalidRequestError, NotBuiltError, PoolingParams
from asyncllm.engine.reward_pooling import RewardPooling
from asyncllm.engine.prepare import prepare
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client
from classifier_utils import tiny_classifier
from hf_reference import hf_last_hidden_states

TOLERANCE = 1e-5
PROMPTS = [[3 + (37 * i) % 490 for i in range(50)], [7 + (53 * i) % 480 for i in range(33)], [11, 12, 13]]
STEP = 5  # the step tag of the STEP tests: in the prompts below at 3 positions
STEP_PROMPT = [9, 8, STEP, 20, 21, 22, STEP, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, STEP, 50]


def _hidden(path: str, prompt: list[int]) -> torch.Tensor:
    return torch.tensor(hf_last_hidden_states(path, prompt), dtype=torch.float32)


def _close(got: list[list[float]], want: torch.Tensor) -> bool:
    got_t = torch.tensor(got, dtype=torch.float32).reshape(want.shape) if got else torch.zeros(want.shape)
    return len(got) == want.shape[0] and (got_t - want).abs().max().item() < TOLERANCE if want.numel() else not got


async def test_reward_rows_equal_transformers_hidden_states_across_chunks(tiny_llama: str) -> None:
    cached = PROMPTS[0][:40]
    async with AsyncEngine(tiny_llama, convert="reward", max_model_len=64, max_num_batched_tokens=16,
                           disable_log_stats=True, max_worker_restarts=0) as engine:
        assert engine.config.runner == "pooling" and engine.config.convert == "reward"
        assert await engine.get_supported_tasks() == ("token_classify",)  # vLLM's as_reward_model pooler
        await engine.encode(cached, pooling_task="token_classify")  # its blocks cached: the next take no hits
        activated = await asyncio.gather(*(engine.encode(p, pooling_task="token_classify") for p in PROMPTS))
        raw = await asyncio.gather(*(engine.reward(p, PoolingParams(use_activation=False)) for p in PROMPTS))
        refusals = []
        for call in (engine.embed(PROMPTS[2]), engine.generate(PROMPTS[2]), engine.classify(PROMPTS[2]),
                     engine.encode(PROMPTS[2], pooling_task="token_embed"),
                     engine.encode(PROMPTS[2], PoolingParams(step_tag_id=STEP), pooling_task="token_classify"),
                     engine.encode(PROMPTS[2], PoolingParams(dimensions=4), pooling_task="token_classify")):
            with pytest.raises(InvalidRequestError) as info:
                await call
            refusals.append((info.value.field, str(info.value)))
        with pytest.raises(InvalidRequestError, match="embedding generation") as over:
            await engine.encode(list(range(3, 68)), pooling_task="token_classify")
    for prompt, out, plain in zip(PROMPTS, activated, raw):
        hidden = _hidden(tiny_llama, prompt)
        assert out.prompt_token_ids == prompt and out.num_cached_tokens == 0 and out.outputs.data is out.data
        assert _close(plain.data, hidden)  # every prompt token's final hidden state: vLLM's as_reward_model
        assert _close(out.data, torch.softmax(hidden, dim=-1))  # vLLM's token_classify activation (PoolerClassify)
    assert len(PROMPTS[0]) > 16 and len(PROMPTS[1]) > 16  # chunked
    assert [field for field, _ in refusals] == ["model", "prompt", "model", "model", "step_tag_id", "dimensions"]
    assert "serves token_classify only" in refusals[0][1] and "does not support ['step_tag_id']" in refusals[4][1]
    assert (over.value.field, over.value.code) == ("prompt", "context_length_exceeded")


async def test_step_pooling_keeps_the_step_tags_rows_and_the_chosen_columns(tiny_llama: str) -> None:
    columns = [3, 17]
    with pytest.warns(DeprecationWarning, match="task"):  # vLLM's deprecated spelling of convert='reward'
        engine = AsyncEngine(tiny_llama, task="reward", max_model_len=64, max_num_batched_tokens=8,
                             disable_log_stats=True, max_worker_restarts=0,
                             pooler_config={"pooling_type": "STEP", "step_tag_id": STEP,
                                            "returned_token_ids": columns})
        await engine.start()
    async with engine:
        assert (engine.config.runner, engine.config.convert, engine.config.task) == ("pooling", "reward", None)
        tagged = await engine.encode(STEP_PROMPT, pooling_task="token_classify")
        raw = await engine.encode(STEP_PROMPT, PoolingParams(use_activation=False), pooling_task="token_classify")
        retagged = await engine.encode(STEP_PROMPT, PoolingParams(step_tag_id=STEP_PROMPT[0], returned_token_ids=[9]),
                                       pooling_task="token_classify")
        untagged = await engine.encode([9, 8, 7], pooling_task="token_classify")
        with pytest.raises(InvalidRequestError, match="64 columns") as wide:
            await engine.encode(STEP_PROMPT, PoolingParams(returned_token_ids=[64]), pooling_task="token_classify")
        async with asgi_client(create_app(engine, manage_engine=False)) as client:
            pooled = (await client.post("/pooling", json={"input": STEP_PROMPT})).json()
            plain = (await client.post("/pooling", json={"input": STEP_PROMPT, "use_activation": False})).json()
            wrong = await client.post("/pooling", json={"input": STEP_PROMPT, "task": "embed"})
    hidden = _hidden(tiny_llama, STEP_PROMPT)
    rows = hidden[torch.tensor(STEP_PROMPT) == STEP][:, columns]
    assert _close(raw.data, rows) and _close(tagged.data, torch.softmax(rows, dim=-1))
    assert _close(retagged.data, torch.sigmoid(hidden[:1, [9]]))  # one column: vLLM's sigmoid
    assert untagged.data == [] and untagged.prompt_token_ids == [9, 8, 7]
    assert wide.value.field == "returned_token_ids"
    assert _close(pooled["data"][0]["data"], torch.softmax(rows, dim=-1)) and _close(plain["data"][0]["data"], rows)
    assert pooled["usage"]["prompt_tokens"] == len(STEP_PROMPT)
    assert wrong.status_code == 400 and "token_classify" in wrong.json()["error"]["message"]


def test_reward_model_config(tiny_llama: str, tiny_qwen3: str, tmp_path) -> None:
    """What convert='reward' resolves to and which pooler_config fields it takes (the others refused by name)."""
    model = prepare(EngineConfig.create(tiny_llama, convert="reward")).pooling_model
    assert model.reward is not None and (model.reward.pooling_type, model.reward.use_activation) == ("ALL", True)
    assert not model.generates and model.classifier is None
    quiet = prepare(EngineConfig.create(tiny_llama, convert="reward", pooler_config={"use_activation": False}))
    assert quiet.pooling_model.reward.use_activation is False
    with pytest.raises(ConfigError, match="below 64") as wide:
        prepare(EngineConfig.create(tiny_llama, convert="reward",
                                    pooler_config={"pooling_type": "STEP", "returned_token_ids": [64]}))
    assert wide.value.field == "pooler_config"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match="as_reward_model") as own_head:
            prepare(EngineConfig.create(tiny_classifier(tiny_qwen3, str(tmp_path / "cls"), 1), convert="reward"))
    assert own_head.value.field == "convert"


@pytest.mark.parametrize("pooler_config, error, words", [
    ({"pooling_type": "MEAN"}, ConfigError, "ALL or STEP"),
    ({"step_tag_id": 3}, ConfigError, "with pooling_type 'STEP' only"),
    ({"pooling_type": "STEP", "step_tag_id": -1}, ConfigError, "a token id"),
    ({"pooling_type": "STEP", "returned_token_ids": []}, ConfigError, "non-empty list"),
    ({"normalize": True}, ConfigError, "no normalize"),
    ({"use_activation": "yes"}, ConfigError, "use_activation True or False"),
    ({"logit_bias": 1.0}, NotBuiltError, "'logit_bias'"),
])
def test_bad_reward_pooler_configs_are_refused_by_name(pooler_config, error, words) -> None:
    with pytest.raises(error, match=re.escape(words)) as info:
        EngineConfig.create("some/model", convert="reward", pooler_config=pooler_config)
    assert info.value.field == "pooler_config"


@pytest.mark.parametrize("pooler_config, words", [
    ({"pooling_type": "STEP"}, "convert='reward'"), ({"step_tag_id": 3}, "'step_tag_id'"),
    ({"returned_token_ids": [1]}, "'returned_token_ids'"), ({"use_activation": False}, "'use_activation'"),
])
def test_reward_pooler_fields_need_convert_reward(pooler_config, words) -> None:
    with pytest.raises(NotBuiltError, match=re.escape(words)) as info:
        EngineConfig.create("some/model", pooler_config=pooler_config)
    assert info.value.field == "pooler_config"


def test_step_fields_of_a_request() -> None:
    PoolingParams(task="token_classify", step_tag_id=3, returned_token_ids=[1, 2]).validate()
    for params, field in ((PoolingParams(task="token_embed", step_tag_id=3), "step_tag_id"),
                          (PoolingParams(task="token_classify", step_tag_id=-2), "step_tag_id"),
                          (PoolingParams(task="token_classify", returned_token_ids=[]), "returned_token_ids"),
                          (PoolingParams(task="embed", returned_token_ids=[1]), "returned_token_ids")):
        with pytest.raises(InvalidRequestError) as info:
            params.validate()
        assert info.value.field == field


def _qwen2_reward_checkpoint(source: str, folder: str, arch: str, labels: int) -> str:
    """transformers' Qwen2 decoder of `source` with a seeded random reward head as the checkpoints' own code defines
    it (``score = Sequential(Linear(h, h), ReLU, Linear(h, labels))``), saved with ``save_pretrained`` under the
    architecture's name (transformers has no such class: the checkpoints ship it as remote code)."""
    import os
    import shutil

    from torch import nn
    from transformers import Qwen2Model, Qwen2PreTrainedModel

    class _Reward(Qwen2PreTrainedModel):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.model = Qwen2Model(config)
            self.score = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(),
                                       nn.Linear(config.hidden_size, labels))
            self.post_init()

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.score(self.model(input_ids).last_hidden_state)

    torch.manual_seed(0)
    model = type(arch, (_Reward,), {}).from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():  # a head of visible size (its default init is small)
        for layer in (model.score[0], model.score[2]):
            layer.weight.normal_(0.0, 0.3)
            layer.bias.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    for name in os.listdir(source):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(os.path.join(source, name), folder)
    return folder


def _with_auto_map(folder: str) -> None:
    import json

    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["auto_map"] = {"AutoConfig": "configuration_qwen2_rm.Qwen2RMConfig",
                          "AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)


def _hf_rewards(folder: str, prompt: list[int]) -> torch.Tensor:
    from safetensors.torch import load_file
    from transformers import Qwen2Model

    state = load_file(f"{folder}/model.safetensors")
    with torch.no_grad():
        decoder = Qwen2Model.from_pretrained(folder, dtype=torch.float32).eval()
        hidden = decoder(torch.tensor([prompt])).last_hidden_state[0]
        dense = torch.relu(hidden @ state["score.0.weight"].T + state["score.0.bias"])
        return dense @ state["score.2.weight"].T + state["score.2.bias"]


async def test_qwen2_reward_model_returns_its_heads_reward_per_token(tiny_qwen2: str, tmp_path) -> None:
    path = _qwen2_reward_checkpoint(tiny_qwen2, str(tmp_path / "rm"), "Qwen2ForRewardModel", 1)
    async with AsyncEngine(path, max_model_len=64, max_num_batched_tokens=16, disable_log_stats=True,
                           max_worker_restarts=0) as engine:
        assert (engine.config.runner, engine.config.convert) == ("pooling", "none")  # a pooling model of its own
        assert await engine.get_supported_tasks() == ("token_classify",)
        raw = await asyncio.gather(*(engine.encode(p, pooling_task="token_classify") for p in PROMPTS))
        activated = await engine.encode(PROMPTS[0], PoolingParams(use_activation=True), pooling_task="token_classify")
        with pytest.raises(InvalidRequestError, match="token_classify only"):
            await engine.classify(PROMPTS[2])
    for prompt, out in zip(PROMPTS, raw):  # vLLM's Qwen2ForRewardModel: raw rewards by default (use_activation off)
        assert _close(out.data, _hf_rewards(path, prompt))
    assert _close(activated.data, torch.sigmoid(_hf_rewards(path, PROMPTS[0])))


async def test_qwen2_process_reward_model_scores_the_step_tags(tiny_qwen2: str, tmp_path) -> None:
    path = _qwen2_reward_checkpoint(tiny_qwen2, str(tmp_path / "prm"), "Qwen2ForProcessRewardModel", 2)
    _with_auto_map(path)  # as the hub's checkpoints ship it: not needed (no trust_remote_code)
    assert prepare(EngineConfig.create(path)).pooling_model.reward == RewardPooling("STEP", 151651, None, True, 2)
    overridden = prepare(EngineConfig.create(path, convert="reward", pooler_config={
        "pooling_type": "STEP", "step_tag_id": STEP, "returned_token_ids": [1], "use_activation": False}))
    assert overridden.pooling_model.reward == RewardPooling("STEP", STEP, (1,), False, 2)
    async with AsyncEngine(path, max_model_len=64, max_num_batched_tokens=8, tensor_parallel_size=2,
                           disable_log_stats=True, max_worker_restarts=0) as engine:
        default = await engine.encode(STEP_PROMPT, pooling_task="token_classify")  # vLLM's step tag 151651: none here
        tagged = await engine.encode(STEP_PROMPT, PoolingParams(step_tag_id=STEP), pooling_task="token_classify")
        good = await engine.encode(STEP_PROMPT, PoolingParams(step_tag_id=STEP, returned_token_ids=[1]),
                                   pooling_task="token_classify")
    logits = _hf_rewards(path, STEP_PROMPT)[torch.tensor(STEP_PROMPT) == STEP]
    assert default.data == []  # the step tag's rows only: none
    assert _close(tagged.data, torch.softmax(logits, dim=-1))  # each step's softmax: the card's make_step_rewards
    assert _close(good.data, torch.sigmoid(logits[:, [1]]))
