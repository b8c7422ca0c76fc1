"""`SpacesCleanup` (the detokenizer's clean-up stage) on drawn text cut into drawn tokens, against a reference.

Reference, from the module docstring and docs/sampling.md (`stop`): transformers' own ``clean_up_tokenization``
(an instance method in transformers 5 that never reads ``self``) applied to the whole text. After every push, all
text up to the first space of the trailing run of " n'vr" characters (the only text a later token can still
rewrite) is released, cleaned, and the rest waits (`first_held_owner` names its first character's token); flush
releases the rest. Checked: the released text adds up to clean-up of everything pushed, whatever the cut; nothing
released is retracted (each release extends a prefix of the final text); owners are released in order and never
ahead of their push; each kept character is owned by the first token (piece) whose text has it, as if the whole text
were split at once. `_split_by_owner` is also checked on its own (drawn pieces, and the fallback for a clean-up that
is not a deletion of characters), `cleanup_applies` on tokenizers trained on the fly, and, end to end through
`IncrementalDetokenizer` with a forced clean-up tokenizer, that a stop string counts by the token owning the last
character of its first match (past ``min_tokens``): the ids after it are dropped and the text stops before it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.engine.spaces_cleanup import SpacesCleanup, _split_by_owner, cleanup_applies
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint

settings.register_profile("spaces_cleanup_mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("SPACES_CLEANUP_NO_SHRINK"):
    settings.load_profile("spaces_cleanup_mutations")

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "150"))
SETTINGS: dict[str, Any] = {"deadline": None, "max_examples": EXAMPLES,
                            "derandomize": "PROP_EXAMPLES" not in os.environ,  # fixed in CI
                            "suppress_health_check": [HealthCheck.too_slow]}

# ------------------------------------------------------------------ reference (from the docs)

TAIL_CHARS = " n'vr"
"""What every proper prefix of a clean-up pattern (" .", " n't", " 've", ...) is made of (the module docstring)."""


def clean(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (it never reads ``self``)."""
    return PreTrainedTokenizerBase.clean_up_tokenization(None, text)  # type: ignore[arg-type]


def hold_start(raw: str) -> int:
    """Where the held text starts in all text pushed: the first space of its trailing run of " n'vr" characters."""
    run = len(raw)
    while run and raw[run - 1] in TAIL_CHARS:
        run -= 1
    space = raw.find(" ", run)
    return len(raw) if space < 0 else space


def first_owners(cleaned: str, raw: str, owner_of: list[int]) -> list[int]:
    """The owner of each character of ``cleaned`` (``raw`` less some characters): the first raw one that has it."""
    owners, i = [], 0
    for char in cleaned:
        while raw[i] != char:
            i += 1
        owners.append(owner_of[i])
        i += 1
    return owners


def char_owners(pieces: list[tuple[int, str]]) -> list[int]:
    return [owner for owner, text in pieces for _ in text]


def joined(pieces: list[tuple[int, str]]) -> str:
    return "".join(text for _, text in pieces)


# ------------------------------------------------------------------ strategies

ALPHABET = list("      ...??!!,,''nnttmmssvveerrdd") + ["a", "K", "é", "\n", "x"]
pieces_st = st.lists(st.text(st.sampled_from(ALPHABET), max_size=5), min_size=1, max_size=12)


# ------------------------------------------------------------------ SpacesCleanup against the reference


def check_stream(pieces: list[str]) -> None:
    cleanup = SpacesCleanup(clean)
    raw, owner_of, released = "", [], []
    final = clean("".join(pieces))
    for owner, piece in enumerate(pieces, 1):
        out = cleanup.push(owner, piece)
        raw += piece
        owner_of += [owner] * len(piece)
        check_release(released, out, owner)
        released += out
        start = hold_start(raw)
        assert joined(released) == clean(raw[:start]), (raw, released)
        assert final.startswith(joined(released))  # nothing released is retracted
        assert cleanup.first_held_owner == (owner_of[start] if start < len(raw) else None), (raw, start)
    out = cleanup.flush()
    check_release(released, out, len(pieces))
    released += out
    assert cleanup.first_held_owner is None and cleanup.flush() == []
    assert joined(released) == final
    assert char_owners(released) == first_owners(final, raw, owner_of), released


def check_release(before: list[tuple[int, str]], out: list[tuple[int, str]], pushed: int) -> None:
    owners = [owner for owner, _ in before[-1:] + out]
    assert owners == sorted(owners), (before, out)
    assert all(1 <= owner <= pushed for owner, _ in out), (out, pushed)


@settings(**SETTINGS)
@given(pieces_st)
@example([" n", "'t"])
@example(["do", " n", "", " ", "know"])
@example(["a ", " ' ", "s"])  # " ' " -> "'" joins the space before it: "a 's" -> "a's"
@example(["a", " ", " ", "'", " ", "s"])
@example(["x", " ", ".", " ", "."])
@example(["", " n", "", "x n", "'", "ve", ""])
@example(["ab n", "'", "t ?"])
@example(["a  ", "' ", "' s"])
@example([" ", "re"])
def test_stream_matches_whole_text_cleanup(pieces: list[str]) -> None:
    check_stream(pieces)


