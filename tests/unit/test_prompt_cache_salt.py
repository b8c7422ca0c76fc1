"""`split_cache_salt`: a prompt dict's ``cache_salt`` (vLLM's TextPrompt / TokensPrompt / EmbedsPrompt key) as the
request's salt, the one rule of `AsyncEngine._submit` and `beam_search` (a real engine's prefix-cache isolation:
tests/engine/test_sched_engine.py)."""

from __future__ import annotations

from typing import Any

import pytest

from asyncllm import InvalidRequestError
from asyncllm.engine.validation import split_cache_salt


@pytest.mark.parametrize("prompt, argument, expected", [
    ({"prompt": "hi", "cache_salt": "a"}, None, ({"prompt": "hi"}, "a")),
    ({"prompt_token_ids": [1], "cache_salt": "a"}, "a", ({"prompt_token_ids": [1]}, "a")),  # the same twice: one
    ({"prompt_token_ids": [1], "cache_salt": ""}, None, ({"prompt_token_ids": [1]}, "")),  # "" is a salt
    ({"prompt_token_ids": [1], "cache_salt": None}, "mine", ({"prompt_token_ids": [1]}, "mine")),  # None: none
    ({"prompt": "hi"}, "mine", ({"prompt": "hi"}, "mine")),
    ([1, 2], "mine", ([1, 2], "mine")),
    ("cache_salt", None, ("cache_salt", None)),
])
def test_a_prompt_dicts_salt_is_split_off(prompt: Any, argument: str | None, expected: tuple) -> None:
    given = dict(prompt) if isinstance(prompt, dict) else prompt
    assert split_cache_salt(prompt, argument) == expected
    assert prompt == given  # the caller's dict is left as it was


@pytest.mark.parametrize("salt, argument, message", [
    (7, None, "must be a str"),
    ("a", "b", "differs from the cache_salt argument"),
    ("a", "", "differs from the cache_salt argument"),
    ("\ud800", None, "not valid Unicode"),
])
def test_a_bad_prompt_salt_names_the_field(salt: Any, argument: str | None, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        split_cache_salt({"prompt": "hi", "cache_salt": salt}, argument)
    assert info.value.field == "prompt.cache_salt"
