"""Property tests of asyncllm/speech_segments.py: Whisper's timestamped output as `Segment`s (`segments_of`) and the
OpenAI audio routes' subtitle formats (`srt`, `vtt`, `verbose_json`).

Reference (the module's docstrings, docs/multimodal.md's Whisper section, docs/integrations/openai-server.md's
``response_format`` row, asyncllm/speech.py's pieces and offsets), checked against a naive token walk written here:

- a token id ``>= timestamp_begin`` is the timestamp ``(id - timestamp_begin) * 0.02`` s; timestamps alternate: the
  1st, 3rd, ... open a segment, the 2nd, 4th, ... close it (``<|start|> text <|end|>``, the next ``<|start|>`` after);
  the segment's text is every text token since the previous closing timestamp (text before the first timestamp joins
  the first segment, as transformers' ``_decode_asr`` does); ``skip`` ids (EOS) are dropped;
- text left open (cut by ``max_tokens``) ends at the piece's ``duration``; text without any timestamp spans the piece;
- times are clamped to the piece (``<= duration``), shifted by the piece's ``offset`` and given to the millisecond;
- a segment whose decoded text is blank is left out; the segments keep the order of the tokens, and a long audio's
  pieces (offset = the lengths of the pieces before it, in samples over the rate) keep theirs;
- ``srt``: cues numbered from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, the stripped text, each cue followed by a blank
  line; ``vtt``: the ``WEBVTT`` header and a blank line, then the same cues without numbers and with ``.`` before the
  milliseconds; hours are not bounded (``100:00:00,000`` after 100 h); the clock is the time to the nearest
  millisecond (an exact tie may go either way: neither docs nor OpenAI's writers promise a side; minutes and seconds
  stay below 60 when rounding carries);
- ``verbose_json``: ``{"task", "language", "duration", "text", "segments": [{"id", "start", "end", "text", "tokens",
  "temperature"}]}`` (the docs: no ``avg_logprob``, ``compression_ratio``, ``no_speech_prob``); ids from 0; the whole
  text the segments' texts joined; and the three formats give the same segments at the same milliseconds.

Set SPEECH_SEGMENTS_NO_SHRINK=1 to run without shrinking (the mutation check).
"""

from __future__ import annotations

import os
import re
from fractions import Fraction

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from asyncllm.speech_segments import TIME_PRECISION, Segment, segments_of, srt, verbose_json, vtt

settings.register_profile("speech_segments_mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("SPEECH_SEGMENTS_NO_SHRINK"):
    settings.load_profile("speech_segments_mutations")

SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}

EOS = 1
PIECES = {2: "", 3: " ", 4: "\t", 5: " Hello", 6: " world", 7: ",", 8: " é", 9: "日本", 10: " 42", 11: " a-b", 12: "x"}
"""A fake tokenizer: each text id's piece (some blank, so that a segment of them is left out)."""
TEXT_IDS = sorted(PIECES)
RATE = 16000
TIMESTAMP = re.compile(r"(\d{2,}):([0-5]\d):([0-5]\d)[,.](\d{3})")
CUE = r"(\d{2,}:[0-5]\d:[0-5]\dSEP\d{3}) --> (\d{2,}:[0-5]\d:[0-5]\dSEP\d{3})\n([^\n]*)\n\n"


def decode(ids: list[int]) -> str:
    """The fake tokenizer's decode: the pieces joined."""
    return "".join(PIECES[i] for i in ids)


# ---------------------------------------------------------------------------------------------------------------
# the naive reference


def reference_segments(tokens: list[int], tb: int, offset: Fraction, duration: Fraction, skip: set[int]):
    """(exact start, exact end, text, ids) of each kept segment, from the alternation of timestamps."""
    out, opened, ids = [], None, []
    for token in tokens:
        if token >= tb:
            seconds = Fraction(token - tb, 50)
            if opened is None:
                opened = seconds
                continue
            out.append((opened, seconds, ids))
            opened, ids = None, []
        elif token not in skip:
            ids.append(token)
    if ids:
        out.append((Fraction(0) if opened is None else opened, duration, ids))
    return [(offset + min(a, duration), offset + min(b, duration), decode(i), tuple(i))
            for a, b, i in out if decode(i).strip()]


def millis(clock: str) -> int:
    """A ``HH:MM:SS,mmm`` / ``HH:MM:SS.mmm`` clock in milliseconds."""
    h, m, s, ms = map(int, TIMESTAMP.fullmatch(clock).groups())
    return ((h * 60 + m) * 60 + s) * 1000 + ms


