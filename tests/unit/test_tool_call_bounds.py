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


def test_llama3_json_rereads_of_deep_nesting_that_breaks_mid_reply_are_bounded(monkeypatch) -> None:
    """Objects nested thousands deep that break before the reply's end (``{"a": {"a": ... x``): each ``{`` was read
    again to the break, once per level, on the server's event loop (3,000 levels in pieces of 4 characters: 15 s;
    2026-12-08); now the characters read again are bounded as at the reply's end, the text is content as before,
    and a call after it is read."""
    from asyncllm import json_stream

    read = []
    feed = json_stream.JsonObjectScanner.feed
    monkeypatch.setattr(json_stream.JsonObjectScanner, "feed",
                        lambda self, text: read.append(len(text)) or feed(self, text))
    text = '{"a": ' * 3000 + 'x {"name": "add", "parameters": {"a": 1}}'
    stream = get_tool_parser("llama3_json").delta_stream(True)
    parts = [p for i in range(0, len(text), 4) for p in stream.feed(text[i:i + 4])] + stream.finish()
    assert sum(read) < 20 * len(text) + 70_000, sum(read)
    assert "".join(p for p in parts if isinstance(p, str)) == text[:text.index('{"name"')]
    calls = [p for p in parts if not isinstance(p, str)]
    assert [p.name for p in calls if p.name] == ["add"] and "".join(p.arguments for p in calls) == '{"a": 1}'
    assert calls[-1].done
