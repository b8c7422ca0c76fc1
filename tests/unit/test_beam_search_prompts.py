"""`beam_search`'s prompt dicts (vLLM's TextPrompt / TokensPrompt), over a fake engine: ``cache_salt`` honoured,
every other key it cannot use named for what it is."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from asyncllm import BeamSearchParams, InvalidRequestError
from asyncllm.beam_search import beam_search
from asyncllm.outputs import Logprob

PARAMS = BeamSearchParams(beam_width=1, max_tokens=2)


class _Engine:
    """Each step's request returns the same two candidates; the options of every request are kept."""

    tokenizer = None
    eos_token_ids = [2]

    def __init__(self) -> None:
        self.options: list[dict[str, Any]] = []

    async def start(self) -> None:
        return None

    async def generate(self, tokens: list[int], params: Any, **options: Any) -> Any:
        self.options.append(options)
        entry = {5: Logprob(-0.1, rank=1), 6: Logprob(-2.0, rank=2)}
        return SimpleNamespace(outputs=[SimpleNamespace(logprobs=[entry])])


def _run(prompt: Any, **options: Any) -> tuple[Any, _Engine]:
    engine = _Engine()
    return asyncio.run(beam_search(engine, prompt, PARAMS, **options)), engine  # type: ignore[arg-type]


def test_a_prompt_dicts_cache_salt_salts_every_steps_requests() -> None:
    out, engine = _run({"prompt_token_ids": [1, 3], "cache_salt": "tenant-a"})
    assert out.sequences[0].tokens == [1, 3, 5, 5]
    assert [options["cache_salt"] for options in engine.options] == ["tenant-a", "tenant-a"]
    _, engine = _run({"prompt_token_ids": [1, 3], "cache_salt": "tenant-a"}, cache_salt="tenant-a", priority=1)
    assert engine.options[0] == {"cache_salt": "tenant-a", "priority": 1}  # the same salt twice is one
    _, engine = _run({"prompt_token_ids": [1, 3], "cache_salt": None}, cache_salt="mine")
    assert engine.options[0] == {"cache_salt": "mine"}  # None: no salt in the prompt
    _, engine = _run({"prompt_token_ids": [1, 3]})
    assert engine.options[0] == {}


@pytest.mark.parametrize("prompt, options, field, words", [
    ({"prompt_token_ids": [1], "cache_salt": "a"}, {"cache_salt": "b"}, "prompt.cache_salt", "differs"),
    ({"prompt_token_ids": [1], "cache_salt": 7}, {}, "prompt.cache_salt", "must be a str"),
    ({"prompt_token_ids": [1], "cache_salts": "a"}, {}, "prompt.cache_salts", "unknown key"),
    ({"prompt_token_ids": [1], "images": [b"x"], "typo": 1}, {}, "prompt.typo", "unknown key"),
    ({"prompt_token_ids": [1], "images": [b"x"], "cache_salt": "a"}, {}, "prompt.images", "media"),
    ({"prompt": "hi", "images": None, "videos": [b"x"]}, {}, "prompt.videos", "media"),
    ({"prompt_token_ids": [1], "mm_processor_kwargs": {"size": 4}}, {}, "prompt.mm_processor_kwargs", "media"),
    ({"prompt_embeds": [[0.0]]}, {}, "prompt.prompt_embeds", "embeddings"),
    ({"prompt_token_ids": [1], "token_type_ids": [0]}, {}, "prompt.token_type_ids", "token type ids"),
    ({"prompt_token_ids": "hi"}, {}, "prompt.prompt_token_ids", "a list of ids"),
    ({"prompt": "hi", "prompt_token_ids": [5]}, {}, "prompt", "beam search takes"),
], ids=["salt-twice", "salt-type", "unknown", "unknown-first", "media", "media-none-entry", "mm-kwargs", "embeds",
        "token-types", "ids-type", "both"])
def test_a_prompt_dict_key_it_cannot_use_is_named(prompt: dict, options: dict, field: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _run(prompt, **options)
    assert info.value.field == field and words in str(info.value)
