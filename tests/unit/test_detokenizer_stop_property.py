"""Stop strings on drawn text: the stream stops where a token-by-token reference does, whatever the chunking.

The reference decodes the first k ids for k = 1, 2, ... and stops at the first k whose text holds a stop string
(ending after the text of the first ``min_tokens`` ids, as vLLM counts it), taking the one that starts first there,
the shortest of those that start together; the request keeps ids[:k] and the text before the match (through it with
``include_stop_str_in_output``). Chunks of several ids (speculative decoding's accepted drafts) must give the same
text, stop string and ids as one id at a time. Drawn only from ids whose decode() is valid text: an invalid byte run
streams differently from decode() by design (test_detokenizer.py, ``assert_decodes_as``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint
from test_detokenizer import MULTIBYTE, SlowTokenizerView, fast_of, sentencepiece_style_tokenizer, stream

TEXTS = [MULTIBYTE, "The quick brown fox.\n\nHéllo wörld ✓ naïve café", "def main():\n    return 42\n",
         "日本語 🙂🙂 abc abc abc"]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    return {
        "byte_level": AutoTokenizer.from_pretrained(tiny_checkpoint("llama")),
        "llama2": sentencepiece_style_tokenizer("llama2"),
        "metaspace": sentencepiece_style_tokenizer("metaspace"),
        "slow_view": SlowTokenizerView(sentencepiece_style_tokenizer("llama2")),
    }


def reference(tokenizer: Any, ids: list[int], params: SamplingParams) -> tuple[str, str | None, list[int]]:
    """(text, stop string, ids kept) as a detokenizer fed one id at a time and checking after each would give."""
    decode = lambda k: tokenizer.decode(ids[:k], skip_special_tokens=params.skip_special_tokens)  # noqa: E731
    # the text the first min_tokens ids have shown: up to the last of them that ends a character (ByteFallback
    # writes a run of byte ids that a character is cut in as one U+FFFD per byte, the whole characters before too)
    floor = max(len(text) for text in map(decode, range(params.min_tokens + 1)) if "\ufffd" not in text)
    for k in range(params.min_tokens + 1, len(ids) + 1):
        text = decode(k)
        found = [(text.find(stop, max(0, floor - len(stop) + 1)), len(stop), stop) for stop in params.stop]
        found = [match for match in found if match[0] >= 0]
        if found:
            start, length, stop = min(found)
            return text[: start + (length if params.include_stop_str_in_output else 0)], stop, ids[:k]
    return decode(len(ids)), None, ids


def streamed(tokenizer: Any, ids: list[int], params: dict[str, Any],
             rng: random.Random | None) -> tuple[str, str | None, list[int]]:
    """(text, stop string, ids kept) of the detokenizer fed one id at a time (``rng`` None) or in chunks of 1 to 5
    (`test_detokenizer.stream`); its deltas must add up to its text."""
    updates, detok = stream(tokenizer, ids, rng, **params)
    assert "".join(update.text for update in updates) == detok.output_text
    return detok.output_text, detok.stop_string, list(detok.token_ids)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stop_strings_stop_where_one_id_at_a_time_does(tokenizers: dict[str, Any], data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(tokenizers)))
    tokenizer = tokenizers[name]
    ids = fast_of(tokenizer)(data.draw(st.sampled_from(TEXTS)), add_special_tokens=False).input_ids
    start = data.draw(st.integers(0, len(ids) - 1))
    ids = ids[start:start + data.draw(st.integers(1, 40))]
    ids += data.draw(st.lists(st.integers(0, len(fast_of(tokenizer)) - 1), max_size=4))  # specials and odd pieces
    skip = data.draw(st.booleans())
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    assume(text and "\ufffd" not in text)
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    stops = [text[a:a + rng.randint(1, 6)] for a in (rng.randrange(len(text)) for _ in range(rng.randint(1, 3)))]
    stops += data.draw(st.lists(st.sampled_from(["zz", "\n\n", "ö", "🙂", " a"]), max_size=1))
    params = dict(stop=stops, include_stop_str_in_output=data.draw(st.booleans()), skip_special_tokens=skip,
                  min_tokens=data.draw(st.sampled_from([0, 0, 1, 2, 5, len(ids)])))
    expected = reference(tokenizer, ids, SamplingParams(**params))
    assert streamed(tokenizer, ids, params, None) == expected, (name, ids, stops)
    assert streamed(tokenizer, ids, params, rng) == expected, (name, ids, stops)