@settings(**SETTINGS)
@given(st.text(st.sampled_from(ALPHABET), max_size=30), st.data())
def test_any_cut_of_one_text(text: str, data: st.DataObject) -> None:
    """One text, drawn cuts (empty pieces included): the same released text."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    check_stream([text[a:b] for a, b in zip(bounds, bounds[1:])])


def test_hold_is_bounded_as_documented() -> None:
    """The docstring's examples: "Human" goes out whole; "do n '" waits from its " n"."""
    cleanup = SpacesCleanup(clean)
    assert cleanup.push(1, "Human") == [(1, "Human")] and cleanup.first_held_owner is None
    assert cleanup.push(2, "do") == [(2, "do")]
    assert cleanup.push(3, " n") == [] and cleanup.first_held_owner == 3
    assert cleanup.push(4, " '") == [] and cleanup.first_held_owner == 3  # "do n '" waits from " n"
    assert cleanup.push(5, "s") == [(3, " n"), (4, "'"), (5, "s")] and cleanup.first_held_owner is None
    assert cleanup.push(6, " n") == [] and cleanup.push(7, "'") == [] and cleanup.first_held_owner == 6
    assert cleanup.push(8, "t") == [(6, "n"), (7, "'"), (8, "t")]  # " n't" -> "n't"


# ------------------------------------------------------------------ the split by owner


@settings(**SETTINGS)
@given(st.lists(st.text(st.sampled_from(ALPHABET), max_size=4), min_size=2, max_size=6))
@example(["a ", " ."])  # a space kept of two goes to the first
@example(["a", " ", " ."])
@example(["", " n", "'t"])
def test_split_by_owner(texts: list[str]) -> None:
    pieces = list(enumerate(texts, 1))
    raw = "".join(texts)
    owner_of = [owner for owner, text in pieces for _ in text]
    cleaned = clean(raw)
    out = _split_by_owner(pieces, cleaned)
    assert [owner for owner, _ in out] == [owner for owner, _ in pieces]
    assert joined(out) == cleaned and char_owners(out) == first_owners(cleaned, raw, owner_of)


def test_a_cleanup_that_is_no_deletion_goes_to_the_last_owner() -> None:
    """A tokenizer's own clean-up whose text is not the input less some characters: all to the last owner."""
    assert _split_by_owner([(1, "ab"), (2, " c")], "AB C") == [(2, "AB C")]
    cleanup = SpacesCleanup(str.upper)
    assert cleanup.push(1, "ab") == [(1, "AB")]
    assert cleanup.push(2, " n") == []
    assert cleanup.push(3, "x") == [(3, " NX")]


# ------------------------------------------------------------------ cleanup_applies on tokenizers trained here

CORPUS = ["a . b n't do it , ok ? yes ! I 'm he 's we 've they 're"] * 3


def wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"],
                                                             show_progress=False))
    return tok


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.mark.parametrize(("build", "flag", "applies"), [
    (wordpiece, True, True), (wordpiece, False, False), (byte_level_bpe, False, False),
    (byte_level_bpe, True, False),  # transformers 5 skips it for BPE (with a warning)
])
def test_cleanup_applies(build: Any, flag: bool, applies: bool) -> None:
    kwargs = {"unk_token": "[UNK]"} if build is wordpiece else {}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build(), clean_up_tokenization_spaces=flag, **kwargs)
    assert cleanup_applies(tokenizer) is applies


# ------------------------------------------------------------------ end to end: stop strings count by token

WORDS = ["I", " do", " n", "'t", " .", " know", " ,", " '", " s", " ve", " re", " ?", " !", "x", " m", " "]


@pytest.fixture(scope="module")
def cleaning() -> Any:
    return AutoTokenizer.from_pretrained(
        tiny_checkpoint("llama"), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)


def reference_stop(tokenizer: Any, ids: list[int], stop: str, min_tokens: int) -> tuple[str, str | None, list[int]]:
    """(text, stop string, ids kept): the first match (by where it ends) whose last character's owner is past
    ``min_tokens`` ends the request; the text stops before it and the ids after that owner are dropped."""
    texts = [tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False) for k in range(len(ids) + 1)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # ASCII: each token only adds text
    raw = texts[-1]
    owner_of = [k for k in range(1, len(ids) + 1) for _ in texts[k][len(texts[k - 1]):]]
    final = clean(raw)
    owners = first_owners(final, raw, owner_of)
    for end in range(len(stop), len(final) + 1):
        if final[end - len(stop):end] == stop and owners[end - 1] > min_tokens:
            return final[:end - len(stop)], stop, ids[:owners[end - 1]]
    return final, None, ids


@settings(**{**SETTINGS, "max_examples": max(EXAMPLES // 3, 10)})
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=8), st.data())
def test_stop_string_counts_by_the_token_that_completed_it(cleaning: Any, words: list[str],
                                                           data: st.DataObject) -> None:
    ids = cleaning("".join(words), add_special_tokens=False).input_ids
    final = cleaning.decode(ids)
    assert final == clean(cleaning.decode(ids, clean_up_tokenization_spaces=False))
    start = data.draw(st.integers(0, max(len(final) - 1, 0)))
    stop = data.draw(st.one_of(st.just(final[start:start + 4]), st.sampled_from(["n'", "'t", ". ", "do n", "s"])))
    min_tokens = data.draw(st.integers(0, 3))
    if not stop:
        stop = "zz"
    detok = IncrementalDetokenizer(cleaning, [], SamplingParams(stop=[stop], min_tokens=min_tokens))
    texts = [detok.update([token_id], False).text for token_id in ids] + [detok.update([], True).text]
    assert ("".join(texts), detok.stop_string, detok.token_ids) == reference_stop(cleaning, ids, stop, min_tokens)
