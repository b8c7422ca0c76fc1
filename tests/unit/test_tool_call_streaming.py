"""An ``auto`` call's arguments streamed as they are generated: the JSON scanner, the hermes parser, `ChatReply`."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.json_stream import JsonObjectScanner
from asyncllm.tool_calls import ToolCallDelta, get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
ARGUMENTS = {"city": "Paris \"centre\"\n", "days": [1, 2.50, -0, 1e2], "ok": True, "none": None, "deep": {"x": {}},
             "unicode": "é😀\u2028", "empty": []}


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 6)
        out.append(text[pos:pos + size])
        pos += size
    return out


def _canonical(text: str, chunks: list[str] | None = None) -> tuple[JsonObjectScanner, int]:
    """`text` as the value of key "v" of an object, fed in `chunks` (or one character at a time)."""
    scanner, used = JsonObjectScanner(), 0
    for piece in chunks or ['{"v": ', *text, "}"]:
        used += scanner.feed(piece)
    return scanner, used


def _reply(parallel: bool | None = None, stream_arguments: bool = True, parser: str = "hermes") -> ChatReply:
    return ChatReply(tool_mode(TOOLS, "auto", parallel, get_tool_parser(parser)), stream_arguments=stream_arguments)


def _streamed(pieces: list[str], finish_reason: str = "stop", parallel: bool | None = None, parser: str = "hermes"
              ) -> tuple[list[dict], str | None]:
    reply = _reply(parallel, parser=parser)
    deltas = [d for piece in pieces for d in reply.feed(piece)]
    more, finish = reply.finish(finish_reason)
    return deltas + more, finish


def _whole(text: str, finish_reason: str = "stop", parallel: bool | None = None, parser: str = "hermes"
           ) -> tuple[dict, str | None]:
    reply = _reply(parallel, stream_arguments=False, parser=parser)
    deltas = reply.feed(text)
    more, finish = reply.finish(finish_reason)
    return merge_deltas(deltas + more, tools=True), finish


def _call_items(deltas: list[dict]) -> list[dict]:
    return [item for d in deltas for item in d.get("tool_calls", ())]


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)
formats = st.fixed_dictionaries({"ensure_ascii": st.booleans(), "indent": st.sampled_from([None, 0, 2, "\t"]),
                                 "separators": st.sampled_from([None, (",", ":"), (" , ", " :  ")])})


@settings(max_examples=200, deadline=None)
@given(value=json_values, options=formats, seed=st.integers(0, 2**16))
def test_scanner_writes_what_json_dumps_writes(value: object, options: dict, seed: int) -> None:
    text = json.dumps({"v": value, "w": 1}, **options)
    scanner, used = _canonical(text, _pieces(text + " tail", random.Random(seed)))
    assert not scanner.error and scanner.done and used == len(text)  # nothing after the "}" is read
    assert scanner.value("v") == json.dumps(value, ensure_ascii=False) and scanner.finished == {"v", "w"}
    assert "".join(scanner.text) == json.dumps({"v": value, "w": 1}, ensure_ascii=False)


def test_scanner_escapes_numbers_and_surrogates() -> None:
    cases = {r'"a\/b\u00e9\ud83d\ude00\n\u001f"': '"a/bé😀\\n\\u001f"',
             r'"\ud800x\udc00\ud83d\n"': '"\ud800x\udc00\ud83d\\n"',  # unpaired surrogates stay as they are
             r'"\uD83D\uDE00"': '"😀"', "[1.50, 1E2, -0, 0.0, 1e400, -Infinity, NaN]": "[1.5, 100.0, 0, 0.0, Infinity, "
                                                                                      "-Infinity, NaN]",
             '{"a":{"b":[]}, "c" : ""}': '{"a": {"b": []}, "c": ""}', '{"k": 1, "k": 2}': '{"k": 1, "k": 2}'}
    for text, expected in cases.items():
        scanner, _ = _canonical(text)
        assert scanner.value("v") == expected, text
        if '"k"' not in text:  # an object that repeats a key keeps both copies: json.loads keeps the last
            assert expected == json.dumps(json.loads(text), ensure_ascii=False)


FRAGMENTS = ['{', '}', '[', ']', ',', ':', '"a"', '"', '1', '-', '0', '.', 'e', '+', 'true', 'nul', 'l', ' ', '\t',
             '\\', 'u', 'd83d', '\\ude00', '\\n', 'x', '\n', '\x01', 'NaN', '2']


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=14), seed=st.integers(0, 2**16))
def test_scanner_refuses_what_json_loads_refuses(parts: list[str], seed: int) -> None:
    text = '{"v": ' + "".join(parts)
    scanner, used = _canonical(text, _pieces(text, random.Random(seed)))
    accepted = scanner.done and not scanner.error and not text[used:].strip()
    try:
        value = json.loads(text.strip())
    except ValueError:
        value = None
    assert accepted == isinstance(value, dict), text
    if accepted and "v" in value and not (isinstance(value["v"], float) and math.isnan(value["v"])):
        assert json.loads(scanner.value("v")) == value["v"]


def test_scanner_refuses_a_number_or_literal_at_its_first_wrong_character() -> None:
    """Not once the character after it comes: a stream holding the object releases it as text at once."""
    for bad in ["01", "tx", "1.e", "--", "-a", "nulx", "Nan", "1e+-", "Infinit1"]:
        scanner = JsonObjectScanner()
        scanner.feed('{"a": ' + bad)
        assert scanner.error, bad
    for good in ["0", "1.", "1e-", "-", "-Inf", "nul", "1.5E+", "NaN", "-0.0e1", "fals"]:
        scanner = JsonObjectScanner()
        scanner.feed('{"a": ' + good)
        assert not scanner.error and not scanner.done, good


@settings(max_examples=100, deadline=None)
@given(value=st.dictionaries(st.text(max_size=4), json_values, max_size=4), options=formats,
       name_first=st.booleans(), seed=st.integers(0, 2**16))
def test_hermes_streamed_arguments_join_to_the_whole_replys(value: dict, options: dict, name_first: bool,
                                                            seed: int) -> None:
    keys = [("name", "f"), ("arguments", value)]
    body = json.dumps(dict(keys if name_first else keys[::-1]), **options)
    text = f"Checking.\n<tool_call>\n{body}\n</tool_call><tool_call>{{\"name\": \"g\"}}</tool_call>"
    message, finish = _whole(text)
    assert finish == "tool_calls" and message["content"] == "Checking.\n"
    assert _calls(message) == [("f", json.dumps(value, ensure_ascii=False)), ("g", "{}")]  # as before streaming
    deltas, finish = _streamed(_pieces(text, random.Random(seed)))
    items = _call_items(deltas)
    firsts = [item for item in items if "id" in item]
    assert [(i["index"], i["type"], i["function"]) for i in firsts] == [
        (0, "function", {"name": "f", "arguments": ""}), (1, "function", {"name": "g", "arguments": ""})]
    assert all("name" not in item["function"] for item in items if "id" not in item)
    assert finish == "tool_calls" and merge_deltas(deltas, tools=True) == {**message, "tool_calls": [
        {**call, "id": first["id"]} for call, first in zip(message["tool_calls"], firsts)]}


def test_arguments_flow_as_they_are_generated() -> None:
    reply = _reply()
    first = reply.feed('Sure. <tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    call_id = first[1]["tool_calls"][0]["id"]
    assert call_id.startswith("call_") and first == [
        {"content": "Sure. "},
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}]
    assert reply.feed('ris", "n": 1') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris", "n": '}}]}]
    # a number waits for its end; the object's own "}" and the closing tag's start are not arguments
    assert reply.feed("0}}\n</tool_") == [{"tool_calls": [{"index": 0, "function": {"arguments": "10}"}}]}]
    assert reply.feed("call>") == [] and reply.finish("stop") == ([], "tool_calls")


def test_a_closing_tag_never_reaches_the_arguments() -> None:
    valid = '<tool_call>{"name": "f", "arguments": {"x": "a<b</tool</tool_cal"}}</tool_call>'
    message, _ = _whole(valid)
    assert _calls(message) == [("f", '{"x": "a<b</tool</tool_cal"}')]
    for pieces in (list(valid), _pieces(valid, random.Random(3))):
        assert _calls(merge_deltas(_streamed(pieces)[0], tools=True)) == _calls(message)
    # the block ends at the first closing tag, even inside a string: there its JSON broke off
    broken = '<tool_call>{"name": "f", "arguments": {"x": "a</tool_call>"}}</tool_call>'
    deltas, finish = _streamed(list(broken))
    assert finish == "stop" and "".join(i["function"]["arguments"] for i in _call_items(deltas)) == '{"x": "a'
    assert merge_deltas(deltas, tools=True)["content"] == broken == _whole(broken)[0]["content"]


def test_a_call_that_breaks_after_its_first_piece_stays_and_its_text_is_content() -> None:
    cases = [('<tool_call>{"name": "f", "arguments": {"x": 1}, }</tool_call>done', "stop", '{"x": 1}'),
             ('<tool_call>{"name": "f", "arguments": {"x": 1}} junk</tool_call>', "stop", '{"x": 1}'),
             ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', "stop", ""),  # not an object
             ('<tool_call>{"name": "f", "arguments": {"x": "ab', "length", '{"x": "ab')]  # cut by max_tokens
    for text, reason, sent in cases:
        whole, whole_finish = _whole(text, reason)
        assert whole == {"role": "assistant", "content": text} and whole_finish == reason  # nothing lost, no call
        for pieces in ([text], list(text)):
            deltas, finish = _streamed(pieces, reason)
            message = merge_deltas(deltas, tools=True)
            assert finish == reason and message["content"] == text, text
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("f", sent)]
    renamed = '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'
    assert _calls(_whole(renamed)[0]) == [("g", "{}")]  # as json.loads reads it: the last copy
    for pieces in ([renamed], list(renamed)):  # streamed, "f" went out first: the call broke
        message = merge_deltas(_streamed(pieces)[0], tools=True)
        assert _calls(message) == [("f", "{}")] and message["content"] == renamed


def test_arguments_before_the_name_come_when_the_name_does() -> None:
    text = '<tool_call>{"arguments": {"a": [1, 2.50]}, "name": "f"}</tool_call>'
    reply = _reply()
    items = _call_items([d for char in text for d in reply.feed(char)])
    assert [item["function"] for item in items] == [{"name": "f", "arguments": ""}, {"arguments": '{"a": [1, 2.5]}'}]
    assert _calls(_whole(text)[0]) == [("f", '{"a": [1, 2.5]}')]


def test_not_parallel_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    deltas, finish = _streamed(list(text), parallel=False)
    assert finish == "tool_calls" and {item["index"] for item in _call_items(deltas)} == {0}
    assert _calls(merge_deltas(deltas, tools=True)) == _calls(_whole(text, parallel=False)[0]) == [("f", '{"a": 1}')]


@pytest.mark.parametrize("after", [["x\n"], ["x", "\n"], ["x", " ", "\n"]])
def test_content_after_a_call_keeps_its_whitespace_however_it_comes(after: list[str]) -> None:
    """Whitespace after a call is not content until content follows; once it has, whitespace is content as it comes:
    "x\n" after a call is content whole or in pieces (before 2026-12-07 a "\n" piece of its own was dropped)."""
    pieces = ["\n", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "\n", *after]

    def content(fed: list[str]) -> str:
        stream = get_tool_parser("hermes").delta_stream(stream_arguments=False)
        parts = [part for piece in fed for part in stream.feed(piece)] + stream.finish()
        return "".join(part for part in parts if isinstance(part, str))

    assert content(pieces) == content(["".join(pieces)]) == "\n\n" + "".join(after)


def test_whole_streams_report_one_piece_per_call() -> None:
    stream = get_tool_parser("hermes").delta_stream(stream_arguments=False)
    parts = stream.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>') + stream.finish()
    assert len(parts) == 1 and isinstance(parts[0], ToolCallDelta) and parts[0].done
    assert (parts[0].index, parts[0].name, parts[0].arguments) == (0, "f", '{"a": 1}')
    stream = get_tool_parser("pythonic").delta_stream()  # read whole at the reply's end, streamed or not
    assert stream.feed("[f(a=1)]") == []
    (part,) = stream.finish()
    assert (part.name, part.arguments, part.done) == ("f", '{"a": 1}', True)


@pytest.mark.parametrize("seed", range(3))
def test_responses_api_events_carry_the_streamed_arguments(seed: int) -> None:
    from asyncllm.integrations.responses_api import ResponseEvents, ResponsesRequest

    text = 'Hi.<tool_call>{"name": "f", "arguments": {"a": "x y"}}</tool_call><tool_call>{"name": "g"}</tool_call>'
    deltas, finish = _streamed(_pieces(text, random.Random(seed)))
    events = ResponseEvents(ResponsesRequest(model="m", input="hi"), "m")
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    payloads = [json.loads(e.split(b"data: ", 1)[1]) for e in events.feed(deltas) + events.finish(finish, usage)]
    output = payloads[-1]["response"]["output"]
    assert [(item["type"], item.get("name"), item.get("arguments")) for item in output] == [
        ("message", None, None), ("function_call", "f", '{"a": "x y"}'), ("function_call", "g", "{}")]
    arguments = "".join(p["delta"] for p in payloads if p["type"] == "response.function_call_arguments.delta")
    assert arguments == '{"a": "x y"}{}'


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.dictionaries(st.text(max_size=4), json_values, max_size=3), min_size=1, max_size=3),
       tag=st.booleans(), seed=st.integers(0, 2**16))
def test_llama3_json_streams_each_objects_arguments(values: list[dict], tag: bool, seed: int) -> None:
    objects = [json.dumps({"name": "fg"[i % 2], "parameters": value}) for i, value in enumerate(values)]
    text = ("<|python_tag|>" if tag else "") + ";\n".join(objects)
    message, finish = _whole(text, parser="llama3_json")
    assert finish == "tool_calls" and message["content"] is None
    assert _calls(message) == [("fg"[i % 2], json.dumps(v, ensure_ascii=False)) for i, v in enumerate(values)]
    deltas, finish = _streamed(_pieces(text, random.Random(seed)), parser="llama3_json")
    firsts = [item for item in _call_items(deltas) if "id" in item]
    assert [item["function"]["arguments"] for item in firsts] == [""] * len(values)
    assert finish == "tool_calls" and _calls(merge_deltas(deltas, tools=True)) == _calls(message)


def test_hermes_arguments_serialized_as_a_string_are_that_object() -> None:
    # Granite 4 writes them so; vLLM's test_hermes_parser_non_streaming_serialized_arguments decodes them
    text = '<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>'
    assert _calls(_whole(text)[0]) == [("get_db_config", '{"param": "max_connections"}')]
    for pieces in ([text], list(text)):
        assert _calls(merge_deltas(_streamed(pieces)[0], tools=True)) == [("get_db_config", '{"param": "max_connections"}')]


LLAMA3_REPLIES = [  # vLLM's tests/tool_parsers/test_llama3_json_tool_parser.py cases, and the text around them
    ('Here is the result: {"name": "f", "parameters": {}} Would you like to know more?', "Here is the result:",
     [("f", "{}")]),
    ('{"name": "f", "parameters": {"q": "t"}} I used {f} for this.', "", [("f", '{"q": "t"}')]),
    ('{"name": "f", "parameters": {"q": "t"}} I passed {"q": "t"}', "", [("f", '{"q": "t"}')]),
    ('{hi {"name": "f", "arguments": {}};\n{"name": "g", "parameters": {"a": [1]}} ; ', "{hi",
     [("f", "{}"), ("g", '{"a": [1]}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": [1]}', "", [("f", '{"a": 1}')]),
    ('{"name": "f"}', '{"name": "f"}', []),  # neither parameters nor arguments: no call
    ('{"name": "f", "parameters": {invalid json}', '{"name": "f", "parameters": {invalid json}', []),
    ('{"a": {"name": "f", "parameters": {}}', '{"a":', [("f", "{}")]),  # the outer object never closes
]


@pytest.mark.parametrize("text, before, calls", LLAMA3_REPLIES)
def test_llama3_json_reads_call_objects_anywhere_in_the_reply(text: str, before: str, calls: list) -> None:
    # with calls, no content (vLLM's content is None); streamed, the text before the first call went out already
    message, finish = _whole(text, parser="llama3_json")
    assert (message["content"], _calls(message), finish) == (
        None if calls else before, calls, "tool_calls" if calls else "stop")
    for pieces in (list(text), _pieces(text, random.Random(1))):
        deltas, finish = _streamed(pieces, parser="llama3_json")
        streamed = merge_deltas(deltas, tools=True)
        assert (streamed["content"] or "").strip() == before and finish == ("tool_calls" if calls else "stop")
        assert _calls(streamed)[:len(calls)] == calls  # then a call that started streaming and broke, if any


AS_WRITTEN = ' {"z":1,  "a" : "\\u00e9\\n",\n "b": [1.0, 2e3]} '  # spacing, key order, escapes json.dumps would change
AS_WRITTEN_REPLIES = {  # vLLM passes these formats' arguments on as the model wrote them (kimi_k2's regex: stripped)
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n" + AS_WRITTEN
                    + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", AS_WRITTEN),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>" + AS_WRITTEN
                     + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", AS_WRITTEN),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>" + AS_WRITTEN
                + "<|tool_call_end|><|tool_calls_section_end|>", AS_WRITTEN.strip()),
}


@pytest.mark.parametrize("parser", sorted(AS_WRITTEN_REPLIES))
def test_block_call_arguments_are_the_models_text(parser: str) -> None:
    text, arguments = AS_WRITTEN_REPLIES[parser]
    message, finish = _whole(text, parser=parser)
    assert (message["content"], _calls(message), finish) == (None, [("f", arguments)], "tool_calls")
    deltas, finish = _streamed(_pieces(text, random.Random(0)), parser=parser)
    assert _calls(merge_deltas(deltas, tools=True)) == [("f", arguments)] and finish == "tool_calls"


COMMON = ['{"name": "f", ', '"arguments": {"x": [1, "a"]}', "}", "{", '"name": "g"', ", ", "\n", " ", "text", '"', "1",
          '{"name": "f", "arguments": {}}', '{"y": 2}', "\xa0"]
REPLY_FRAGMENTS = {"hermes": COMMON + ["<tool_call>", "</tool_call>", "<", "</"],
                   "llama3_json": COMMON + ["<|python_tag|>", '"parameters": {"z": null}', ";", "<|python"],
                   "mistral": COMMON + ["[TOOL_CALLS]", "[ARGS]", "f", "[", "]", ",", "[TOOL_", "[AR"]}


def _content_after_a_call(pieces: list[str]) -> list[str]:
    """The content a streamed ``llama3_json`` reply has after its first whole call."""
    stream = get_tool_parser("llama3_json").delta_stream()
    parts = [part for piece in pieces for part in stream.feed(piece)] + stream.finish()
    first = next(i for i, part in enumerate(parts) if isinstance(part, ToolCallDelta) and part.done)
    return [part for part in parts[first:] if isinstance(part, str) and part]


@settings(max_examples=200, deadline=None)
@given(parser=st.sampled_from(sorted(REPLY_FRAGMENTS)), data=st.data(), seed=st.integers(0, 2**16),
       reason=st.sampled_from(["stop", "length"]))
def test_streamed_form_is_the_whole_form_and_the_calls_that_broke(parser: str, data: st.DataObject, seed: int,
                                                                  reason: str) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(REPLY_FRAGMENTS[parser]), max_size=12)))
    whole, whole_finish = _whole(text, reason, parser=parser)
    deltas, finish = _streamed(_pieces(text, random.Random(seed)), reason, parser=parser)
    streamed = merge_deltas(deltas, tools=True)
    assert finish == whole_finish
    if parser == "llama3_json" and _calls(whole):  # no content; streamed, none after the first whole call
        assert whole["content"] is None and _content_after_a_call(_pieces(text, random.Random(seed))) == []
    else:
        assert "".join((streamed["content"] or "").split()) == "".join((whole["content"] or "").split())
    remaining = iter(_calls(streamed))
    assert all(call in remaining for call in _calls(whole))  # the whole form's calls, in order, among the streamed


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.dictionaries(st.text(max_size=4), json_values, max_size=3), min_size=1, max_size=3),
       listed=st.booleans(), seed=st.integers(0, 2**16))
def test_mistral_streams_arguments_in_both_formats(values: list[dict], listed: bool, seed: int) -> None:
    names = ["fg"[i % 2] for i in range(len(values))]
    if listed:  # tokenizers before v11
        text = "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": v} for n, v in zip(names, values)])
    else:
        text = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(v, separators=(',', ':'))}" for n, v in zip(names, values))
    message, finish = _whole(text, parser="mistral")
    assert finish == "tool_calls" and message["content"] is None
    assert _calls(message) == [(n, json.dumps(v, ensure_ascii=False)) for n, v in zip(names, values)]
    deltas, finish = _streamed(_pieces(text, random.Random(seed)), parser="mistral")
    assert [item["function"] for item in _call_items(deltas) if "id" in item] == [
        {"name": n, "arguments": ""} for n in names]
    assert finish == "tool_calls" and _calls(merge_deltas(deltas, tools=True)) == _calls(message)


def test_mistral_replies_that_are_not_calls_are_content() -> None:
    for text in ('[TOOL_CALLS]f[ARGS]{"x": ', "[TOOL_CALLS]f{}", "[TOOL_CALLS][1]", "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][]",
                 '[TOOL_CALLS]f[ARGS]{"s": "[TOOL_CALLS]"}', "[TOOL_CALLS]f[ARGS]{}\xa0[TOOL_CALLS]g[ARGS]{}",
                 '[TOOL_CALLS][{"name": "f"},]', "Bonjour."):
        assert _whole(text, parser="mistral") == ({"role": "assistant", "content": text}, "stop"), text
        deltas, finish = _streamed(list(text), parser="mistral")
        assert finish == "stop" and merge_deltas(deltas, tools=True)["content"] == text
    assert _calls(_whole("[TOOL_CALLS] f [ARGS] {} \xa0", parser="mistral")[0]) == [("f", "{}")]


@pytest.mark.parametrize("text, content, calls", [  # vLLM's tests/tool_parsers/test_mistral_tool_parser.py cases
    ('Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello", [("add", '{"a": 1, "b": 2}')]),
    ('[TOOL_CALLS] [{"name": "f", "arguments":{"city": "Dallas"}}]\nextra trailing data', None,
     [("f", '{"city": "Dallas"}')]),  # what follows the list is not read, as vLLM's raw_decode
    ('hi{hi[TOOL_CALLS]bash[ARGS]{"command": "re.compile(r\'{}\')"}', "hi{hi", [("bash", '{"command": "re.compile(r\'{}\')"}')]),
    ("I will add them.[TOOL_CALLS]add[ARGS]{\"a\": 1}[TOOL_CALLS]f[ARGS]{}", "I will add them.",
     [("add", '{"a": 1}'), ("f", "{}")]),
])
def test_mistral_content_comes_before_the_calls(text: str, content: str | None, calls: list) -> None:
    message, finish = _whole(text, parser="mistral")
    assert (message["content"], _calls(message), finish) == (content, calls, "tool_calls")
    for pieces in (list(text), _pieces(text, random.Random(2))):
        deltas, finish = _streamed(pieces, parser="mistral")
        streamed = merge_deltas(deltas, tools=True)
        assert (streamed["content"], _calls(streamed), finish) == (content, calls, "tool_calls")
    broken = "Hello[TOOL_CALLS]f[ARGS]{"  # calls that do not read: all of the reply is content
    assert _whole(broken, parser="mistral")[0]["content"] == broken
    assert merge_deltas(_streamed(list(broken), parser="mistral")[0], tools=True)["content"] == broken


def test_mistral_keeps_only_what_may_start_its_opener_before_the_calls() -> None:
    """Content before ``[TOOL_CALLS]`` goes out as it comes; the stream holds back only a possible opener's start,
    so a long reply is read in linear time (it re-joined and searched the whole reply on every piece)."""
    stream = get_tool_parser("mistral").stream()
    sent = [stream.feed("hello [TOOL")[0] for _ in range(2000)]
    held = "".join(stream._parts._text)
    assert held == "[TOOL" and "".join(sent) + held == "hello [TOOL" * 2000


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("before, between", [("Hi ", "\n"), ("\n\n", "\n"), ("", " \n ")])
def test_whitespace_around_calls_is_the_same_whole_and_streamed(parser: str, before: str, between: str) -> None:
    """Text before the first call is content as written (vLLM's: whitespace too); whitespace between calls and after
    the last is not, whether the reply came in one piece or token by token."""
    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' if parser == "hermes"
            else "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    text = before + call + between + call + "\n"
    whole, _ = _whole(text, parser=parser)
    streamed = merge_deltas(_streamed(list(text), parser=parser)[0], tools=True)
    assert whole["content"] == streamed["content"] == (before or None)
    assert len(whole["tool_calls"]) == len(streamed["tool_calls"]) == 2


def test_leading_whitespace_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``granite``'s reply is calls only when it opens with its tag after any whitespace: while only whitespace has
    come, each new piece of it is read once, not the whole reply again (a reply looping on whitespace cost the event
    loop seconds: quadratic time)."""
    from asyncllm import tool_call_replies

    read = [0]
    decide = tool_call_replies._CallsReplyStream._decide

    def counted(stream: tool_call_replies._CallsReplyStream) -> list:
        read[0] += sum(map(len, stream._text))
        return decide(stream)

    monkeypatch.setattr(tool_call_replies._CallsReplyStream, "_decide", counted)
    pieces, stream, parts = 3000, get_tool_parser("granite").delta_stream(), []
    for text in ["\n", *[" \n"] * pieces, '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}]']:
        parts += stream.feed(text)
    parts += stream.finish()
    calls = [p for p in parts if isinstance(p, ToolCallDelta)]
    assert not [p for p in parts if isinstance(p, str)] and calls[0].name == "f"
    assert "".join(c.arguments for c in calls) == '{"a": 1}'
    assert read[0] < 20 * pieces
