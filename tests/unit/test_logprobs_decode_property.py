"""Property test of the host side of logprobs (asyncllm/engine/logprobs.py): packed rows -> ``{token_id: Logprob}``.

The reference is written from the module's docstrings and docs/sampling.md, not from the implementation:

* each row is a dict whose first key is the row's own token (its logprob and rank), then the top-N in order with
  ranks 1..N; a repeated id keeps its first place and takes the values of its last occurrence (vLLM's dict
  comprehension): the own token in the top-N takes its top-N rank; logprobs are the float32 values as Python floats;
* ``decoded_token`` is the token decoded alone with special tokens kept (ids past the vocabulary decode to "");
  for a Metaspace tokenizer it starts with at least as many spaces as its piece has leading ``▁`` marks;
* a text ending in U+FFFD is repaired: the shortest run of 1 to 4 tokens before it (the own tokens of the rows
  before: sampled tokens, or prompt tokens from the second on) after which the decoded text ends no longer in
  U+FFFD; the token's text is what it adds to the text of the run's leading tokens whose own text is whole
  (the run's trailing partial tokens had ""); "" when no run ends the character. The top-N are repaired against
  the same tokens as the row's own token (the reference tries every run size: no shortcut);
* rows delivered in several deltas (``preceding``: the own tokens before the delta; prompt chunks with ``start``)
  give the rows of one delivery; a decoder whose cache is warm gives what a fresh one gives; with_text=False gives
  None texts; prompt token 0 has no entry (None) and is no context.

Set LOGPROBS_DECODE_PROPERTY_PROFILE=mutation to run without shrinking (mutation testing).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import numpy as np
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from test_detokenizer import byte_ids, sentencepiece_style_tokenizer
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from asyncllm.engine.logprobs import LogprobsDecoder, PromptLogprobsBuffer
from asyncllm.outputs import Logprob
from asyncllm.protocol import LogprobsArrays
from asyncllm.tiny import tiny_checkpoint

FFFD = "\ufffd"
MARK = "\u2581"
CONTEXT = 4
"""A UTF-8 character has at most 4 bytes: the most tokens before a byte token its text is repaired with."""
NAMES = ["llama2_metaspace", "byte_level", "llama2", "metaspace"]
ALPHABET = "ab the x.,\n" + "éö✓日本🙂€"
MULTIBYTE = ["é", "✓", "日", "🙂", "€", "ö"]
_PROFILE = os.environ.get("LOGPROBS_DECODE_PROPERTY_PROFILE", "")
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate] if _PROFILE == "mutation" else list(Phase)


@lru_cache(maxsize=None)
def tokenizer_named(name: str) -> Any:
    """Byte-level BPE (the shipped tiny one, with an added and a special token), Llama-2-like byte fallback
    (normalizer marks: no Metaspace repair), and two Metaspace byte-fallback ones (their own decoder; Llama 2's)."""
    if name == "byte_level":
        tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
        tokenizer.add_tokens(["<tool>", " ✓✓"])
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
        return tokenizer
    tokenizer = sentencepiece_style_tokenizer("metaspace" if name == "metaspace" else "llama2")
    tokenizer.add_tokens(["<tool>"])
    if name == "llama2_metaspace":
        backend = tokenizer.backend_tokenizer
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARK, prepend_scheme="first", split=False)
    return tokenizer


def resolve(tokenizer: Any, segments: list[tuple]) -> list[int]:
    """The ids of drawn (tokenizer-independent) segments."""
    ids: list[int] = []
    added = sorted(tokenizer.added_tokens_decoder)
    for kind, value, *rest in segments:
        if kind == "text":
            ids += tokenizer(value, add_special_tokens=False).input_ids
        elif kind == "added":  # special or not: decoded_token keeps special tokens
            ids.append(added[value % len(added)])
        elif kind == "bytes":  # the first (n > 0) or last (n < 0) bytes of a character, one id each
            data = value.encode()
            ids += byte_ids(tokenizer, data[: rest[0]] if rest[0] > 0 else data[rest[0]:])
        elif kind == "spaces":  # whitespace pieces ("▁▁", "Ġ", ...) come from text; raw ids too
            ids += tokenizer(" " * value + "x", add_special_tokens=False).input_ids
        else:  # "id": any id, past the vocabulary too (a padded model samples them)
            ids.append(value % (len(tokenizer) + 3))
    return ids


