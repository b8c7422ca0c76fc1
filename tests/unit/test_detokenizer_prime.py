"""The detokenizer continues the prompt's text as vLLM's primed stream does, and the stop-string matcher holds exactly
the longest partial match (its Knuth-Morris-Pratt states)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.engine.stop_strings import StopStringMatcher
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint
from test_detokenizer import sentencepiece_style_tokenizer


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    return {"byte_level": AutoTokenizer.from_pretrained(tiny_checkpoint("llama")),
            "llama2": sentencepiece_style_tokenizer("llama2"), "metaspace": sentencepiece_style_tokenizer("metaspace")}


@pytest.mark.parametrize("name", ["byte_level", "llama2", "metaspace"])
@pytest.mark.parametrize("prompt_text", ["The", "The very", "Émile said: 😂"])
def test_the_output_continues_the_prompts_text_as_vllms(tokenizers: dict[str, Any], name: str,
                                                         prompt_text: str) -> None:
    """vLLM primes its stream with the prompt's end: the prompt's text and the output's add up to the decoding of
    both (SentencePiece's first space kept: " quick brown"), whatever the prompt's length; a prompt of embeddings
    (``prime=False``) decodes the output alone."""
    tokenizer = tokenizers[name]
    prompt = tokenizer(prompt_text).input_ids
    output = tokenizer(" quick brown 😂 fox", add_special_tokens=False).input_ids
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
        text = "".join(detok.update([t], False).text for t in output) + detok.update([], True).text
        whole, alone = (tokenizer.decode(ids, skip_special_tokens=skip) for ids in (prompt + output, prompt))
        assert alone + text == whole and text.startswith(" ") and "quick brown" in text
    unprimed = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(), prime=False)
    assert unprimed.update(output, True).text == tokenizer.decode(output, skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=7), min_size=1, max_size=3),
       st.lists(st.text("abc", max_size=4), max_size=10), st.integers(0, 4))
def test_matcher_holds_exactly_the_longest_partial_prefix_of_the_whole_text(stops, pushes, unmatched) -> None:
    """Whatever the repeats (the automaton's borders), the held tail is the longest suffix of everything pushed that
    is a proper prefix of a stop string (a whole stop string inside the first pushes, not matched, included)."""
    matcher, text = StopStringMatcher(stops, False), ""
    for i, piece in enumerate(pushes):
        text += piece
        _, stop = matcher.push(piece, match=i >= unmatched)
        if stop is not None:
            return
        longest = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        assert matcher._held == text[len(text) - longest:]
