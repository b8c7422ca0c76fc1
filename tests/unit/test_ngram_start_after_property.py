"""Two small host-side rules against plain list models (hypothesis), driven as their callers drive them.

`NgramProposer` (asyncllm/spec/ngram.py, docs/speculative.md "What the drafts are"): for n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens looked up earlier in the same tokens; for the
longest n found, the tokens after its latest occurrence with k tokens after it, else after its earliest; at most
``min(k, max_drafts)``; none for ``k <= 0`` or at most ``prompt_lookup_min`` tokens. Driven as the scheduler drives it
(`schedule_each._drafts`): one proposer for every request, each request's own ``draft_buffer`` kept across steps while
its tokens grow by 0 to 5 a step, a room that may be 0; tokens whose int32 little-endian bytes hold other tokens'
(256 is 00 01 00 00, so ``[256, 0]`` holds token 1's bytes one byte in), so byte matches off a token boundary are
common. The buffer must hold exactly the tokens' bytes after each call.

`Marker` (asyncllm/structured/start_after.py, docs/sampling.md#structured-output): `written_by` (the marker ending
within ``_SLACK`` = 8 tokens of the prompt's end, no opener after the last one; a marker with a suffix must end the
prompt itself: its first suffix after the start, fewer than ``max_between`` tokens between), `opened_by` (the last
opener within the last 8 tokens after its end, no marker starting at or after it), `starts_answer` (written, or thinking
turned off and not opened), `ends` and `spanned`; and `with_start_after_ids` with a tokenizer of a few characters and
drawn special tokens: ``start_after`` dropped exactly when `starts_answer`, else filled as ids, the reply-opens flag
dropped when the prompt opened the thinking, its opener id filled when the opener is one token.

Drawn markers: a closing tag starting with 7 (then 7, 8, 9), an opener starting with 6 (then 5, 6, 8), so neither
holds nor overlaps the other (as ``</think>`` and ``<think>`` do not); with a suffix: any of 7, 8, 9 (which may
overlap the marker), no opener (`Marker.of` gives none).
"""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.sampling import SamplingParams
from asyncllm.spec.config import SpeculativeConfig
from asyncllm.spec.ngram import NgramProposer
from asyncllm.structured.spec import StructuredOutputs
from asyncllm.structured.start_after import Marker, with_start_after_ids

# ====================================================================== n-gram drafts
# 1 is 01 00 00 00; 256, 65536 and 16777216 hold its 01 one, two and three bytes in; -1 and 2**31 - 1 share ff bytes;
# -256 is 00 ff ff ff. Small ids repeat often, so the drafts are seldom empty.
_TOKENS = [0, 0, 1, 1, 2, 256, 257, 65536, 16777216, 16777217, -1, -256, 2**31 - 1]


def ref_drafts(tokens: list[int], k: int, lo: int, hi: int, max_drafts: int) -> list[int]:
    """The rule as docs/speculative.md words it, by slicing lists."""
    k = min(k, max_drafts)
    if k <= 0 or len(tokens) <= lo:
        return []
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        last = tokens[len(tokens) - n:]
        earlier = [s for s in range(len(tokens) - n) if tokens[s:s + n] == last]  # not the last n themselves
        if not earlier:
            continue
        with_k = [s for s in earlier if len(tokens) - (s + n) >= k]
        start = max(with_k) if with_k else min(earlier)
        return tokens[start + n:start + n + k]
    return []


_steps = st.lists(st.tuples(st.integers(0, 1), st.lists(st.sampled_from(_TOKENS), max_size=5), st.integers(-1, 8)),
                  min_size=1, max_size=14)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 6), lo=st.integers(1, 4), extra=st.integers(0, 3),
       prompts=st.lists(st.lists(st.sampled_from(_TOKENS), min_size=1, max_size=16), min_size=2, max_size=2),
       steps=_steps)