def resolve_top(tokenizer: Any, own: list[int], row: int, draws: list[tuple]) -> list[int]:
    """A row's top-N: any id, a byte of a multi-byte character, or an own token (this row's, the next row's: the
    byte that ends a character, an earlier one)."""
    out = []
    for kind, value in draws:
        if kind == "byte":
            out += byte_ids(tokenizer, bytes([value]))
        elif kind == "own":
            out.append(own[max(0, min(len(own) - 1, row + value))])
        else:
            out.append(value % (len(tokenizer) + 3))
    return out


# ----------------------------------------------------------------------------------------------- the reference
def ref_decode(tokenizer: Any, ids: list[int]) -> str:
    """decode() with special tokens kept; ids past the vocabulary decode to nothing."""
    return tokenizer.decode([i for i in ids if 0 <= i < len(tokenizer)], skip_special_tokens=False)


def has_metaspace(tokenizer: Any) -> bool:
    """Whether the pre-tokenizer is Metaspace (its marks are leading spaces), as the docs state."""
    return "Metaspace" in repr(tokenizer.backend_tokenizer.pre_tokenizer)


def ref_alone(tokenizer: Any, token_id: int) -> str:
    """The token decoded alone; a Metaspace piece starts with at least one space per leading ``▁`` mark."""
    text = ref_decode(tokenizer, [token_id])
    if not has_metaspace(tokenizer) or not 0 <= token_id < len(tokenizer):
        return text
    piece = tokenizer.convert_ids_to_tokens(token_id)
    marks = len(piece) - len(piece.lstrip(MARK))
    spaces = len(text) - len(text.lstrip(" "))
    return " " * max(0, marks - spaces) + text


