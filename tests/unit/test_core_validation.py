"""`check_add_request` and its helpers: what the engine core refuses in a decoded `AddRequest` that a host would
have refused or filled in (a peer that is not our host, `AsyncEngine.connect`, skips those steps)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from asyncllm import InvalidRequestError, SamplingParams, protocol
from asyncllm.engine.validation import check_add_request, check_lora_id, served_tasks
from asyncllm.lora import LoRARequest
from asyncllm.pooling import PoolingParams

VOCAB = 512
GENERATES = frozenset({"generate", "embed"})


def _message(**fields: Any) -> protocol.AddRequest:
    params = SamplingParams(**fields.pop("params", {}))
    return msgspec.structs.replace(protocol.AddRequest("r", [1, 2, 3], params, [2], time.time()), **fields)


@pytest.mark.parametrize(("field", "fields", "tasks"), [
    ("n", {"params": {"n": 2}}, None),  # the host sends each sample as its own request: the core would run one
    ("bad_words", {"params": {"bad_words": ["hello"]}}, None),  # the ids the workers ban come from the host
    ("allowed_token_ids", {"params": {"allowed_token_ids": [5], "bad_words_token_ids": [[5]]}}, None),
    ("allowed_token_ids", {"params": {"allowed_token_ids": [2, 7], "stop_token_ids": [7], "min_tokens": 1}}, None),
    ("lora_request", {"lora": LoRARequest("a", 0, "/adapter")}, None),  # id 0 is the base model's
    ("lora_request", {"lora": LoRARequest("", 1, "/adapter")}, None),
    ("pooling_type", {"pooling": PoolingParams(pooling_type="MAX"), "params": {"max_tokens": 1}}, None),
    ("max_tokens", {"pooling": PoolingParams()}, None),  # a host's embed and classify sample one token
    ("task", {"pooling": PoolingParams(task="classify"), "params": {"max_tokens": 1}}, GENERATES),  # no score head
    ("task", {"pooling": PoolingParams(), "params": {"max_tokens": 1}}, frozenset({"classify"})),
    ("prompt", {}, frozenset({"embed"})),  # no LM head
])
def test_what_only_a_host_checks_names_its_field(field: str, fields: dict, tasks: frozenset[str] | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_add_request(_message(**fields), VOCAB, tasks=tasks)
    assert info.value.field == field


@pytest.mark.parametrize("fields", [
    {},
    {"params": {"bad_words": ["hello"], "bad_words_token_ids": [[7], [9, 10]]}},
    {"params": {"allowed_token_ids": [2, 7], "stop_token_ids": [7], "min_tokens": 1, "ignore_eos": True}},
    {"params": {"allowed_token_ids": [2, 7], "stop_token_ids": [7]}},  # no min_tokens: EOS and 7 may end it
    {"pooling": PoolingParams(), "params": {"max_tokens": 1}, "lora": LoRARequest("a", 1, "/adapter")},
])
def test_what_a_host_sends_passes(fields: dict) -> None:
    check_add_request(_message(**fields), VOCAB, tasks=GENERATES)


def test_served_tasks_follow_the_architecture() -> None:
    def tasks(arch: str) -> frozenset[str] | None:
        return served_tasks([arch])

    assert tasks("LlamaForCausalLM") == GENERATES
    assert tasks("LlamaModel") == {"embed"} and tasks("BertModel") == {"embed"}
    assert tasks("Qwen3ForSequenceClassification") == {"classify"}
    assert served_tasks(None) is None  # a test runner without a config: not checked


def test_one_adapter_path_per_lora_id_across_hosts() -> None:
    known: dict[int, str] = {}
    check_lora_id(LoRARequest("a", 1, "/a"), known)
    check_lora_id(LoRARequest("also a", 1, "/a"), known)  # another host's name for the same adapter
    check_lora_id(LoRARequest("b", 2, "/b"), known)
    check_lora_id(None, known)
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 already names the adapter at /a") as info:
        check_lora_id(LoRARequest("b", 1, "/b"), known)
    assert info.value.field == "lora_request" and known == {1: "/a", 2: "/b"}
