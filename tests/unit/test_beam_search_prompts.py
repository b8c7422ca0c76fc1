"""`beam_search`'s prompt dicts (vLLM's TextPrompt / TokensPrompt), over a fake engine: ``cache_salt`` honoured,
every other key it cannot use named for what it is."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from asyncllm import BeamSearchParams, InvalidRequestError
from asyncllm.beam_search import beam_search
from asyncllm.engine.validation import PART_CHARS
from asyncllm.generation_config import SuppressedTokens
from asyncllm.outputs import Logprob

PARAMS = BeamSearchParams(beam_width=1, max_tokens=2)


class _Engine:
    """Each step's request returns the same two candidates; the options of every request are kept."""

    tokenizer = None
    eos_token_ids = [2]
    suppressed_tokens = SuppressedTokens()

    def __init__(self, max_logprobs: int = 20) -> None:
        self.options: list[dict[str, Any]] = []
        self.params: list[Any] = []
        self.config = SimpleNamespace(max_logprobs=max_logprobs, max_model_len=64)

    async def start(self) -> None:
        return None

    async def generate(self, tokens: list[int], params: Any, **options: Any) -> Any:
        self.options.append(options)
        self.params.append(params)
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


def test_every_step_asks_for_raw_logprobs_whatever_the_engines_mode() -> None:
    """The beams are ranked by log-probabilities: a step's request sets logprobs_mode, so an engine whose
    logprobs_mode reports logits still gives beam search log-softmax values."""
    _, engine = _run([1, 3])
    assert {(p.logprobs, p.logprobs_mode) for p in engine.params} == {(2, "raw_logprobs")}


def test_a_beam_width_above_half_max_logprobs_names_beam_width() -> None:
    wide = BeamSearchParams(beam_width=11, max_tokens=1)
    with pytest.raises(InvalidRequestError, match="22 logprobs a step, more than the engine's max_logprobs=20") as info:
        asyncio.run(beam_search(_Engine(), [1, 3], wide))  # type: ignore[arg-type]
    assert info.value.field == "beam_width"
    out = asyncio.run(beam_search(_Engine(max_logprobs=-1), [1, 3], wide))  # type: ignore[arg-type]
    assert out.sequences[0].tokens == [1, 3, 5]


def test_max_logprobs_is_the_started_engines() -> None:
    """An attached host (`AsyncEngine.connect`) holds a placeholder config until `start` takes the core's: the
    beam width is checked against the max_logprobs the engine has once started."""

    class _Attached(_Engine):
        async def start(self) -> None:
            self.config = SimpleNamespace(max_logprobs=40, max_model_len=64)  # the core's, placeholder 20 before

    wide = BeamSearchParams(beam_width=16, max_tokens=1)
    out = asyncio.run(beam_search(_Attached(), [1, 3], wide))  # type: ignore[arg-type]
    assert out.sequences[0].tokens == [1, 3, 5]


class _Tokenizer:
    """A tokenizer that records the length of each text it tokenizes and the thread it does it on."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((len(text), threading.get_ident()))
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_a_text_prompt_is_checked_and_tokenized_as_generates_off_the_event_loop() -> None:
    """As generate's: a lone surrogate is an error naming ``prompt`` (not the tokenizer's TypeError), a text is
    tokenized on a worker thread, not the event loop, and a huge one is refused by its parts (`check_prompt_chars`),
    never tokenized whole."""
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    engine = _Engine()
    engine.tokenizer, engine.pooling_model = _Tokenizer(tokenizer), None  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="not valid Unicode") as info:
        asyncio.run(beam_search(engine, "hi\ud800", PARAMS))  # type: ignore[arg-type]
    assert info.value.field == "prompt" and engine.tokenizer.calls == []
    out = asyncio.run(beam_search(engine, "hi", PARAMS))  # type: ignore[arg-type]
    assert out.sequences[0].tokens == tokenizer("hi").input_ids + [5, 5]
    assert engine.tokenizer.calls and threading.main_thread().ident not in {t for _, t in engine.tokenizer.calls}
    engine.tokenizer.calls.clear()
    with pytest.raises(InvalidRequestError, match="characters, at least") as info:
        asyncio.run(beam_search(engine, "hello " * 100_000, PARAMS))  # type: ignore[arg-type]
    assert info.value.field == "prompt" and max(n for n, _ in engine.tokenizer.calls) <= PART_CHARS


def test_a_text_prompt_is_counted_by_parts_past_the_engines_max_prompt_chars() -> None:
    """The engine's threshold (`max_prompt_chars`, the longest vocabulary entry per token of max_model_len), not a
    part's length: a text of a few thousand characters is refused by its count, as generate's, before it is encoded."""
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path
    from asyncllm.engine.validation import max_prompt_chars

    engine = _Engine()
    engine.tokenizer = _Tokenizer(AutoTokenizer.from_pretrained(bundled_model_path()))  # type: ignore[assignment]
    engine.pooling_model = None  # type: ignore[attr-defined]
    text = "hello " * (max_prompt_chars(engine.tokenizer, 64) // 6 + 1)
    assert len(text) < PART_CHARS
    with pytest.raises(InvalidRequestError, match="characters, at least"):
        asyncio.run(beam_search(engine, text, PARAMS))  # type: ignore[arg-type]
    assert len(engine.tokenizer.calls) == 1  # its one part counted, never encoded