def ref_decoded_token(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """vLLM V1's decoded_token with the docs' repairs, trying every run of 1 to 4 tokens before it."""
    alone = ref_alone(tokenizer, token_id)
    if not alone.endswith(FFFD):
        return alone
    for size in range(1, min(len(context), CONTEXT) + 1):
        run = context[-size:]
        text = ref_decode(tokenizer, [*run, token_id])
        if text.endswith(FFFD):
            continue
        whole = len(run)  # the run's leading tokens with whole texts (the trailing partial ones had "")
        while whole and ref_alone(tokenizer, run[whole - 1]).endswith(FFFD):
            whole -= 1
        prefix = ref_decode(tokenizer, run[:whole])
        return text[len(os.path.commonprefix([prefix, text])):]
    return ""


def ref_rows(tokenizer: Any, own: list[int], tops: list[list[int]], values: np.ndarray, ranks: list[int],
             contexts: list[list[int]], with_text: bool) -> list[dict[int, Logprob]]:
    """One dict per row: own token first (its rank), the top-N after (ranks 1..N), later entries of an id win."""
    rows = []
    for r, (token, top) in enumerate(zip(own, tops)):
        row: dict[int, Logprob] = {}
        for k, (tid, rank) in enumerate(zip([token, *top], [ranks[r], *range(1, len(top) + 1)])):
            text = ref_decoded_token(tokenizer, tid, contexts[r]) if with_text else None
            row[tid] = Logprob(float(np.float32(values[r, k])), rank, text)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ the packing
def pack(ids: np.ndarray, values: np.ndarray, ranks: np.ndarray, start: int = 0) -> LogprobsArrays:
    """As the workers pack rows (protocol.LogprobsArrays): little-endian int32 ids, float32 logprobs, int32 ranks."""
    return LogprobsArrays(width=int(ids.shape[1]), token_ids=np.ascontiguousarray(ids, "<i4").tobytes(),
                          logprobs=np.ascontiguousarray(values, "<f4").tobytes(),
                          ranks=np.ascontiguousarray(ranks, "<i4").tobytes(), start=start)


def chunks_of(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[begin, end) ranges splitting n rows at the drawn cut points."""
    points = sorted({0, n, *(c % (n + 1) for c in cuts)})
    return list(zip(points, points[1:]))


# ------------------------------------------------------------------------------------------------ strategies
_segment = st.one_of(
    st.tuples(st.just("text"), st.text(ALPHABET, min_size=1, max_size=6)),
    st.tuples(st.just("added"), st.integers(0, 50)),
    st.tuples(st.just("bytes"), st.sampled_from(MULTIBYTE), st.sampled_from([1, 2, 3, -1, -2, -3])),
    st.tuples(st.just("spaces"), st.integers(1, 3)),
    st.tuples(st.just("id"), st.integers(0, 10_000)),
)
_top = st.one_of(
    st.tuples(st.just("byte"), st.sampled_from([0x80, 0x82, 0xAC, 0xA9, 0x97, 0xE2, 0xC3, 0xF0, 0x9F, 0x41])),
    st.tuples(st.just("own"), st.integers(-4, 1)),
    st.tuples(st.just("id"), st.integers(0, 10_000)),
)
_case = st.tuples(
    st.sampled_from(NAMES),
    st.lists(_segment, min_size=1, max_size=6),
    st.integers(0, 3),  # N (width - 1)
    st.lists(st.lists(_top, min_size=3, max_size=3), min_size=0, max_size=30),  # per row (cycled)
    st.lists(st.integers(0, 40), max_size=4),  # chunk cut points
    st.booleans(),  # prompt logprobs (else sampled)
    st.integers(0, 2**32 - 1),  # seed of the logprob values and ranks
)


def _values(seed: int, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 logprobs (the float32 round trip is checked: not exactly representable) and ranks >= 1."""
    rng = np.random.default_rng(seed)
    values = -rng.exponential(3.0, (rows, width))
    values[rng.random((rows, width)) < 0.05] = -np.inf
    return values, rng.integers(1, 5000, rows)


def build(case: tuple) -> tuple[Any, list[int], list[list[int]], np.ndarray, np.ndarray, np.ndarray]:
    """The tokenizer, the sequence of own tokens, each row's top-N, and the packed arrays' numpy inputs."""
    name, segments, n, top_draws, _, _, seed = case
    tokenizer = tokenizer_named(name)
    own = resolve(tokenizer, segments)
    tops = [resolve_top(tokenizer, own, r, (top_draws[r % len(top_draws)] if top_draws else []))[:n]
            for r in range(len(own))]
    tops = [top + [(own[r] + k) % (len(tokenizer) + 3) for k in range(n - len(top))] for r, top in enumerate(tops)]
    values, ranks = _values(seed, len(own), n + 1)
    ids = np.array([[t, *top] for t, top in zip(own, tops)], dtype=np.int64).reshape(len(own), n + 1)
    return tokenizer, own, tops, ids, values, ranks


# ----------------------------------------------------------------------------------------------------- tests
def check_sampled(case: tuple) -> None:
    """Sampled logprobs: each row's context is the own tokens of the rows before; deltas pass them as `preceding`.
    A shared (warm) decoder, a fresh decoder per delta and one delivery all give the reference."""
    tokenizer, own, tops, ids, values, ranks = build(case)
    contexts = [own[max(0, r - CONTEXT):r] for r in range(len(own))]
    expected = ref_rows(tokenizer, own, tops, values, ranks, contexts, True)
    shared = LogprobsDecoder(tokenizer)
    assert shared.decode(pack(ids, values, ranks)) == expected, "one delivery"
    warm, cold = [], []
    for begin, end in chunks_of(len(own), case[4]):
        arrays = pack(ids[begin:end], values[begin:end], ranks[begin:end])
        warm += shared.decode(arrays, preceding=own[:begin])
        cold += LogprobsDecoder(tokenizer).decode(arrays, preceding=own[max(0, begin - CONTEXT):begin])
    assert warm == expected, "deltas, warm cache"
    assert cold == expected, "deltas, fresh decoders"
    for got, want in zip(warm, expected):
        assert list(got) == list(want), "key order"
    blind = LogprobsDecoder(tokenizer).decode(pack(ids, values, ranks), with_text=False)
    assert blind == ref_rows(tokenizer, own, tops, values, ranks, contexts, False), "with_text=False"


def check_prompt(case: tuple) -> None:
    """Prompt logprobs: the prompt is the own tokens; token 0 has no row (entry None) and is no context; rows come
    in prefill chunks with `start`, each row's context is the prompt tokens 1.. before it."""
    tokenizer, own, tops, ids, values, ranks = build(case)
    if len(own) < 2:
        return
    contexts = [own[max(1, p - CONTEXT):p] for p in range(len(own))]
    expected = [None, *ref_rows(tokenizer, own[1:], tops[1:], values[1:], ranks[1:], contexts[1:], True)]
    for decoder in (LogprobsDecoder(tokenizer), None):
        buffer = PromptLogprobsBuffer(len(own))
        for begin, end in chunks_of(len(own) - 1, case[4]):
            begin, end = begin + 1, end + 1
            buffer.add(pack(ids[begin:end], values[begin:end], ranks[begin:end], start=begin),
                       decoder or LogprobsDecoder(tokenizer))
        assert buffer.entries == expected, "prompt chunks" + (" (fresh decoders)" if decoder is None else "")


@settings(max_examples=int(os.environ.get("LOGPROBS_DECODE_PROPERTY_EXAMPLES", "120")), deadline=None,
          phases=_PHASES)
@given(case=_case)
# "€" split over rows, Metaspace byte fallback (decode strips the run's first space): " the", "", "", "€"
@example(case=("llama2_metaspace", [("text", "the"), ("bytes", "€", 2), ("bytes", "€", -1), ("text", " x")], 1,
               [[("byte", 0xAC), ("own", 1), ("own", -1)]], [2], False, 0))
# the same as prompt logprobs, the character's first byte at position 1 (prompt token 0 is no context)
@example(case=("llama2_metaspace", [("bytes", "🙂", 1), ("bytes", "🙂", 2), ("bytes", "🙂", -3), ("text", "a")], 2,
               [[("own", 1), ("byte", 0x82), ("id", 7)]], [1, 3], True, 1))
# byte-level 4-byte emoji: the top-N include the next row's byte (completes nothing yet) and a stray byte
@example(case=("byte_level", [("text", "a🙂"), ("bytes", "✓", 1), ("added", 6)], 3,
               [[("own", 1), ("byte", 0x80), ("id", 520)]], [3, 5], False, 2))
# <0xNN> pieces of a Metaspace decoder without byte fallback are literal text (no repair), "▁▁" pieces
@example(case=("metaspace", [("spaces", 2), ("bytes", "€", 1), ("text", " the")], 2, [[("own", -1), ("id", 9)]],
               [1], False, 5))
# ids past the vocabulary and special tokens, in the own tokens and the top-N; llama2 has no Metaspace repair
@example(case=("llama2", [("id", 422), ("added", 1), ("text", " the é"), ("bytes", "日", -2)], 3,
               [[("id", 421), ("own", 0), ("byte", 0xE2)]], [], True, 3))
# whole "▁" pieces (" " each) and "x" before "✓"'s bytes in the run: "", "", "✓" (the run's prefix left out)
@example(case=("llama2_metaspace", [("spaces", 2), ("bytes", "✓", 1), ("bytes", "✓", -2)], 1,
               [[("own", -3), ("own", 1), ("id", 0)]], [1, 2, 3], False, 4))
# an id past the vocabulary (515) inside "🙂": its last byte needs all 4 tokens before it, across a prompt chunk
@example(case=("byte_level", [("text", "a"), ("bytes", "🙂", 1), ("id", 515), ("bytes", "🙂", -3)], 1,
               [[("own", 0)]], [4], True, 6))
# the same sampled, in two deltas
@example(case=("byte_level", [("bytes", "🙂", 1), ("id", 515), ("bytes", "🙂", -3)], 2, [[("own", 1), ("byte", 0x99)]],
               [4], False, 7))
def test_logprobs_rows_match_the_reference(case: tuple) -> None:
    """Every row of sampled or prompt logprobs, one delivery or chunked, warm or fresh cache, equals the reference."""
    (check_prompt if case[5] else check_sampled)(case)
