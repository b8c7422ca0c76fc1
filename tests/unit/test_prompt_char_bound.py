"""A text past ``max_prompt_chars`` (asyncllm/engine/validation.py): counted by parts, refused only when they make
more tokens than fit, never tokenized whole when they do, and tokenized as usual when its characters make few
tokens (a tokenizer that drops whitespace, WordPiece's one [UNK] for a long word)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncllm.bundled import bundled_model_path
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.validation import PART_CHARS
from asyncllm.engine.stream import RequestOptions
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import SamplingParams


class Spy:
    """A tokenizer that records the length of each text it tokenizes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)


def _bert() -> PreTrainedTokenizerFast:
    """BERT's normalizer, whitespace pre-tokenizer and WordPiece (an [UNK] for a word past 100 characters)."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, cls_token="[CLS]", sep_token="[SEP]",
                                        unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def _prompts(tokenizer, max_model_len: int) -> PromptTokenizer:
    prompts = PromptTokenizer(tokenizer, len(tokenizer))
    prompts.ready(max_model_len)
    return prompts


def _ids(prompts: PromptTokenizer, prompt, chat: bool = False) -> list[int]:
    job = SimpleNamespace(prompt=prompt, params=SamplingParams(max_tokens=1), options=RequestOptions(), chat=chat)
    return prompts.token_ids(job)


def test_a_text_whose_characters_make_few_tokens_fits() -> None:
    """vLLM tokenizes whatever it is sent: 10,000 spaces BERT drops, a 10,000-character word that is one [UNK], as
    a prompt or a chat, are each a few tokens, past max_prompt_chars (6 per token here) and served."""
    prompts = _prompts(_bert(), 512)
    spaced, word = "hello" + " " * 10_000 + "world", "a" * 10_000
    assert min(len(spaced), len(word)) > prompts.max_prompt_chars
    assert _ids(prompts, spaced) == [2, 4, 5, 3]
    assert _ids(prompts, word) == [2, 1, 3]
    assert _ids(prompts, [{"role": "user", "content": spaced}], chat=True) == [4, 5]


def test_a_huge_text_is_refused_by_its_parts_untokenized_whole() -> None:
    """1.2 MB that cannot fit: refused after a part or two of tokenizing (the processor thread is every request's),
    naming ``prompt`` for a text and ``messages`` for a chat, by its character count."""
    spy = Spy(AutoTokenizer.from_pretrained(bundled_model_path()))
    prompts, text = _prompts(spy, 64), "hello " * 200_000
    for prompt, chat, field in ((text, False, "prompt"), ([{"role": "user", "content": text}], True, "messages")):
        spy.lengths.clear()
        with pytest.raises(InvalidRequestError) as info:
            _ids(prompts, prompt, chat=chat)
        assert (info.value.field, info.value.code) == (field, "context_length_exceeded")
        said = re.search(r"However, your request has (\d+) characters, at least (\d+) input tokens\. Please reduce "
                         r"the length of the input messages\.$", str(info.value))  # as a prompt past max_model_len
        assert said and int(said[1]) >= len(text) and int(said[2]) > 64, info.value
        assert spy.lengths and max(spy.lengths) <= PART_CHARS and sum(spy.lengths) <= 2 * PART_CHARS, spy.lengths


def test_a_text_one_token_short_of_the_limit_past_the_character_bound_fits() -> None:
    """Counted by parts, a text with no text pair counts its own tokens only (an empty pair once added 2)."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    prompts = _prompts(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]"), 64)
    text = "hello " * 63  # 378 characters, past the bound of 64 * 5: 63 tokens, max_model_len 64
    assert len(text) > prompts.max_prompt_chars
    assert _ids(prompts, text) == [1] * 63


def test_the_longest_vocabulary_entry_is_read_once_per_tokenizer() -> None:
    """`max_prompt_chars` lists a tokenizer's vocabulary once (beam search asks for every prompt)."""
    from asyncllm.engine.validation import max_prompt_chars

    class Listing:
        calls = 0

        def get_vocab(self) -> dict[str, int]:
            Listing.calls += 1
            return {"a": 0, "hello": 1}

    tokenizer = Listing()
    assert max_prompt_chars(tokenizer, 10) == max_prompt_chars(tokenizer, 20) // 2 == 50
    assert Listing.calls == 1
