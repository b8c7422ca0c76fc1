"""Tool-call parsers where a reply's calls start or end: an object the end cut off, calls after text."""

from __future__ import annotations

import json

from asyncllm.tool_calls import get_tool_parser


def test_llama3_json_reads_a_call_inside_an_object_the_end_cut_off_and_deep_cut_nesting_as_text() -> None:
    """An object the reply's end cut off is text and the ``{`` after it is tried (a call inside it is found); a reply
    of objects nested thousands deep that never close is text, read again only up to a bound (not once per level)."""
    parser = get_tool_parser("llama3_json")
    parsed = parser.parse('{"data": {"name": "add", "parameters": {"a": 1}}, "more": [')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 1})]
    deep = '{"": ' * 6000
    assert parser.parse(deep).content == deep and not parser.parse(deep).tool_calls


def test_phi4_mini_json_finds_functools_after_text_as_vllm_searches_for_it() -> None:
    reply = 'Sure. functools[{"name": "add", "arguments": {"a": 1}}] Done.'
    parsed = get_tool_parser("phi4_mini_json").parse(reply)
    assert parsed.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("add", {"a": 1})]