def is_nearest_milli(ms: int, seconds: Fraction) -> bool:
    """``ms`` is ``seconds`` to the nearest millisecond (either side of an exact tie; float slack of 1e-9 s)."""
    return abs(Fraction(ms) - seconds * 1000) <= Fraction(1, 2) + Fraction(1, 10**6)


def assert_times(segment: Segment, start: Fraction, end: Fraction) -> None:
    """The segment's times are the exact ones to the millisecond (a float on the millisecond grid)."""
    for got, exact in ((segment.start, start), (segment.end, end)):
        assert abs(Fraction(got) - exact) <= Fraction(1, 2000) + Fraction(1, 10**9), (got, float(exact))
        assert abs(got * 1000 - round(got * 1000)) < 1e-6, got


# ---------------------------------------------------------------------------------------------------------------
# the formats, parsed


def parse_srt(text: str) -> list[tuple[int, int, str]]:
    """The cues of an SRT text: numbered 1, 2, ... in order, each followed by a blank line; nothing else."""
    cues = re.findall(r"(\d+)\n" + CUE.replace("SEP", ","), text)
    assert "".join(f"{n}\n{a} --> {b}\n{t}\n\n" for n, a, b, t in cues) == text, text
    assert [int(n) for n, *_ in cues] == list(range(1, len(cues) + 1))
    return [(millis(a), millis(b), t) for _, a, b, t in cues]


def parse_vtt(text: str) -> list[tuple[int, int, str]]:
    """The cues of a WebVTT text: the WEBVTT header and a blank line, then cues each followed by a blank line."""
    assert text.startswith("WEBVTT\n\n"), text
    body = text[len("WEBVTT\n\n"):]
    cues = re.findall(CUE.replace("SEP", r"\."), body)
    assert "".join(f"{a} --> {b}\n{t}\n\n" for a, b, t in cues) == body, text
    return [(millis(a), millis(b), t) for a, b, t in cues]


def assert_formats_agree(segments: list[Segment], duration: float = 1.0) -> None:
    """srt, vtt and verbose_json give every segment, in order, at the same milliseconds, with its text."""
    subrip, webvtt = parse_srt(srt(segments)), parse_vtt(vtt(segments))
    assert len(subrip) == len(webvtt) == len(segments)
    for (a, b, text), cue, segment in zip(subrip, webvtt, segments):
        assert cue == (a, b, text)
        assert is_nearest_milli(a, Fraction(segment.start)) and is_nearest_milli(b, Fraction(segment.end))
        assert text == segment.text.strip()
    body = verbose_json("transcribe", "en", duration, segments, 0.0)
    assert set(body) == {"task", "language", "duration", "text", "segments"}
    assert (body["task"], body["language"], body["text"]) == ("transcribe", "en", "".join(s.text for s in segments))
    assert abs(Fraction(body["duration"]) - Fraction(duration)) <= Fraction(1, 2000) + Fraction(1, 10**9)
    assert len(body["segments"]) == len(segments)
    for i, (entry, segment) in enumerate(zip(body["segments"], segments)):
        assert entry == {"id": i, "start": segment.start, "end": segment.end, "text": segment.text,
                         "tokens": list(segment.token_ids), "temperature": 0.0}
        assert type(entry["tokens"]) is list and all(type(t) is int for t in entry["tokens"])


# ---------------------------------------------------------------------------------------------------------------
# strategies


@st.composite
def whisper_output(draw, tb: int, duration: Fraction, lawful: bool):
    """A piece's output ids: optional text first, then timestamp pairs with text (possibly none) between, an
    optional last opening left unpaired with text after (cut by max_tokens), EOS sprinkled in. ``lawful``: times
    never decrease and timestamps come as Whisper's rules allow; otherwise any order, runs of timestamps and text
    after a closing timestamp (which the rules forbid: it joins the next opening's segment)."""
    last = min(1500, int(duration * 50) + 25)  # a little past the piece's end too: clamped
    text = st.lists(st.sampled_from(TEXT_IDS + [EOS]), max_size=4)
    tokens = list(draw(text)) if draw(st.booleans()) else []
    time = 0
    for _ in range(draw(st.integers(0, 5))):
        if lawful:
            start = draw(st.integers(time, last))
            end = draw(st.integers(start, last))
            time = end
        else:
            start, end = draw(st.integers(0, last)), draw(st.integers(0, last))
        tokens += [tb + start] + draw(text) + [tb + end]
        if not lawful:
            tokens += [tb + t for t in draw(st.lists(st.integers(0, last), max_size=2))] + draw(text)  # stray text
    if draw(st.booleans()):  # an opening left unpaired
        tokens += [tb + draw(st.integers(time, last))] + draw(text)
    return tokens


