"""Regexes, grammars and choice lists that xgrammar would compile for many seconds (holding a compile thread, which
cannot be interrupted) are refused when the request is validated, naming the bound (asyncllm/structured/spec.py)."""

from __future__ import annotations

import json

import pytest

from asyncllm import InvalidRequestError, SamplingParams, StructuredOutputs
from asyncllm.structured.spec import MAX_GRAMMAR_CHARS, MAX_REPETITION


def _refused(structured: StructuredOutputs, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(structured=structured).validate()
    assert info.value.field == "structured"


def test_the_bounds_are_those_measured() -> None:
    assert (MAX_GRAMMAR_CHARS, MAX_REPETITION) == (100_000, 10_000)


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_a_text_longer_than_max_grammar_chars_is_refused(kind: str) -> None:
    """A literal of 200,000 characters compiled in 7.5 s, of 1,000,000 in over 40 s; 100,000 in about 2 s."""
    text = "x" * MAX_GRAMMAR_CHARS if kind == "regex" else 'root ::= "' + "x" * (MAX_GRAMMAR_CHARS - 11) + '"'
    assert len(text) == MAX_GRAMMAR_CHARS
    StructuredOutputs(**{kind: text}).validate()
    _refused(StructuredOutputs(**{kind: text + " "}),
             f"^structured: the {kind} is longer than 100000 characters \\(MAX_GRAMMAR_CHARS;")


def test_a_choice_list_longer_than_max_grammar_chars_is_refused() -> None:
    """Counted on its JSON text, the compile's key (600,000 characters of choices compiled in 20 s)."""
    choices = [f"w{i:07d}" for i in range(10_000)]
    assert len(json.dumps(choices)) == 120_000
    StructuredOutputs(choice=choices[:8_000]).validate()
    _refused(StructuredOutputs(choice=choices), "^structured: the choice list's JSON text is longer than 100000 "
                                                "characters \\(MAX_GRAMMAR_CHARS;")


@pytest.mark.parametrize("text", ["(a|b){10001}", "[a-z]{1,50000}", "x{10001,}", "(ab){2147483648}"])
def test_a_count_over_max_repetition_is_refused(text: str) -> None:
    _refused(StructuredOutputs(regex=text), "^structured: the regex repeats an item [0-9]+ times, more than 10000 "
                                            "\\(MAX_REPETITION\\)$")


def test_a_grammars_counts_are_bounded_too_lark_ranges_as_well() -> None:
    for grammar in ('root ::= [a-z]{1,20000}', 'start: "a" ~ 10001', 'start: "a"~1..50000',
                    'start: NAME\nNAME: /[a-z]{1,20000}/'):
        _refused(StructuredOutputs(grammar=grammar), "^structured: the grammar repeats an item [0-9]+ times, more "
                                                     "than 10000 \\(MAX_REPETITION\\)$")
    StructuredOutputs(grammar='start: "a"~1..10000').validate()


@pytest.mark.parametrize("regex", [
    r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z",  # a timestamp
    ".{0,1000}", '[^"]{0,100}', r"\S{1,100} \S{1,100}",  # one wide repetition, or the same one again
    ".{0,100},.{0,101}",  # two: 7.4 s
    ",".join(f"[^,]{{1,{50 + i}}}" for i in range(10)),  # ten delimited fields: 0.5 s idle (no cost bound, below)
    ",".join(f".{{0,{100 + i}}}" for i in range(5)),  # five distinct wide ones: 5 s idle, left to the timeout
    "[a-z]{1,100}[0-9]{1,100}" * 20,  # the same items and counts again: 0.7 s
    "((a{100}|b){100}){100}", "(a|b){10000}", "[a-z]{1,10000}",  # 0.002 s, 0.001 s, 1.3 s
    ",".join(f"[a-z]{{1,{10 + i}}}" for i in range(20)),  # twenty narrow ones: 2.4 s
    "." * 200, "[a-z]" * 2000,  # written out: 5 s, 4.9 s
    "a~20000", r"x\{100000\}", "[{]{100}",  # a regex's "~", escaped braces, a brace in a class
])
def test_regexes_that_compile_in_seconds_at_most_pass(regex: str) -> None:
    StructuredOutputs(regex=regex).validate()


@pytest.mark.parametrize("grammar", [
    'root ::= "a{100000}" [a-z]{1,100}',  # a quoted string's braces are its text
    'root ::= item{2,5}\nitem ::= [^"]{0,100}',
    'start: ("a" | "b") ~ 3\n',
    'start: NAME\nNAME: /[a-z]{1,1000}/',
    "root ::= " + " ".join(f"r{i}" for i in range(1000)) + "\n"
    + "\n".join(f'r{i} ::= "x" [^,]+' for i in range(1000)),  # 1,000 rules of a starred wide class: 2.6 s
])
def test_grammars_that_compile_in_seconds_at_most_pass(grammar: str) -> None:
    StructuredOutputs(grammar=grammar).validate()


def test_a_repetition_after_an_escaped_backslash_counts() -> None:
    r"""``\\{n}`` repeats a literal backslash n times (the brace is not escaped: the backslash before it is); ``\{n}``
    is a literal brace, and ``\\\{n}`` a backslash and a brace."""
    _refused(StructuredOutputs(regex=r"a\\{100000}"), "repeats an item 100000 times")
    StructuredOutputs(regex=r"a\{100000}").validate()
    StructuredOutputs(regex=r"a\\\{100000}").validate()


def test_a_json_schemas_patterns_are_bounded_as_regexes() -> None:
    """``pattern`` values and ``patternProperties`` keys anywhere in the schema: xgrammar compiles them as regexes."""
    deep = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string",
                                                                              "pattern": "[a-z]{1,20000}"}}}}
    _refused(StructuredOutputs(json=deep), "^structured: the json schema's pattern repeats an item 20000 times, more "
                                           "than 10000 \\(MAX_REPETITION\\)$")
    keys = {"type": "object", "patternProperties": {"x" * (MAX_GRAMMAR_CHARS + 1): {"type": "string"}}}
    _refused(StructuredOutputs(json=keys), "^structured: the json schema's pattern is longer than 100000 characters")
    StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{1,100}"},
                                                             "b": {"type": "string", "maxLength": 100000}}}).validate()
