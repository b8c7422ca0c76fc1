"""Incremental detokenization is exact, holds back partial characters and stop strings."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncllm.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from asyncllm.engine.stop_strings import StopStringMatcher
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import make_tiny_checkpoint

MULTIBYTE = "héllo wörld ✓ 日本語 🙂 and more text\n\nnew para ✓✓ 🙂🙂 naïve"
_SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3, "Héllo wörld ✓ naïve café, déjà vu!",
    "don't stop: it's   spaced    out\n\ttabs and newlines\n\n", "def main():\n    return 42\n",
] * 5
_SP_SPECIALS = ["<unk>", "<s>", "</s>"]


def sentencepiece_style_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A Llama-2 / Mistral-like fast tokenizer: "▁" word marks, leading space dropped, byte fallback.

    ``style="llama2"``: Prepend/Replace normalizer and the Replace, ByteFallback, Fuse, Strip decoder
    chain of converted Llama 2 tokenizers. ``style="metaspace"``: Metaspace pre-tokenizer and decoder.
    """
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tok.train_from_iterator(
        _SP_CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=_SP_SPECIALS, show_progress=False),
    )
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(trained["vocab"])
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    if style == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    backend.add_special_tokens(_SP_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


class SlowTokenizerView:
    """Exposes only the slow-tokenizer API (no ``_tokenizer``), to drive the Python window path."""

    def __init__(self, fast: Any) -> None:
        self._fast = fast
        self.unk_token_id = fast.unk_token_id
        self.added_tokens_decoder = fast.added_tokens_decoder
        self.clean_up_tokenization_spaces = False

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self._fast.decode(ids, **kwargs)

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return self._fast.convert_tokens_to_ids(tokens)

    def clean_up_tokenization(self, text: str) -> str:
        return self._fast.clean_up_tokenization(text)


def fast_of(tokenizer: Any) -> Any:
    """The fast tokenizer behind ``tokenizer`` (itself, or the one a `SlowTokenizerView` wraps)."""
    return getattr(tokenizer, "_fast", tokenizer)


def byte_ids(tokenizer: Any, data: bytes) -> list[int]:
    """One id per byte: a byte-fallback ``<0xNN>`` token, or the byte-level BPE token of that byte (GPT-2's
    byte-to-unicode map); none for a tokenizer without byte tokens (WordPiece)."""
    vocab = fast_of(tokenizer).get_vocab()
    if "<0x80>" in vocab:
        return [vocab[f"<0x{b:02X}>"] for b in data]
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return [vocab[char[b]] for b in data] if all(char[b] in vocab for b in data) else []


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def byte_level(tiny_path: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def tokenizers(byte_level: Any) -> dict[str, Any]:
    return {
        "byte_level": byte_level,
        "llama2": sentencepiece_style_tokenizer("llama2"),
        "metaspace": sentencepiece_style_tokenizer("metaspace"),
        "slow_view": SlowTokenizerView(sentencepiece_style_tokenizer("llama2")),
    }


def _chunks(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """One id at a time without ``rng``, random chunk sizes 1..5 with it."""
    out, i = [], 0
    while i < len(ids):
        k = 1 if rng is None else rng.randint(1, 5)
        out.append(ids[i:i + k])
        i += k
    return out


def stream(tokenizer: Any, ids: list[int], rng: random.Random | None = None,
           **params: Any) -> tuple[list[DetokenizerUpdate], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))  # the output alone: decode(ids)
    updates = [detok.update(chunk, False) for chunk in _chunks(ids, rng)]
    updates.append(detok.update([], True))
    return updates, detok


def _decode(tokenizer: Any, ids: list[int], skip: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", ["byte_level", "llama2", "metaspace", "slow_view"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_real_text_streams_exactly(tokenizers: dict[str, Any], name: str, chunked: bool, skip: bool) -> None:
    tokenizer = tokenizers[name]
    fast = tokenizer._fast if name == "slow_view" else tokenizer
    ids = [*fast(MULTIBYTE, add_special_tokens=False).input_ids, fast.eos_token_id]
    ids += fast("  a    b 日本", add_special_tokens=False).input_ids
    updates, detok = stream(tokenizer, ids, random.Random(7) if chunked else None, skip_special_tokens=skip)
    texts = [u.text for u in updates]
    assert "".join(texts) == detok.output_text == _decode(fast, ids, skip)
    assert all("\ufffd" not in t for t in texts)
    assert detok.token_ids == ids
    assert all(u.stop_string is None for u in updates)
    assert ("</s>" in detok.output_text or "<|eos|>" in detok.output_text) is not skip


def test_multibyte_character_is_released_when_complete(byte_level: Any) -> None:
    ids = byte_level("🙂", add_special_tokens=False).input_ids
    assert len(ids) > 1  # the emoji is split over byte tokens
    updates, _ = stream(byte_level, ids)
    assert [u.text for u in updates] == [""] * (len(ids) - 1) + ["🙂", ""]


def test_incomplete_character_is_flushed_at_finish(byte_level: Any) -> None:
    ids = byte_level("a🙂", add_special_tokens=False).input_ids[:-1]
    updates, detok = stream(byte_level, ids)
    assert updates[-1].text.endswith("\ufffd")
    assert detok.output_text == byte_level.decode(ids) == "a\ufffd"


@pytest.mark.parametrize("name", ["byte_level", "llama2", "slow_view"])
@pytest.mark.parametrize("stop", ["\ufffd", "a\ufffd"])
def test_a_character_cut_at_finish_matches_no_stop_string(tokenizers: dict[str, Any], name: str, stop: str) -> None:
    """The U+FFFD of a character the request ended inside (max_tokens) is no stop string's match: the text is as
    without stop strings, the "a" held back for "a\ufffd" released before it."""
    tokenizer = tokenizers[name]
    fast = tokenizer._fast if name == "slow_view" else tokenizer
    ids = fast("a🙂", add_special_tokens=False).input_ids[:-1]
    updates, detok = stream(tokenizer, ids, stop=[stop])
    assert detok.output_text == fast.decode(ids) == stream(tokenizer, ids)[1].output_text
    assert detok.output_text.startswith("a\ufffd") and detok.token_ids == ids
    assert detok.stop_string is None and all(u.stop_string is None for u in updates)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=40), seed=st.integers(0, 2**16), skip=st.booleans())
def test_random_ids_byte_level_match_decode(byte_level: Any, ids: list[int], seed: int, skip: bool) -> None:
    updates, detok = stream(byte_level, ids, random.Random(seed), skip_special_tokens=skip)
    assert "".join(u.text for u in updates) == _decode(byte_level, ids, skip)


@pytest.mark.parametrize("name", ["llama2", "metaspace", "slow_view"])
def test_random_ids_sentencepiece_style_match_decode(tokenizers: dict[str, Any], name: str) -> None:
    """Includes invalid byte-fallback runs, which ByteFallback rewrites as one U+FFFD per byte."""
    tokenizer = tokenizers[name]
    fast = tokenizer._fast if name == "slow_view" else tokenizer
    rng = random.Random(name)
    words = ["a    b", " leading", "x  y   z ✓ 日本", "héllo wörld 🙂", "don't"]
    for _ in range(150):
        ids = [rng.randrange(len(fast)) for _ in range(rng.randint(0, 20))]
        ids = fast(rng.choice(words), add_special_tokens=False).input_ids + ids
        skip = rng.random() < 0.5
        updates, _ = stream(tokenizer, ids, rng, skip_special_tokens=skip)
        assert_decodes_as(_decode(fast, ids, skip), "".join(u.text for u in updates), ids)


def assert_decodes_as(decoded: str, streamed: str, ids: list[int]) -> None:
    """The stream's text is decode()'s but for a byte run that turned invalid after it showed characters of it
    (decode() writes that whole run as U+FFFD): the text before and after the U+FFFDs is decode()'s."""
    if "\ufffd" not in decoded:
        assert streamed == decoded, ids
        return
    head, tail = decoded.split("\ufffd", 1)[0], decoded.rsplit("\ufffd", 1)[1]
    assert streamed.startswith(head) and streamed.endswith(tail) and "\ufffd" in streamed, ids


@pytest.mark.parametrize("skip", [True, False])
def test_skipped_special_token_inside_byte_run(tokenizers: dict[str, Any], skip: bool) -> None:
    """decode() drops skipped specials first, so an invalid byte after one rewrites the byte before it; the
    stream showed that byte's "a" before the invalid byte came, and keeps it."""
    tokenizer = tokenizers["llama2"]
    ids = tokenizer.convert_tokens_to_ids(["<0x61>", "<s>", "<0xED>", "▁the"])
    assert tokenizer.decode(ids, skip_special_tokens=skip) == ("\ufffd\ufffd the" if skip else "a<s>\ufffd the")
    updates, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(u.text for u in updates) == ("a\ufffd the" if skip else "a<s>\ufffd the")


@pytest.mark.parametrize("name", ["llama2", "slow_view"])
def test_a_byte_run_is_shown_as_each_character_completes(tokenizers: dict[str, Any], name: str) -> None:
    """A newline that is ``<0x0A>`` and an emoji of four byte tokens show on the token that completes them, so
    a stop string in them ends the request there, and min_tokens counts that token (vLLM's DecodeStream)."""
    tokenizer = tokenizers[name]
    fast = tokenizer._fast if name == "slow_view" else tokenizer
    ids = fast.convert_tokens_to_ids(["▁The", "<0x0A>", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "▁quick"])
    updates, _ = stream(tokenizer, ids)
    assert [u.text for u in updates] == ["The", "\n", "", "", "", "🙂", " quick", ""]
    _, detok = stream(tokenizer, ids, stop=["\n"])
    assert (detok.output_text, detok.stop_string, detok.token_ids) == ("The", "\n", ids[:2])
    _, detok = stream(tokenizer, ids, stop=["🙂"], min_tokens=5)
    assert (detok.output_text, detok.stop_string) == ("The\n", "🙂")
    _, detok = stream(tokenizer, ids, stop=["🙂"], min_tokens=6)  # it ends in token 6: not after the first 6
    assert (detok.output_text, detok.stop_string) == ("The\n🙂 quick", None)


def test_leading_space_of_first_output_token_matches_hf_decode(tokenizers: dict[str, Any]) -> None:
    """Sentencepiece-style: decode(["▁Hello", ...]) drops the first space; an output with no prompt before it too."""
    tokenizer = tokenizers["llama2"]
    ids = tokenizer("quick brown", add_special_tokens=False).input_ids
    assert tokenizer.convert_ids_to_tokens(ids)[0].startswith("▁")
    updates, detok = stream(tokenizer, ids)
    assert detok.output_text == "quick brown"
    assert updates[0].text == "quick"


def test_decode_stream_failure_falls_back_to_window(byte_level: Any) -> None:
    class Refusing:
        def step(self, backend: Any, token_id: int) -> str:
            raise Exception("Invalid prefix encountered")  # what tokenizers raises

    ids = byte_level(MULTIBYTE, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams())
    first = detok.update(ids[:5], False).text
    detok._stream._decode_stream = Refusing()  # type: ignore[attr-defined]
    rest = [detok.update([i], False).text for i in ids[5:]] + [detok.update([], True).text]
    assert first + "".join(rest) == MULTIBYTE
    assert all("\ufffd" not in t for t in rest)


def test_clean_up_tokenization_spaces_streams_exactly(tiny_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(
        tiny_path, clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    text = "I don 't know . Do n't you 've ? ' x ' ok ! we 're , i 'm it 's"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == "I don 't know. Don't you've?'x'ok! we're, i'm it's"
    rng = random.Random(3)
    pieces = [" ", "  ", " .", " n", "'t", " '", "' ", "m", "s", "ve", "re", "?", "!", ",", "a", "n't", " 's", "x"]
    cases = [ids] + [
        tokenizer("".join(rng.choice(pieces) for _ in range(rng.randint(0, 15))), add_special_tokens=False).input_ids
        for _ in range(300)
    ]
    for case in cases:
        updates, _ = stream(tokenizer, case, rng)
        assert "".join(u.text for u in updates) == tokenizer.decode(case, skip_special_tokens=True), case
    words = _ids(tokenizer, "Hello", " Human", " over", " do", " n", "'t")  # "Human" ends in "n", "over" in "r"
    for stop in ("Human", "over"):
        _, detok = stream(tokenizer, words, stop=[stop])
        assert detok.token_ids == words[: next(k for k in range(len(words) + 1)
                                               if stop in tokenizer.decode(words[:k]))]  # found on its token
    updates, _ = stream(tokenizer, words)
    assert [u.text for u in updates][-3:] == ["", "n't", ""]  # " n" waits: " n't" becomes "n't"
    for parts in (("I do", " n", " '", " t"), ("x", "  '", " v", "e")):  # " ' " rewrites that chain into a pattern
        ids = _ids(tokenizer, *parts)
        updates, _ = stream(tokenizer, ids)
        assert "".join(u.text for u in updates) == tokenizer.decode(ids), parts


def _ids(tokenizer: Any, *parts: str) -> list[int]:
    """Ids of ``parts`` encoded separately, so that token boundaries fall between the parts."""
    return [i for part in parts for i in tokenizer(part, add_special_tokens=False).input_ids]


@pytest.mark.parametrize("chunked", [False, True])
def test_stop_string_split_across_tokens(byte_level: Any, chunked: bool) -> None:
    ids = _ids(byte_level, "héllo wö", "rld and more")
    stop_at = next(k for k in range(len(ids) + 1) if "wörld" in byte_level.decode(ids[:k]))
    updates, detok = stream(byte_level, ids, random.Random(1) if chunked else None, stop=["wörld"])
    assert detok.output_text == "".join(u.text for u in updates) == "héllo "
    assert detok.stop_string == "wörld"
    assert [u.stop_string for u in updates if u.stop_string] == ["wörld"]
    assert detok.token_ids == ids[:stop_at]
    assert all("w" not in u.text for u in updates)  # "w" could start the stop string: held back


def test_double_newline_stop_string(byte_level: Any) -> None:
    ids = _ids(byte_level, "line one\n", "\nline two")
    updates, detok = stream(byte_level, ids, stop=["\n\n"])
    assert detok.output_text == "line one"
    assert detok.stop_string == "\n\n"
    assert "\n" not in "".join(u.text for u in updates)


def test_include_stop_str_in_output(byte_level: Any) -> None:
    ids = _ids(byte_level, "héllo wö", "rld and more")
    _, detok = stream(byte_level, ids, stop=["wörld"], include_stop_str_in_output=True)
    assert detok.output_text == "héllo wörld"
    assert detok.stop_string == "wörld"


def test_held_back_text_is_released_at_finish(byte_level: Any) -> None:
    ids = _ids(byte_level, "hello wor")
    updates, detok = stream(byte_level, ids, stop=["world!"])
    assert "".join(u.text for u in updates[:-1]) == "hello "
    assert updates[-1] == DetokenizerUpdate("wor", None)
    assert detok.output_text == "hello wor" and detok.stop_string is None


def test_text_that_cannot_start_a_stop_string_is_not_held(byte_level: Any) -> None:
    ids = _ids(byte_level, MULTIBYTE)
    plain, _ = stream(byte_level, ids)
    with_stop, _ = stream(byte_level, ids, stop=["zzz"])
    assert [u.text for u in with_stop] == [u.text for u in plain]


def test_stop_strings_with_special_tokens_kept(byte_level: Any) -> None:
    ids = [*_ids(byte_level, "answer"), 3, *_ids(byte_level, "more")]
    _, detok = stream(byte_level, ids, stop=["<|user|>"], skip_special_tokens=False)
    assert (detok.output_text, detok.stop_string) == ("answer", "<|user|>")
    _, skipped = stream(byte_level, ids, stop=["<|user|>"], skip_special_tokens=True)
    assert (skipped.output_text, skipped.stop_string) == ("answermore", None)


@pytest.mark.parametrize("skip", [True, False])
def test_the_stop_token_that_ended_a_request_has_no_text(byte_level: Any, skip: bool) -> None:
    """vLLM's rule: the EOS / stop_token_ids token that ended a request stays in token_ids without its text, a
    special one (skip_special_tokens=False) or a plain one (a newline), unless include_stop_str_in_output."""
    for stop_id in (3, _ids(byte_level, "\n")[0]):
        ids = [*_ids(byte_level, "answer"), stop_id]
        for include, expected in ((False, "answer"), (True, byte_level.decode(ids, skip_special_tokens=skip))):
            detok = IncrementalDetokenizer(byte_level, [1], SamplingParams(skip_special_tokens=skip,
                                                                           include_stop_str_in_output=include))
            text = detok.update(ids[:2], False).text + detok.update(ids[2:], True, stop_terminated=True).text
            assert (text, detok.output_text, detok.token_ids) == (expected, expected, ids)
    assert byte_level.decode([3], skip_special_tokens=False) and byte_level.decode(_ids(byte_level, "\n"))


def test_stop_strings_ignored_during_min_tokens(byte_level: Any) -> None:
    ids = _ids(byte_level, "ab", "c", "ab", "c")
    n_first = len(_ids(byte_level, "ab", "c"))
    _, detok = stream(byte_level, ids, stop=["abc"], min_tokens=n_first)
    assert (detok.output_text, detok.stop_string) == ("abc", "abc")
    _, eager = stream(byte_level, ids, stop=["abc"])
    assert (eager.output_text, eager.token_ids) == ("", ids[:n_first])


def test_a_stop_string_may_begin_during_min_tokens(byte_level: Any) -> None:
    """vLLM's rule: a stop string counts once it ends after the first min_tokens tokens' text, wherever it begins
    (that text is held back as any text that may begin one); one wholly inside it does not."""
    ids = _ids(byte_level, "x", "a", "b", "c", "d")
    deltas, detok = stream(byte_level, ids, stop=["abc"], min_tokens=2)  # "x", "a"; the match ends in "c"
    assert (detok.output_text, detok.stop_string, detok.token_ids) == ("x", "abc", ids[:4])
    assert "a" not in "".join(update.text for update in deltas)
    _, inside = stream(byte_level, _ids(byte_level, "a", "b", "c", "d"), stop=["ab"], min_tokens=2)
    assert (inside.output_text, inside.stop_string) == ("abcd", None)
    matcher = StopStringMatcher(["ab", "xaby"], False)
    assert matcher.push("xab", match=False) == ("", None)  # "xab" may begin "xaby"
    assert matcher.push("z") == ("xabz", None)  # "ab" lay wholly in the text pushed without matching


def test_updates_after_a_stop_consume_nothing(byte_level: Any) -> None:
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["b"]))
    first = detok.update(_ids(byte_level, "a", "b", "c"), False)
    assert first == DetokenizerUpdate("a", "b")
    consumed = list(detok.token_ids)
    assert detok.update(_ids(byte_level, "xyz"), True) == DetokenizerUpdate("", None)
    assert detok.token_ids == consumed and detok.output_text == "a" and detok.stop_string == "b"


def test_matcher_picks_earliest_start_then_shortest() -> None:
    assert StopStringMatcher(["cd", "abc"], False).push("xabcd") == ("x", "abc")
    assert StopStringMatcher(["abc", "ab"], True).push("xabcd") == ("xab", "ab")


def test_matcher_holds_longest_partial_prefix_only() -> None:
    matcher = StopStringMatcher(["hello", "lol"], False)
    assert matcher.push("xxhel") == ("xx", None)  # "hel" may start "hello"
    assert matcher.push("lx") == ("hellx", None)
    assert matcher.push("lo") == ("", None)  # "lo" may start "lol"
    assert matcher.push("l") == ("", "lol")