durations = st.integers(1, 30 * RATE).map(lambda n: Fraction(n, RATE))
"""A piece's length: whole samples at 16 kHz, up to 30 s."""
offsets = st.one_of(st.integers(0, 400 * 3600 * RATE).map(lambda n: Fraction(n, RATE)),
                    st.sampled_from([Fraction(0), Fraction(3600), Fraction(360000), Fraction(7199999, 2000)]))
"""Where the piece starts in the whole audio: up to 400 h (hours past 99 too)."""


# ---------------------------------------------------------------------------------------------------------------
# properties


@settings(max_examples=300, **SETTINGS)
@given(data=st.data(), tb=st.integers(13, 60000), duration=durations, offset=offsets, lawful=st.booleans(),
       tokens=st.none())
# the unit test's case: pairs, an equal closing/opening, a zero-length empty pair, text cut open past the piece
@example(data=None, tb=100, duration=Fraction(5, 2), offset=Fraction(60), lawful=True,
         tokens=[100, 5, 6, 150, 150, 160, 160, 7, 500, 500, 8, EOS])
# text before the first timestamp joins the first segment; an opening then only EOS gives nothing
@example(data=None, tb=13, duration=Fraction(30), offset=Fraction(0), lawful=True, tokens=[5, 13, 6, 63, 63, EOS])
# no timestamp at all: the text spans the whole piece, shifted past 100 hours
@example(data=None, tb=13, duration=Fraction(7, 4), offset=Fraction(360000), lawful=True, tokens=[5, 6, EOS])
# blank segments (" ", "", "\t") are left out; a decreasing pair keeps its times as written
@example(data=None, tb=13, duration=Fraction(30), offset=Fraction(1, RATE), lawful=False,
         tokens=[13, 3, 2, 63, 63, 4, 73, 113, 5, 63])
# text after a closing timestamp (off Whisper's rules) joins the next opening's segment, not the closed one
@example(data=None, tb=13, duration=Fraction(30), offset=Fraction(0), lawful=False, tokens=[13, 5, 63, 6, 113, 7, 163])
# a piece time plus an offset off the millisecond grid (a sample is 62.5 us): given to the millisecond
@example(data=None, tb=13, duration=Fraction(479999, RATE), offset=Fraction(479999, RATE), lawful=True,
         tokens=[13, 5, 1513, 1513, 6])
def test_segments_are_the_timestamp_pairs_shifted_by_the_offset(data, tb, duration, offset, lawful, tokens):
    """`segments_of` gives the reference's segments (start, end, text, ids) in order, times to the millisecond, and
    the three formats agree on them."""
    if tokens is None:
        tokens = data.draw(whisper_output(tb, duration, lawful), label="tokens")
    got = segments_of(tokens, tb, decode, offset=float(offset), duration=float(duration), skip={EOS})
    want = reference_segments(tokens, tb, offset, duration, {EOS})
    assert [(s.text, s.token_ids) for s in got] == [(text, ids) for _, _, text, ids in want]
    for segment, (start, end, _, _) in zip(got, want):
        assert_times(segment, start, end)
        assert type(segment.token_ids) is tuple
    if lawful:  # Whisper's rules: times never decrease, so the segments are in time order inside the piece
        low, high = float(offset) - 5e-4 - 1e-9, float(offset + duration) + 5e-4 + 1e-9  # to the millisecond
        assert all(low <= s.start <= s.end <= high for s in got)
        assert all(a.end <= b.start for a, b in zip(got, got[1:]))
    assert_formats_agree(got, float(duration))


@settings(max_examples=100, **SETTINGS)
@given(data=st.data(), tb=st.integers(13, 60000), lengths=st.lists(durations, min_size=1, max_size=4),
       start=st.integers(0, 3 * 3600 * RATE))
