"""The decode stream holds a bounded window: a run of invalid UTF-8 is released as decode() shows it once more ids
are held than can complete a character, and skipped special tokens never enter the window (the cost of a token does
not grow with the run)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from asyncllm.engine import decode_stream
from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint
from test_detokenizer import SlowTokenizerView, byte_ids, fast_of, sentencepiece_style_tokenizer

BOUND = decode_stream._MAX_HELD_IDS


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    llama2 = sentencepiece_style_tokenizer("llama2")
    return {
        "byte_level": AutoTokenizer.from_pretrained(tiny_checkpoint("llama")),
        "llama2": llama2,
        "slow_view": SlowTokenizerView(llama2),
    }


def _word(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` after a word (its leading space a byte-level "Ġ" or a SentencePiece "▁")."""
    fast = fast_of(tokenizer)
    return fast("a" + text, add_special_tokens=False).input_ids[len(fast("a", add_special_tokens=False).input_ids):]


def _run(tokenizer: Any, ids: list[int], skip: bool = True,
         window: bool = False) -> tuple[list[str], IncrementalDetokenizer, int]:
    """Step ``ids`` one by one; the texts (the finishing flush last), the detokenizer and the most ids its decode
    stream held after a step (at most `BOUND`) or decoded as context (the ids of the last piece: one more).
    ``window``: a fast tokenizer's stream on the Python window, as after DecodeStream refused a step."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    if window:
        detok._stream._decode_stream = None
    texts, held = [], 0
    for token_id in ids:
        texts.append(detok.update([token_id], False).text)
        held = max(held, len(detok._stream._pending), len(detok._stream._context) - 1)
    texts.append(detok.update([], True).text)
    return texts, detok, held


@pytest.mark.parametrize("name", ["byte_level", "llama2", "slow_view"])
def test_an_invalid_run_is_released_as_decode_shows_it(tokenizers: dict[str, Any], name: str) -> None:
    tokenizer = tokenizers[name]
    ids = byte_ids(tokenizer, b"\x80" * 200)
    texts, detok, held = _run(tokenizer, ids)
    assert held <= BOUND
    assert "".join(texts[:-1]).count("\ufffd") >= 200 - BOUND  # streamed as it goes, not at the finish
    assert detok.output_text == fast_of(tokenizer).decode(ids) == "\ufffd" * 200


@pytest.mark.parametrize("name", ["byte_level", "llama2", "slow_view"])
def test_a_character_after_an_invalid_run_is_whole(tokenizers: dict[str, Any], name: str) -> None:
    """Wherever the cut falls, the character that follows the run (its bytes held across it) shows whole, and the
    text is decode()'s."""
    tokenizer = tokenizers[name]
    word = _word(tokenizer, " the")
    for run in range(2 * BOUND + 2):
        for char in ("中", "🙂"):
            ids = [*byte_ids(tokenizer, b"\x80" * run + char.encode()), *word]
            texts, detok, held = _run(tokenizer, ids)
            decoded = fast_of(tokenizer).decode(ids)
            assert held <= BOUND, run
            assert detok.output_text == "".join(texts) == decoded, (run, char)
            assert decoded.endswith(char + " the") == (name == "byte_level" or run == 0)  # byte fallback: all U+FFFD


@pytest.mark.parametrize("name", ["byte_level", "llama2"])
def test_skipped_special_tokens_never_enter_the_window(tokenizers: dict[str, Any], name: str) -> None:
    """A run of EOS (ignore_eos) holds nothing, and the word after it keeps its space."""
    tokenizer = tokenizers[name]
    hello, world = tokenizer("Hello", add_special_tokens=False).input_ids, _word(tokenizer, " world")
    ids = [*hello, *[tokenizer.eos_token_id] * 100, *world]
    texts, detok, held = _run(tokenizer, ids)
    assert held <= len(hello + world)
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    _, kept, _ = _run(tokenizer, ids, skip=False)
    assert kept.output_text == tokenizer.decode(ids, skip_special_tokens=False)


def _chained_emoji_tokenizer() -> tuple[Any, list[int]]:
    """A byte-level BPE tokenizer with the tokens [F0 9F 98], [82 F0 9F 98] and [82] (ids returned): each token but
    the last ends one 😂 (F0 9F 98 82) and begins the next, so the text keeps ending inside a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    vocab = {char[b]: b for b in range(256)}
    pieces = ["".join(char[b] for b in data) for data in (b"\xf0\x9f\x98", b"\x82\xf0\x9f\x98", b"\x82")]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend), [vocab[piece] for piece in pieces]


@pytest.mark.parametrize("window", [False, True], ids=["decode_stream", "window"])
def test_valid_text_ending_inside_a_character_is_held_whole(window: bool) -> None:
    """Past the bound, text that ends in one U+FFFD only is a character still to complete, not invalid bytes: held
    (as vLLM's DecodeStream), never cut into a U+FFFD that decode() does not show."""
    tokenizer, (first, chained, last) = _chained_emoji_tokenizer()
    for n in range(1, 31):
        ids = [first, *[chained] * (n - 1), last]
        texts, detok, _ = _run(tokenizer, ids, window=window)
        assert tokenizer.decode(ids) == "😂" * n
        assert detok.output_text == "".join(texts) == "😂" * n, n
        assert texts[-2] == "😂" * n and not "".join(texts[:-2]), n  # released whole on the completing token
        invalid = [*ids[:-1], *byte_ids(tokenizer, b"\xc0" * 3), last]  # then invalid bytes: the chain cut whole
        texts, detok, _ = _run(tokenizer, invalid, window=window)
        assert detok.output_text == "".join(texts) == tokenizer.decode(invalid), n