def test_drafts_follow_the_rule_as_requests_grow(k, lo, extra, prompts, steps):
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
                                          "prompt_lookup_max": lo + extra})
    proposer = NgramProposer(config)
    requests = [(list(p), bytearray()) for p in prompts]  # (all_token_ids, draft_buffer) per request
    for which, added, room in steps:
        tokens, buffer = requests[which]
        tokens += added
        before = list(tokens)
        drafts = proposer.propose(tokens, buffer, room)
        assert drafts == ref_drafts(tokens, k, lo, lo + extra, room), (tokens, room)
        assert tokens == before  # the request's tokens are read, not changed
        assert bytes(buffer) == array("i", tokens).tobytes()  # brought up to date, whatever the room


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 5), lo=st.integers(1, 3), extra=st.integers(0, 2),
       body=st.lists(st.sampled_from([0, 0, 0, 1, 256, 65536, 16777216]), max_size=12),
       tail=st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=4), room=st.integers(0, 6))
def test_a_suffix_whose_bytes_sit_across_tokens_is_not_a_match(k, lo, extra, body, tail, room):
    """The last tokens' bytes planted off a token boundary (inside [256, 0, ...]) before, with one aligned copy or
    none; proposed from scratch and after a buffer that held all but the last token."""
    for tokens in (body + tail + [7] + body + tail, body + tail):
        expected = ref_drafts(tokens, k, lo, lo + extra, room)
        proposer = NgramProposer(SpeculativeConfig(k, lo, lo + extra))
        assert proposer.propose(tokens, bytearray(), room) == expected, tokens
        buffer = bytearray()
        proposer.propose(tokens[:-1], buffer, 0)
        assert proposer.propose(tokens, buffer, room) == expected, tokens


# ====================================================================== start_after markers
SLACK = 8


def occurrences(tokens: list[int], pattern: tuple[int, ...]) -> list[int]:
    return [i for i in range(len(tokens) - len(pattern) + 1) if tuple(tokens[i:i + len(pattern)]) == pattern]