def test_a_long_audios_pieces_keep_their_order_and_offsets(data, tb, lengths, start):
    """Pieces' segments joined as asyncllm/speech.py's `piece_segments` does (offset: the lengths before the piece)
    are each piece's own segments shifted by its offset, in piece order, and the formats number them across pieces."""
    base, joined, offset = Fraction(start, RATE), [], Fraction(start, RATE)
    for length in lengths:
        tokens = data.draw(whisper_output(tb, length, True), label="tokens")
        alone = segments_of(tokens, tb, decode, duration=float(length), skip={EOS})
        placed = segments_of(tokens, tb, decode, offset=float(offset), duration=float(length), skip={EOS})
        assert [(s.text, s.token_ids) for s in placed] == [(s.text, s.token_ids) for s in alone]
        for here, there in zip(placed, alone):
            assert abs(Fraction(here.start) - Fraction(there.start) - offset) <= Fraction(1, 1000) + Fraction(1, 10**9)
            assert abs(Fraction(here.end) - Fraction(there.end) - offset) <= Fraction(1, 1000) + Fraction(1, 10**9)
            slack = Fraction(1, 2000) + Fraction(1, 10**9)  # to the millisecond, a float
            assert offset - slack <= Fraction(here.start) <= offset + length + slack
        joined += placed
        offset += length
    # time order across pieces (a piece's end and the next one's offset may round apart by a millisecond at a tie)
    assert all(a.end <= b.start + 1e-3 + 1e-9 for a, b in zip(joined, joined[1:]))
    assert_formats_agree(joined, float(offset - base))


times = st.one_of(st.integers(0, 400 * 3600 * 2000).map(lambda n: Fraction(n, 2000)),  # on the half-millisecond grid
                  st.fractions(0, 400 * 3600))
texts = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=8).filter(
    lambda t: t.strip() and "-->" not in t)


@settings(max_examples=300, **SETTINGS)
@given(st.lists(st.tuples(times, times, texts, st.lists(st.integers(0, 60000), max_size=3)), max_size=5))
# .0005 ties, each side of the hour, and the carry from 59.9995 s / 59:59.9996 into the next minute and hour
@example([(Fraction(1, 2000), Fraction(3, 2000), " a", []), (Fraction(7199999, 2000), Fraction(35999998, 10000), "b",
          [1, 2])])
# 100 hours and more: the hour field grows past two digits
@example([(Fraction(360000), Fraction(720123, 2), " long", [5])])
# a whole minute, 59.999 s and a text with spaces around it (stripped in the cues, kept in verbose_json)
@example([(Fraction(60), Fraction(59999, 1000), "  padded  ", [])])
def test_subtitles_are_each_segment_to_the_millisecond(rows):
    """For any segments: srt numbers its cues from 1 and separates them with blank lines, vtt has its header and
    the same cues with '.', both give each time to the nearest millisecond (HH:MM:SS with minutes and seconds below
    60, hours unbounded), and verbose_json has exactly the documented fields with the segments' own values."""
    segments = [Segment(float(a), float(b), text, tuple(ids)) for a, b, text, ids in rows]
    assert_formats_agree(segments, 12.3456)


def test_the_tie_and_carry_corners_by_hand():
    """Hand-written clocks: 0, a tie, 59.9995 s carrying into a minute, 3599.9995 s into an hour, 100 hours."""
    assert srt([]) == "" and vtt([]) == "WEBVTT\n\n"
    cue = srt([Segment(0.0, 1.5, " hi ", (5,))])
    assert cue == "1\n00:00:00,000 --> 00:00:01,500\nhi\n\n"
    assert vtt([Segment(0.0, 1.5, " hi ", (5,))]) == "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nhi\n\n"
    carried = srt([Segment(59.9996, 3599.9996, "x", ())])
    assert carried == "1\n00:01:00,000 --> 01:00:00,000\nx\n\n"
    assert srt([Segment(360000.0, 360061.001, "x", ())]) == "1\n100:00:00,000 --> 100:01:01,001\nx\n\n"
    assert TIME_PRECISION == 0.02


def test_a_cues_text_never_holds_the_timing_arrow():
    """A cue's text may not hold ``-->`` (a WebVTT parser reads it as a timing line): written ``->``, as OpenAI
    whisper's writers do; verbose_json keeps the text as the model wrote it."""
    segment = Segment(0.0, 1.0, " a --> b ", (5,))
    assert srt([segment]) == "1\n00:00:00,000 --> 00:00:01,000\na -> b\n\n"
    assert vtt([segment]) == "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\na -> b\n\n"
    assert verbose_json("transcribe", "en", 1.0, [segment], 0.0)["segments"][0]["text"] == " a --> b "
