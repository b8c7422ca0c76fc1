"""The detokenizer's decode stage on drawn token ids (hypothesis): the decode streams of
asyncllm/engine/decode_stream.py, the added-token rules of added_tokens.py and `IncrementalDetokenizer` without stop
strings, against a token-by-token reference written from their docstrings.

Drawn: a tokenizer (the tiny byte-level BPE with two non-special added tokens and one more special token, on
tokenizers' ``DecodeStream``; the same behind a slow-tokenizer view, on the Python window over ``decode``; a
Llama-2-like byte-fallback one with an added token, on the window over the Rust decode; a WordPiece one whose
decoder puts a space before added tokens, on ``DecodeStream``; GPT-SW3's slow sentencepiece tokenizer, on the window
over its ``decode``), a prompt and an output made of segments (encoded text with multi-byte characters, special and
added tokens, one id per UTF-8 byte of a character's first or last bytes, runs of an invalid byte, whitespace-only
pieces in a row, any id, ids past the vocabulary), ``skip_special_tokens``, ``spaces_between_special_tokens``,
the chunking of the output (1 to 5 ids an update, as speculative decoding delivers them) and whether the last id
is the stop token that ended the request.

The reference (the module docstrings' rules): the stream continues the prompt's last ids S (all of a prompt of 4 or
fewer, else the shortest of its last 4 to 23 whose text decodes whole, none when none does); D_k, the text of the
first k output ids, is ``decode(S + out[:k])`` past ``decode(S)`` (ids past the vocabulary decode to nothing); after
token k the text shown so far is D_k as soon as D_k does not end in U+FFFD, else what was shown before (a character
is held until whole); the finish flushes D_n past what was shown, U+FFFD included. Skipped special ids never enter
the window; with ``spaces_between_special_tokens=False`` and special tokens kept, an added token right after another
(the prompt's last id counting for the first output token) shows as its bare content. The stop token that ended the
request shows no text and stays in ``token_ids``.

Exactly equal (every step's delta and the flush, of the raw stream and of the detokenizer's updates) wherever the
docstrings promise decode()'s text: every D_k less its trailing U+FFFDs is a prefix of the final text (so not a
byte-fallback run that turns invalid after characters of it were shown), the prompt's context does not end inside a
character (what the output then shows of it is not specified), and no more than 8 ids are held with invalid text
(the hold's bound; ids past the vocabulary, like skipped special ids, never enter the window, so they do not count:
`test_a_character_around_ids_past_the_vocabulary_stays_whole`, which failed before 2026-12-07). Elsewhere: the text
before the first U+FFFD and after the last is decode()'s (GPT-SW3's with special tokens kept: but for spaces, as its
decode puts spaces before text shown already). Always: the deltas are the same
whatever the chunking, and add up to ``output_text``. Set DECODE_STREAM_PROPERTY_PROFILE=mutation to run without
shrinking.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncllm.engine.decode_stream import make_stream
from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint
from test_detokenizer import byte_ids, fast_of, sentencepiece_style_tokenizer

FFFD = "\ufffd"
HELD_BOUND = 8
"""The most ids held with invalid text (the detokenizer's docstring: "more than 8 ids ... held")."""
ALPHABET = "ab xyz.,\n" + "éö✓日本🙂"
MULTIBYTE = ["é", "✓", "日", "🙂", "ö"]
NAMES = ["byte_level", "byte_level_window", "llama2", "wordpiece", "gpt_sw3"]
_PROFILE = os.environ.get("DECODE_STREAM_PROPERTY_PROFILE", "")
"""``mutation``: no shrinking (a failing example is reported at once)."""
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate] if _PROFILE == "mutation" else list(Phase)


class SlowView:
    """A slow tokenizer's API over a fast one (no ``_tokenizer``): drives the Python window over ``decode``."""

    clean_up_tokenization_spaces = False

    def __init__(self, fast: Any) -> None:
        self._fast = fast
        self.added_tokens_decoder = fast.added_tokens_decoder
        self.all_special_ids = fast.all_special_ids

    def __len__(self) -> int:
        return len(self._fast)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self._fast.decode(ids, **kwargs)


def _byte_level() -> Any:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_tokens(["<tool>", " ✓✓"])  # added, not special: kept by skip_special_tokens
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    return tokenizer


def _llama2() -> Any:
    tokenizer = sentencepiece_style_tokenizer("llama2")
    tokenizer.add_tokens(["<tool>"])
    return tokenizer


