"""``suppress_tokens`` / ``begin_suppress_tokens`` have one reader (`SuppressedTokens.of`): the host's (prepare, for
beam search) and the workers' (`GenerationRules.of`, their masks) agree with each other and with transformers'
processors on a valid list (ids outside the vocabulary, negative ones too, have no effect), and both refuse a
malformed one with the same `ConfigError` naming the key."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from asyncllm import ConfigError, EngineConfig
from asyncllm.generation_config import SuppressedTokens
from asyncllm.workers.generation_rules import GenerationRules

SOURCE = ("generation_config", "generation_config.json")  # the field a ConfigError names, and its file


@dataclass
class _Row:
    row: int
    token_ids: list[int]
    num_prompt_tokens: int


def _host(model: str, generation_config: str):
    from asyncllm.engine.prepare import prepare

    config = EngineConfig.create(model, generation_config=generation_config, skip_tokenizer_init=True)
    return prepare(config)


def _masked(rules: GenerationRules | None, vocab_size: int, first: bool) -> set[int]:
    """The ids the workers' rules mask at a request's first generated position, or at a later one."""
    logits = torch.zeros(1, vocab_size)
    step = None if rules is None else rules.step([_Row(0, [1, 2, 3], 2)], [2 if first else 3])
    if step is not None:
        step.apply(logits)
    return set(torch.isinf(logits[0]).nonzero().flatten().tolist())


def _transformers_masked(suppress: list[int], begin: list[int], vocab_size: int, first: bool) -> set[int]:
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor)

    ids, scores = torch.tensor([[1, 2] if first else [1, 2, 3]]), torch.zeros(1, vocab_size)
    for processor in (SuppressTokensAtBeginLogitsProcessor(begin, 2), SuppressTokensLogitsProcessor(suppress)):
        scores = processor(ids, scores)
    return set(torch.isinf(scores[0]).nonzero().flatten().tolist())


def _folder(tmp_path, **keys) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(keys))
    return str(tmp_path)


def test_host_workers_and_transformers_suppress_the_same_ids(tiny_llama: str, tmp_path) -> None:
    vocab_size = _host(tiny_llama, "vllm").vocab_size
    suppress, begin = [9, 3, -1, vocab_size + 5], [4, 9, vocab_size]
    folder = _folder(tmp_path, suppress_tokens=suppress, begin_suppress_tokens=begin)
    host = _host(tiny_llama, folder).suppressed_tokens
    assert (host.always, host.at_start) == ({3, 9}, {4, 9})
    rules = GenerationRules.of(folder, tiny_llama, vocab_size, torch.device("cpu"))
    for first in (True, False):
        expected = _transformers_masked(suppress, begin, vocab_size, first)
        assert expected == (host.always | host.at_start if first else host.always)
        assert _masked(rules, vocab_size, first) == expected


@pytest.mark.parametrize("keys", [{"suppress_tokens": [3, "x"]}, {"begin_suppress_tokens": 5},
                                  {"suppress_tokens": [None]}, {"begin_suppress_tokens": [3, 1.5]},
                                  {"suppress_tokens": [[1, 2]]}, {"suppress_tokens": 0}])
def test_host_and_workers_refuse_a_malformed_list_alike(tiny_llama: str, tmp_path, keys: dict) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(tiny_llama):  # the tiny checkpoint with the malformed file as its own (``auto``)
        if name != "generation_config.json":
            (model / name).symlink_to(os.path.join(tiny_llama, name))
    _folder(model, **keys)
    (key,) = keys
    with pytest.raises(ConfigError) as host:
        _host(str(model), "auto")
    with pytest.raises(ConfigError) as workers:
        GenerationRules.of("auto", str(model), 100, torch.device("cpu"))
    assert str(host.value) == str(workers.value)
    assert (host.value.field, host.value.value) == ("model", str(model))
    assert f"generation_config.json's {key}: a list of token ids" in str(host.value)


@pytest.mark.parametrize("suppress", [[1.0], [True, 3], [2.0, 7, False], ""])
def test_integral_floats_and_bools_are_ids_as_in_transformers(suppress) -> None:
    """transformers' processors make a tensor of the list: ``1.0`` and ``true`` are id 1 there, ``""`` no ids."""
    always = SuppressedTokens.of({"suppress_tokens": suppress}, 10, SOURCE).always
    assert always == _transformers_masked(suppress, [], 10, first=False) and always == {int(t) for t in suppress}


def test_a_long_malformed_list_is_shortened_in_the_error_naming_its_bad_entry() -> None:
    with pytest.raises(ConfigError) as error:
        SuppressedTokens.of({"begin_suppress_tokens": [*range(1000), 0.5]}, 10, SOURCE)
    message = str(error.value)
    assert "begin_suppress_tokens: a list of token ids" in message and "whose entry 1000 is 0.5" in message
    assert "999" not in message and len(message) < 300
