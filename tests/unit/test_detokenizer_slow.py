"""A slow tokenizer whose decode is not prefix-stable (GPT-SW3's) streams without duplicating or losing text."""

from __future__ import annotations

import random
from typing import Any

import pytest
import sentencepiece as spm
from transformers import GPTSw3Tokenizer

from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.sampling import SamplingParams

_CORPUS = ["Hello world, this is a small corpus.", "The quick brown fox jumps over the lazy dog.",
           "User: hi\nBot: hello there"] * 20


@pytest.fixture(scope="module")
def gpt_sw3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """GPT-SW3's slow tokenizer on a SentencePiece model trained here (~30 ms): its decode puts a space before the
    text that precedes a special token (``decode(["ld"]) == "ld"``, ``decode(["ld", "<s>"]) == " ld<s>"``)."""
    prefix = str(tmp_path_factory.mktemp("sw3") / "sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS), model_prefix=prefix, vocab_size=300, byte_fallback=True, model_type="bpe",
        user_defined_symbols=["<s>", "<|endoftext|>", "<pad>"], character_coverage=1.0, minloglevel=2)
    return GPTSw3Tokenizer(f"{prefix}.model")


def _stream(tokenizer: Any, ids: list[int], rng: random.Random | None = None, **params: Any) -> str:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))
    texts, i = [], 0
    while i < len(ids):
        k = 1 if rng is None else rng.randint(1, 4)
        texts.append(detok.update(ids[i:i + k], False).text)
        i += k
    return "".join(texts) + detok.update([], True).text


def _ids(tokenizer: Any, *parts: str) -> list[int]:
    return [i for part in parts for i in (tokenizer.convert_tokens_to_ids([part]) if part.startswith("<")
                                          else tokenizer(part, add_special_tokens=False).input_ids)]


@pytest.mark.parametrize("chunked", [False, True])
def test_special_token_after_text_adds_only_itself(gpt_sw3: Any, chunked: bool) -> None:
    ids = _ids(gpt_sw3, "Hello world", "<s>", "Bot: hi", "<s>", "<s>", "ok")
    # decode's spaces before text already shown cannot be streamed; the rest is decode's text, nothing twice
    assert gpt_sw3.decode(ids) == " Hello world<s> Bot: hi<s><s>ok"
    streamed = _stream(gpt_sw3, ids, random.Random(1) if chunked else None, skip_special_tokens=False)
    assert streamed == "Hello world<s>Bot: hi<s><s>ok"
    assert _stream(gpt_sw3, ids) == gpt_sw3.decode(ids, skip_special_tokens=True) == "Hello world Bot: hi ok"


@pytest.mark.parametrize("skip", [True, False])
def test_whitespace_pieces_keep_their_spaces(gpt_sw3: Any, skip: bool) -> None:
    # SentencePiece's decode drops a text's leading "▁"s: a window that starts at one must not lose it
    ids = gpt_sw3.convert_tokens_to_ids(["o", "▁t", "a", "▁", "<s>", "▁", "▁", "r", "▁", "▁", "▁"])
    assert _stream(gpt_sw3, ids, skip_special_tokens=skip) == gpt_sw3.decode(ids, skip_special_tokens=skip).lstrip()


def test_random_ids_lose_and_repeat_nothing(gpt_sw3: Any) -> None:
    rng = random.Random(0)
    vocab = [i for i in range(len(gpt_sw3)) if not gpt_sw3.convert_ids_to_tokens(i).startswith("<0x")]
    specials = gpt_sw3.convert_tokens_to_ids(["<s>", "<|endoftext|>"])
    for _ in range(150):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.choice(vocab) for _ in range(rng.randint(1, 16))]
        streamed = _stream(gpt_sw3, ids, rng, skip_special_tokens=False)
        assert streamed.replace(" ", "") == gpt_sw3.decode(ids).replace(" ", ""), ids  # only spaces may differ
        assert _stream(gpt_sw3, ids, rng) == gpt_sw3.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("skip", [True, False])
def test_ids_past_a_slow_tokenizer_have_no_text(gpt_sw3: Any, skip: bool) -> None:
    """A padded model's ids past its slow tokenizer (sampled, or forced by allowed_token_ids / logit_bias) stream
    and get logprobs as no text, as in vLLM, where sentencepiece's decode raises (it killed the processor thread)."""
    import numpy as np

    from asyncllm.engine.logprobs import LogprobsDecoder
    from asyncllm.protocol import LogprobsArrays

    past = len(gpt_sw3)
    word = _ids(gpt_sw3, "Hello world")
    assert _stream(gpt_sw3, [*word, past, past + 90, *word], random.Random(2), skip_special_tokens=skip) == \
        gpt_sw3.decode([*word, *word], skip_special_tokens=skip)
    ids = np.array([[past, word[0]]], dtype=np.int32)
    arrays = LogprobsArrays(2, ids.astype("<i4").tobytes(), np.zeros((1, 2), "<f4").tobytes(),
                            np.array([3], "<i4").tobytes())
    [row] = LogprobsDecoder(gpt_sw3).decode(arrays, preceding=[word[-1]])
    assert row[past].decoded_token == "" and row[word[0]].decoded_token == gpt_sw3.decode([word[0]])