def _wordpiece() -> Any:
    """A BERT-like tokenizer trained here; its decoder joins tokens with spaces, before added tokens too."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    corpus = ["hello worlds, héllo wörld ✓ 日本 🙂 and more text. " * 3, "ab xyz ab, xy az ba"] * 5
    backend.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]"],
                                                                  show_progress=False))
    backend.decoder = decoders.WordPiece(cleanup=False)
    backend.add_special_tokens(["[CLS]", "[SEP]"])
    backend.add_tokens(["<tool>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False)


def _gpt_sw3(folder: Any) -> Any:
    """A real slow tokenizer (sentencepiece, byte fallback) trained here: GPT-SW3's, whose decode puts a space
    before the text that precedes a special token (not prefix-stable: the stream decodes added tokens apart)."""
    import sentencepiece as spm
    from transformers import GPTSw3Tokenizer

    corpus = ["Hello world, this is a small corpus. héllo wörld ✓ 日本", "The quick brown fox.\nab xyz"] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(folder / "sp"), vocab_size=360, byte_fallback=True,
        model_type="bpe", user_defined_symbols=["<s>", "<|endoftext|>", "<pad>"], character_coverage=1.0,
        minloglevel=2)
    tokenizer = GPTSw3Tokenizer(str(folder / "sp.model"))
    tokenizer.add_tokens(["<tool>"])
    return tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    byte_level = _byte_level()
    return {"byte_level": byte_level, "byte_level_window": SlowView(byte_level), "llama2": _llama2(),
            "wordpiece": _wordpiece(), "gpt_sw3": _gpt_sw3(tmp_path_factory.mktemp("sw3"))}


def _added(tokenizer: Any, special: bool) -> list[int]:
    """The ids of the tokenizer's added tokens, special or not."""
    return sorted(i for i, token in tokenizer.added_tokens_decoder.items() if token.special == special)


def skipped_ids(tokenizer: Any) -> set[int]:
    """The ids skip_special_tokens drops (`special_ids`' docstring): a fast tokenizer's special added tokens, a slow
    one's ``all_special_ids``."""
    return set(_added(tokenizer, True)) if hasattr(tokenizer, "_tokenizer") else set(tokenizer.all_special_ids)


def _space_id(tokenizer: Any) -> list[int]:
    """The token of a lone space (SentencePiece's "▁", byte-level "Ġ"), if the tokenizer has one."""
    vocab = fast_of(tokenizer).get_vocab()
    return [vocab[piece] for piece in ("▁", "Ġ") if piece in vocab][:1]


def resolve(tokenizer: Any, segments: list[tuple]) -> list[int]:
    """The ids of drawn segments (tokenizer-independent descriptions) for ``tokenizer``."""
    fast = fast_of(tokenizer)
    ids: list[int] = []
    for kind, value, *rest in segments:
        if kind == "text":
            ids += fast(value, add_special_tokens=False).input_ids
        elif kind in ("special", "added"):
            pool = _added(tokenizer, kind == "special")
            ids += [pool[value % len(pool)]] if pool else []
        elif kind == "bytes":  # the first (n > 0) or last (n < 0) bytes of a character, one id each
            data = value.encode()
            ids += byte_ids(tokenizer, data[: rest[0]] if rest[0] > 0 else data[rest[0]:])
        elif kind == "run":  # a run of one invalid byte (a continuation byte, or one UTF-8 never uses)
            ids += byte_ids(tokenizer, bytes([value]) * rest[0])
        elif kind == "space":  # whitespace-only pieces, one after another
            ids += _space_id(tokenizer) * value
        elif kind == "id":
            ids.append(value % len(fast))
        else:  # "oov": ids past the vocabulary (a padded model samples them)
            ids += [len(fast) + i for i in range(value)]
    return ids


def ref_decode(tokenizer: Any, ids: list[int], skip: bool) -> str:
    """decode() as the docs take it: ids past the vocabulary decode to nothing."""
    fast = fast_of(tokenizer)
    return fast.decode([i for i in ids if 0 <= i < len(fast)], skip_special_tokens=skip)


def prompt_suffix(decode: Any, prompt: list[int]) -> list[int]:
    """The docstring's rule: all of a prompt of 4 or fewer, else the shortest of its last 4 to 23 ids whose text has
    no U+FFFD, else none."""
    if len(prompt) <= 4:
        return list(prompt)
    return next((prompt[-n:] for n in range(4, min(len(prompt), 23) + 1) if FFFD not in decode(prompt[-n:])), [])