def marker_starts(m: Marker, tokens: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every marker written in ``tokens``: a closing tag, or one followed by its first suffix after it
    with fewer than max_between tokens between."""
    if not m.ids:
        return []
    found, suffixes = [], occurrences(tokens, m.suffix) if m.suffix else []
    for i in occurrences(tokens, m.ids):
        end = i + len(m.ids)
        if not m.suffix:
            found.append((i, end))
            continue
        after = [j for j in suffixes if j >= end]
        if after and after[0] - end < m.max_between:
            found.append((i, after[0] + len(m.suffix)))
    return found


def ref_written(m: Marker, prompt: list[int]) -> bool:
    found = marker_starts(m, prompt)
    if not found:
        return False
    if m.suffix:  # must end the prompt itself
        return any(end == len(prompt) for _, end in found)
    last = max(end for _, end in found)
    return len(prompt) - last <= SLACK and not (m.opener and any(o >= last for o in occurrences(prompt, m.opener)))


def ref_opened(m: Marker, prompt: list[int]) -> bool:
    opens = occurrences(prompt, m.opener) if m.opener else []
    if not opens or len(prompt) - (opens[-1] + len(m.opener)) > SLACK:
        return False
    return not any(start >= opens[-1] for start, _ in marker_starts(m, prompt))


def ref_starts_answer(m: Marker, prompt: list[int], thinking_off: bool) -> bool:
    return ref_written(m, prompt) or (thinking_off and not ref_opened(m, prompt))


def ref_ends(m: Marker, tokens: list[int]) -> bool:
    return any(end == len(tokens) for _, end in marker_starts(m, tokens))


def ref_spanned(m: Marker, tokens: list[int], opened: bool) -> int:
    opens = occurrences(tokens, m.opener) if m.opener else []
    if not opens and not opened:
        return 0
    begin = opens[0] + len(m.opener) if opens else 0
    closes = [start for start, _ in marker_starts(m, tokens) if start >= begin]
    return (min(closes) if closes else len(tokens)) - begin


@st.composite
def markers(draw) -> Marker:
    if draw(st.booleans()):
        ids = (7, *draw(st.lists(st.sampled_from([7, 8, 9]), max_size=2)))
        opener = (6, *draw(st.lists(st.sampled_from([5, 6, 8]), max_size=2))) if draw(st.integers(0, 3)) else ()
        return Marker(ids, opener)
    ids = (7, *draw(st.lists(st.sampled_from([7, 8]), max_size=1)))
    suffix = tuple(draw(st.lists(st.sampled_from([7, 8, 9]), min_size=1, max_size=2)))
    return Marker(ids, (), suffix, draw(st.integers(1, 4)))


@st.composite
def marked(draw) -> tuple[Marker, list[int]]:
    """A marker and tokens of filler, markers, openers and suffixes at drawn places; then markers and openers (a
    marker with a suffix: its start, 0 to 5 tokens, its suffix) and 0 to 10 tokens of filler, to meet the slack."""
    m = draw(markers())
    pieces = [m.ids, m.ids[:-1], m.ids[1:]] + ([m.opener, m.opener[:-1]] if m.opener else []) \
        + ([m.suffix, m.ids + m.suffix] if m.suffix else [])
    piece = st.one_of(st.sampled_from([1, 2, 5, 6, 7, 8, 9]).map(lambda t: (t,)), st.sampled_from(pieces))
    head = draw(st.lists(st.sampled_from([1, 2, 5, 8]), max_size=12))
    tokens = head + [t for p in draw(st.lists(piece, max_size=10)) for t in p]
    if m.suffix:
        late = st.integers(0, 5).map(lambda gap: m.ids + (1,) * gap + m.suffix) | st.sampled_from([m.ids, m.suffix])
    else:
        late = st.sampled_from([m.ids, m.opener or m.ids, m.ids + (1,)])
    end = [t for p in draw(st.lists(late, max_size=4)) for t in p]
    return m, tokens + end + [1] * draw(st.sampled_from([0, 0, 1, 2, 4, 6, 7, 8, 8, 9, 10]))


@settings(max_examples=500, deadline=None)
@given(marked(), st.booleans())
def test_starts_answer_follows_the_rule(case, thinking_off):
    m, prompt = case
    assert m.written_by(prompt) == ref_written(m, prompt), (m, prompt)
    assert m.opened_by(prompt) == ref_opened(m, prompt), (m, prompt)
    assert m.starts_answer(prompt, thinking_off) == ref_starts_answer(m, prompt, thinking_off), (m, prompt)
    for cut in [*range(min(len(prompt), 24)), len(prompt)]:  # as the core asks it, after each sampled token
        assert m.ends(prompt[:cut]) == ref_ends(m, prompt[:cut]), (m, prompt[:cut])


@settings(max_examples=300, deadline=None)
@given(marked())
def test_spanned_counts_between_the_tags(case):
    m, tokens = case
    for opened in (False, True):
        assert m.spanned(tokens, opened) == ref_spanned(m, tokens, opened), (m, tokens, opened)


def test_the_reference_reads_the_worked_examples():
    """The reference agrees with the examples test_reasoning.py pins."""
    close, final = Marker((7, 8), opener=(6, 8)), Marker((7, 8), suffix=(9,), max_between=3)
    assert ref_written(close, [1, 2, 3, 7, 8, 9, 9]) and not ref_written(close, [1, 7, 8, *[5] * 9])
    assert not ref_written(close, [1, 7, 8, 4, 5, 6, 8, 9]) and ref_written(close, [6, 8, 7, 8, 9])
    assert ref_opened(close, [1, 6, 8, 9]) and not ref_opened(close, [6, 8, 7, 8, 9])
    assert ref_written(final, [1, 7, 8, 4, 9]) and not ref_written(final, [1, 7, 8, 4, 9, 5])
    assert ref_ends(final, [7, 8, 4, 4, 9]) and not ref_ends(final, [7, 8, 4, 4, 4, 9])
    assert ref_spanned(close, [7, 8, 6, 8, 5, 5], opened=False) == 2


# ---------------------------------------------------------------------- with_start_after_ids
class CharTokenizer:
    """Greedy longest match over single characters and a few whole-tag tokens (special tokens, as ``</think>`` is
    one id for Qwen3 and several for others)."""

    CHARS = "<>/tcfma\n"

    def __init__(self, specials: list[str]) -> None:
        self.vocab = list(self.CHARS) + specials

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            piece = max((p for p in self.vocab if text.startswith(p, at)), key=len)
            ids.append(self.vocab.index(piece))
            at += len(piece)
        return ids

    def __len__(self) -> int:
        return len(self.vocab)


_FORMS = [  # (start_after, suffix, max_between, opener)
    ("</t>", None, 0, None), ("</t>", None, 0, "<t>\n"), ("</t>\n", None, 0, "<t>"), ("<c>f", "<m>", 3, None)]
_TEXT = ["a", "\n", "<", ">", "/", "t", "m", "</t>", "<t>", "<t>\n", "</t>\n", "<c>f", "<m>", "<c>fa<m>"]


@settings(max_examples=300, deadline=None)
@given(specials=st.lists(st.sampled_from(["</t>", "<t>", "<c>", "<m>"]), unique=True), form=st.sampled_from(_FORMS),
       text=st.lists(st.sampled_from(_TEXT), max_size=16), only_if_opened=st.booleans(), reply_opens=st.booleans(),
       after_space=st.booleans(), callers=st.sampled_from([None, "same", "other"]),
       callers_opener=st.booleans())
def test_with_start_after_ids_drops_the_marker_exactly_when_the_reply_starts_answering(
        specials, form, text, only_if_opened, reply_opens, after_space, callers, callers_opener):
    tokenizer = CharTokenizer(specials)
    start_after, suffix, between, opener_text = form
    prompt = tokenizer.encode("<a>" + "".join(text))
    ids, suffix_ids = tuple(tokenizer.encode(start_after)), tuple(tokenizer.encode(suffix)) if suffix else ()
    opener_text = start_after.replace("/", "", 1) if opener_text is None else opener_text
    opener = () if suffix or opener_text == start_after else tuple(tokenizer.encode(opener_text))
    m = Marker(ids, opener, suffix_ids, between)
    caller_ids = {None: [], "same": list(ids), "other": [1, 2]}[callers]
    caller_opener = [4] if reply_opens and callers_opener else []
    structured = StructuredOutputs(
        regex="x", start_after=start_after, start_after_suffix=suffix, start_after_max_between=between,
        start_after_opener=form[3], start_after_only_if_opened=only_if_opened,
        start_after_only_if_reply_opens=reply_opens, start_after_opener_after_space=reply_opens and after_space,
        start_after_token_ids=caller_ids, start_after_opener_token_ids=caller_opener)
    params = SamplingParams(structured=structured)
    params.validate()
    out = with_start_after_ids(params, list(prompt), tokenizer, len(tokenizer))
    out.validate()  # as the core checks it
    got = out.structured
    reply_kept = reply_opens and not ref_opened(m, prompt)
    opener_ids = (caller_opener if reply_kept else []) or (list(opener) if reply_kept and len(opener) == 1 else [])
    if not caller_ids and ref_starts_answer(m, prompt, only_if_opened):
        assert got.start_after is None and got.start_after_suffix is None and got.start_after_opener is None
        assert not (got.start_after_token_ids or got.start_after_suffix_token_ids or got.start_after_opener_token_ids)
        assert not (got.start_after_only_if_opened or got.start_after_only_if_reply_opens
                    or got.start_after_opener_after_space)
        return
    assert (got.start_after, got.start_after_suffix) == (start_after, suffix)
    assert got.start_after_token_ids == (caller_ids or list(ids))
    assert got.start_after_suffix_token_ids == list(suffix_ids)  # filled beside the caller's ids too (a fix)
    assert got.start_after_only_if_reply_opens == reply_kept
    assert got.start_after_opener_after_space == (reply_kept and after_space)
    assert got.start_after_opener_token_ids == opener_ids
    core = Marker.of_structured(got)  # the core's marker: its opener only with the flag
    assert (core.ids, core.opener) == (tuple(got.start_after_token_ids), tuple(opener_ids))
    assert core.suffix == tuple(got.start_after_suffix_token_ids)
    assert core.after_space == (bool(opener_ids) and reply_kept and after_space)