class Expected(NamedTuple):
    deltas: list[str]
    """Each output id's text."""
    flush: str
    exact: bool
    """Whether the docstrings promise exactly these texts (see the module docstring)."""
    whole: str
    """D_n: decode()'s text of the output after the prompt's context."""
    around: bool
    """Whether, when not exact, the text around U+FFFD runs is still decode()'s (the context decodes whole)."""


def reference(tokenizer: Any, prompt: list[int], out: list[int], skip: bool, spaces: bool) -> Expected:
    """Token by token: each id shows D_k past what was shown once D_k does not end in U+FFFD."""
    decode = lambda ids: ref_decode(tokenizer, ids, skip)  # noqa: E731
    skipped = skipped_ids(tokenizer) if skip else set()
    context = prompt_suffix(decode, prompt)
    base = decode(context)
    stable = not base.endswith(FFFD)  # a prompt's character completed by the output: not specified
    bounded = True
    shown, held, deltas, texts, past_vocabulary = "", [], [], [""], len(fast_of(tokenizer))
    for k in range(1, len(out) + 1):
        full = decode(context + out[:k])
        stable = stable and full.startswith(base)
        texts.append(text := full[len(base):])
        if out[k - 1] in skipped or out[k - 1] >= past_vocabulary:  # never in the window
            deltas.append("")
            continue
        held.append(out[k - 1])
        pending = text[len(shown):] if text.startswith(shown) else FFFD + FFFD
        if pending and not pending.endswith(FFFD):
            deltas.append(pending)
            shown, held = text, []
        else:
            deltas.append("")
            if len(held) > HELD_BOUND and (not pending or FFFD in pending[:-1]):
                bounded = False
    whole = texts[-1]
    exact = stable and bounded and all(whole.startswith(t.rstrip(FFFD)) for t in texts)
    if not skip and not spaces:
        deltas = joined(tokenizer, prompt, out, deltas)
    around = stable and (skip or spaces)
    return Expected(deltas, whole[len(shown):], exact, whole, around)


def joined(tokenizer: Any, prompt: list[int], out: list[int], deltas: list[str]) -> list[str]:
    """vLLM's ``spaces_between_special_tokens=False``: an added token right after another shows its bare content."""
    contents = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    last = bool(prompt) and prompt[-1] in contents
    result = []
    for token_id, delta in zip(out, deltas):
        result.append(contents[token_id] if token_id in contents and last else delta)
        last = token_id in contents
    return result


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """``ids`` cut into updates of ``sizes`` (cycled), the last update possibly empty (a finish with no new id)."""
    chunks, i, n = [], 0, 0
    while i < len(ids):
        size = sizes[n % len(sizes)]
        chunks.append(ids[i:i + size])
        i, n = i + size, n + 1
    return chunks or [[]]


def run_stream(tokenizer: Any, prompt: list[int], out: list[int], params: SamplingParams) -> tuple[list[str], str]:
    """The raw decode stream (`make_stream`), primed with the prompt, stepped one id at a time, then flushed."""
    stream = make_stream(tokenizer, params)
    if prompt:
        stream.prime(prompt)
    return [stream.step(token_id) for token_id in out], stream.flush()


def run_detokenizer(tokenizer: Any, prompt: list[int], out: list[int], params: SamplingParams,
                    chunks: list[list[int]], stop_terminated: bool) -> tuple[list[str], IncrementalDetokenizer]:
    """The detokenizer's update texts over ``chunks``, the last update finishing (and stop-terminated)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    texts = [detok.update(chunk, False).text for chunk in chunks[:-1]]
    texts.append(detok.update(chunks[-1], True, stop_terminated=stop_terminated).text)
    assert "".join(texts) == detok.output_text
    assert detok.token_ids == out
    return texts, detok


def group(deltas: list[str], flush: str, chunks: list[list[int]]) -> list[str]:
    """Per-id deltas summed over the updates they arrive in, the flush added to the last."""
    texts, i = [], 0
    for chunk in chunks:
        texts.append("".join(deltas[i:i + len(chunk)]))
        i += len(chunk)
    texts[-1] += flush
    return texts


def assert_around_the_runs(whole: str, streamed: str) -> None:
    """Outside exactness, the text before the first U+FFFD and after the last is decode()'s."""
    if FFFD not in whole:
        assert streamed == whole
        return
    head, tail = whole.split(FFFD, 1)[0], whole.rsplit(FFFD, 1)[1]
    assert streamed.startswith(head) and streamed.endswith(tail) and FFFD in streamed


SEGMENT = st.one_of(
    st.tuples(st.just("text"), st.text(ALPHABET, min_size=1, max_size=10)),
    st.tuples(st.just("text"), st.text(ALPHABET, min_size=1, max_size=10)),
    st.tuples(st.just("special"), st.integers(0, 9)),
    st.tuples(st.just("added"), st.integers(0, 9)),
    st.tuples(st.just("bytes"), st.sampled_from(MULTIBYTE), st.sampled_from([1, 2, 3, 4, -1, -2, -3])),
    st.tuples(st.just("run"), st.sampled_from([0x80, 0xBF, 0xC0, 0xFF]), st.integers(1, 12)),
    st.tuples(st.just("space"), st.integers(1, 4)),
    st.tuples(st.just("id"), st.integers(0, 2**16)),
    st.tuples(st.just("oov"), st.integers(1, 10)),
)
CASES = st.tuples(
    st.sampled_from(NAMES),
    st.one_of(st.just([]), st.lists(SEGMENT, min_size=1, max_size=4)),  # the prompt (none: not primed)
    st.lists(SEGMENT, min_size=1, max_size=6),  # the output
    st.booleans(),  # skip_special_tokens
    st.booleans(),  # spaces_between_special_tokens
    st.lists(st.integers(1, 5), min_size=1, max_size=4),  # update sizes
    st.booleans(),  # stop-terminated
)


@settings(max_examples=1200, deadline=None, phases=_PHASES, derandomize=_PROFILE != "mutation")
@given(case=CASES)
# a 4-byte emoji one byte token at a time after a prompt, held until whole, several ids an update
@example(case=("byte_level", [("text", "Hi ✓")], [("bytes", "🙂", 4), ("text", " ok")], True, True, [2], False))
@example(case=("llama2", [("text", "Hi ✓")], [("bytes", "🙂", 4), ("text", " ok")], True, True, [3], False))
# the output ends inside a character: flushed as decode() shows it
@example(case=("byte_level", [], [("text", "a"), ("bytes", "日", 2)], True, True, [1], False))
@example(case=("llama2", [], [("text", "a"), ("bytes", "🙂", 3)], True, True, [1], False))
@example(case=("byte_level_window", [("text", "x")], [("bytes", "✓", 2)], True, True, [1], False))
# added tokens next to each other, kept specials, joined without spaces (WordPiece's decoder spaces them)
@example(case=("wordpiece", [("added", 0)], [("added", 0), ("special", 1), ("text", "ab"), ("special", 0)],
               False, False, [1], False))
@example(case=("byte_level", [("special", 3)], [("added", 1), ("special", 0), ("added", 0)], False, False, [2],
               False))
# SentencePiece's first space: kept after a prompt, dropped without one
@example(case=("llama2", [("text", "The")], [("text", " quick"), ("special", 1)], False, True, [1], True))
@example(case=("llama2", [], [("text", " quick brown")], True, True, [1], False))
# the prompt's context: all of 4 ids (an invalid byte inside), the last 4 of 5, the last 10 (its character whole
# only with its first byte; specials skipped): the output's first space stays (Strip drops it from a text's start)
@example(case=("llama2", [("run", 0x80, 1), ("space", 1), ("special", 1), ("special", 1)], [("text", " quick")],
               False, True, [1], False))
@example(case=("llama2", [("run", 0x80, 1), ("space", 1), ("special", 1), ("special", 1), ("special", 1)],
               [("text", " quick")], False, True, [1], False))
@example(case=("llama2", [("bytes", "🙂", 1), *[("special", 1)] * 6, ("bytes", "🙂", -3)], [("text", " quick")],
               True, True, [1], False))
# an id past the vocabulary, then a whitespace piece: the window's context keeps the text before the space
@example(case=("llama2", [], [("text", "a"), ("oov", 1), ("space", 1), ("text", " b")], True, True, [1], False))
# ids past the vocabulary decode to nothing; a character held across them, past the hold's bound, stays whole
@example(case=("byte_level_window", [], [("oov", 1), ("text", "é"), ("oov", 2)], True, True, [1], False))
@example(case=("byte_level", [], [("bytes", "🙂", 2), ("oov", 9), ("bytes", "🙂", -2)], True, True, [1], False))
# an invalid run past the bound, then a character whose bytes the cut must keep held
@example(case=("byte_level", [], [("run", 0x80, 7), ("bytes", "日", 3), ("text", " the")], True, True, [1], False))
@example(case=("llama2", [], [("run", 0x80, 7), ("bytes", "日", 3), ("text", " the")], True, True, [1], False))
# whitespace-only pieces in a row: SentencePiece's decode drops a text's leading spaces
@example(case=("gpt_sw3", [], [("text", "a"), ("space", 2), ("text", "r")], True, True, [1], False))
# a byte piece's tab decodes alone, the '▁' after it do not (found by a CI run's draw)
@example(case=("gpt_sw3", [], [("id", 14), ("space", 2)], True, True, [1], False))
def test_decode_stream_matches_the_token_by_token_reference(tokenizers: dict[str, Any], case: tuple) -> None:
    """Deltas of the raw stream (one id a step) and of the detokenizer (drawn updates) equal the reference's."""
    name, prompt_segments, out_segments, skip, spaces, sizes, stop_terminated = case
    tokenizer = tokenizers[name]
    prompt, out = resolve(tokenizer, prompt_segments), resolve(tokenizer, out_segments)
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    decoded = out[:-1] if stop_terminated else out  # the stop token that ended the request shows no text
    expected = reference(tokenizer, prompt, decoded, skip, spaces)
    deltas, flush = run_stream(tokenizer, prompt, decoded, params)
    chunks = chunked(out, sizes)
    texts, detok = run_detokenizer(tokenizer, prompt, out, params, chunks, stop_terminated)
    chunks_decoded = [*chunks[:-1], chunks[-1][:-1]] if stop_terminated else chunks
    assert texts == group(deltas, flush, chunks_decoded), "the text depends on the updates' sizes"
    if expected.exact:
        assert (deltas, flush) == (expected.deltas, expected.flush)
        assert all(FFFD not in delta or FFFD in expected.whole for delta in deltas)
    elif expected.around and name == "gpt_sw3" and not skip:  # its decode puts spaces before text shown already
        assert_around_the_runs(expected.whole.replace(" ", ""), "".join(deltas + [flush]).replace(" ", ""))
    elif expected.around:
        assert_around_the_runs(expected.whole, "".join(deltas) + flush)


def test_gpt_sw3_spaces_after_a_byte_piece_stream_as_decode_shows_them(tokenizers: dict[str, Any]) -> None:
    """decode() of the prefixes gives a tab, then one space, then two; the stream must add them one by one (before
    2026-12-07 the tab, a whitespace piece, was no anchor: the window decoded the spaces alone, which SentencePiece
    drops, and the second space was lost)."""
    tokenizer = tokenizers["gpt_sw3"]
    out = resolve(tokenizer, [("id", 14), ("space", 2)])
    assert [ref_decode(tokenizer, out[:k], True) for k in (1, 2, 3)] == ["\t", "\t ", "\t  "]
    assert run_stream(tokenizer, [], out, SamplingParams()) == (["\t", " ", " "], "")


@pytest.mark.parametrize("oov", [6, 9])
def test_a_character_around_ids_past_the_vocabulary_stays_whole(tokenizers: dict[str, Any], oov: int) -> None:
    """Ids past the vocabulary decode to nothing; between the byte tokens of a valid character (byte fallback
    writes one U+FFFD a byte while it is incomplete) they must not turn its hold into a cut: decode() gives the
    emoji, and so must the stream (before 2026-12-07 they counted towards the hold's bound: it showed two U+FFFD
    and nothing for the emoji's last bytes)."""
    tokenizer = tokenizers["llama2"]
    out = resolve(tokenizer, [("bytes", "🙂", 2), ("oov", oov), ("bytes", "🙂", -2)])
    assert ref_decode(tokenizer, out, True) == "🙂"
    deltas, flush = run_stream(tokenizer, [], out, SamplingParams())
    assert "".join(deltas) + flush == "🙂"


def test_the_vocabulary_bound_of_duck_typed_tokenizers() -> None:
    """Ids past the vocabulary start at ``len(tokenizer)`` (or past an added token beyond it); a tokenizer without a
    length has no bound (-1), one without added tokens is bounded by its length alone."""
    from asyncllm.engine.added_tokens import vocabulary_size

    class Sized:
        def __len__(self) -> int:
            return 10

    class Holed(Sized):
        added_tokens_decoder = {3: "<a>", 14: "<b>"}

    assert (vocabulary_size(Sized()), vocabulary_size(Holed()), vocabulary_size(object())) == (10, 15, -1)
