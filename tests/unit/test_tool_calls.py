"""Tool calling without a model: the parsers (whole and streamed), tool checks, template messages, tool modes."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.tokenizer import template_messages
from asyncllm.tool_calls import check_tools, get_tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add"}}
HERMES_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def _streamed(parser_name: str, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """`text` fed in random pieces: the content and the (name, arguments) of the calls."""
    rng, stream, content, calls, pos = random.Random(seed), get_tool_parser(parser_name).stream(), "", [], 0
    while pos < len(text):
        size = rng.randint(1, 7)
        piece_content, piece_calls = stream.feed(text[pos:pos + size])
        content, calls, pos = content + piece_content, calls + piece_calls, pos + size
    tail, more = stream.finish()
    return content + tail, [(c.name, c.arguments) for c in calls + more]


def _fed_in_pieces(reply: ChatReply, text: str, seed: int, most: int) -> tuple[list[dict], list[dict], str | None]:
    """`text` fed to `reply` in random pieces of 1 to `most` characters: its deltas, then those and the
    finish_reason of its end."""
    rng, deltas, pos = random.Random(seed), [], 0
    while pos < len(text):
        size = rng.randint(1, most)
        deltas += reply.feed(text[pos:pos + size])
        pos += size
    more, finish = reply.finish("stop")
    return deltas, more, finish


def test_hermes_reply_with_two_calls() -> None:
    parsed = get_tool_parser("hermes").parse(HERMES_REPLY)
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in parsed.tool_calls}) == 2 and parsed.tool_calls[0].id.startswith("call_")


@pytest.mark.parametrize("seed", range(6))
def test_hermes_streamed_in_any_pieces_equals_whole(seed: int) -> None:
    content, calls = _streamed("hermes", HERMES_REPLY, seed)
    assert content == "Let me look.\n"  # streamed content keeps its trailing newline; nothing else is content
    assert calls == [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]


def test_hermes_keeps_text_that_is_not_a_call() -> None:
    parser = get_tool_parser("hermes")
    assert parser.parse("just text").content == "just text" and parser.parse("just text").tool_calls == []
    bad = "a <tool_call>{not json}</tool_call> b"
    assert parser.parse(bad).content == bad and parser.parse(bad).tool_calls == []
    unfinished = 'x <tool_call>\n{"name": "f", "argu'  # cut by max_tokens: all of it stays
    assert _streamed("hermes", unfinished, 0) == (unfinished, [])
    assert _streamed("hermes", "a <tool_ca", 1) == ("a <tool_ca", [])  # a held-back tag start is flushed


def test_llama3_json_calls_and_content() -> None:
    parser = get_tool_parser("llama3_json")
    parsed = parser.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                          '{"name": "add", "arguments": {"a": 2}}')
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Rome"}), ("add", {"a": 2})]
    assert parser.parse("The weather is fine.").content == "The weather is fine."
    assert parser.parse('{"not": "a call"}').content == '{"not": "a call"}'
    assert _streamed("llama3_json", ' {"name": "add", "parameters": {}}', 2) == ("", [("add", "{}")])
    assert _streamed("llama3_json", "Sure, no tools.", 3) == ("Sure, no tools.", [])


def test_unknown_parser_and_bad_tools_are_named() -> None:
    with pytest.raises(ConfigError, match="tool_call_parser.*hermes"):
        get_tool_parser("nope")
    check_tools([WEATHER, ADD])
    for tools, match in [({"a": 1}, "list"), ([{"type": "function"}], "item 0"),
                         ([{"type": "function", "function": {"name": ""}}], "name"),
                         ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters")]:
        with pytest.raises(InvalidRequestError, match=match):
            check_tools(tools)


def test_template_messages_parse_call_arguments() -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    out = template_messages(messages)
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[2] == messages[2] and messages[1]["content"] is None  # the caller's messages are not changed
    bad = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": "{x"}}]}]
    assert template_messages(bad)[0]["tool_calls"][0]["function"]["arguments"] == {}  # as vLLM: not JSON is {}


def test_tool_modes_refuse_what_they_cannot_take() -> None:
    parser = get_tool_parser("hermes")
    assert tool_mode(None, None, None, None).kind == "none"
    assert tool_mode([WEATHER], "none", None, None).kind == "none"
    assert tool_mode([WEATHER], None, None, parser).kind == "auto"  # auto is the default with tools
    assert [tool_mode([], choice, None, None).kind for choice in ("required", "auto")] == ["none", "none"]  # vLLM's
    cases = [([WEATHER], None, None, "enable-auto-tool-choice"), (None, "required", parser, "needs tools"),
             ([WEATHER], {"type": "function", "function": {"name": "add"}}, parser, "not among"),
             ([WEATHER], "sometimes", parser, "must be")]
    for tools, choice, server_parser, match in cases:
        with pytest.raises(InvalidRequestError, match=match) as info:
            tool_mode(tools, choice, None, server_parser)
        assert info.value.field == "tool_choice"
    named = tool_mode([WEATHER, ADD], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.constraint.json == WEATHER["function"]["parameters"]
    required = tool_mode([WEATHER, ADD], "required", False, None)
    assert required.constraint.json["maxItems"] == 1 and len(required.constraint.json["items"]["anyOf"]) == 2


def _accepts(schema: dict, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


UNIT = {"enum": ["c", "f"], "type": "string"}
PYDANTIC = {"$defs": {"Unit": UNIT}, "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
            "type": "object", "additionalProperties": False}  # what pydantic's model_json_schema() writes


def test_required_lifts_each_tools_defs_to_the_root_as_vllm() -> None:
    tools = [{"type": "function", "function": {"name": name, "parameters": PYDANTIC}} for name in ("a", "b")]
    schema = tool_mode(tools, "required", None, None).constraint.json
    assert schema["$defs"] == {"Unit": UNIT} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert _accepts(schema, '[{"name": "b", "parameters": {"unit": "f"}}]')
    assert not _accepts(schema, '[{"name": "b", "parameters": {"unit": "k"}}]')
    assert PYDANTIC["$defs"] == {"Unit": UNIT}  # the request's tools are left as they came
    other = {"type": "function", "function": {"name": "c", "parameters": {**PYDANTIC, "$defs": {"Unit": {"type": "integer"}}}}}
    with pytest.raises(InvalidRequestError, match="'Unit' has multiple schemas") as info:
        tool_mode([*tools, other], "required", None, None)
    assert info.value.field == "tools"


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_tool_without_parameters_is_called_with_an_empty_object_as_vllm(parameters) -> None:
    tool = {"type": "function", "function": {"name": "now", **({} if parameters is None else {"parameters": parameters})}}
    required = tool_mode([tool], "required", None, None).constraint.json
    named = tool_mode([tool], {"type": "function", "function": {"name": "now"}}, None, None).constraint.json
    assert _accepts(required, '[{"name": "now", "parameters": {}}]') and _accepts(named, "{}")
    assert not _accepts(required, '[{"name": "now", "parameters": {"a": 1}}]') and not _accepts(named, '{"a": 1}')


def test_named_reply_streams_arguments_and_merges() -> None:
    mode = tool_mode([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    reply = ChatReply(mode)
    deltas = reply.feed('{"city"') + reply.feed(': "Oslo"}')
    more, finish = reply.finish("stop")
    assert finish == "stop" and more == []
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert "id" not in deltas[1]["tool_calls"][0]
    message = merge_deltas(deltas, tools=True)
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_required_and_auto_replies() -> None:
    required = ChatReply(tool_mode([WEATHER, ADD], "required", None, None))
    assert required.feed('[{"name": "add", "parameters": {"a": 3}}]') == []
    deltas, finish = required.finish("stop")
    assert finish == "tool_calls" and merge_deltas(deltas, True)["tool_calls"][0]["function"]["arguments"] == '{"a": 3}'
    cut = ChatReply(tool_mode([WEATHER], "required", None, None))
    cut.feed('[{"name": "get_w')
    deltas, finish = cut.finish("length")  # cut short: the text, not a broken call
    assert finish == "length" and merge_deltas(deltas, True) == {"role": "assistant", "content": '[{"name": "get_w'}
    single = ChatReply(tool_mode([WEATHER, ADD], "auto", False, get_tool_parser("hermes")))
    deltas, finish = single.feed(HERMES_REPLY), None
    more, finish = single.finish("stop")
    message = merge_deltas(deltas + more, True)
    assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_pythonic_calls() -> None:
    parser = get_tool_parser("pythonic")
    parsed = parser.parse('[get_weather(city="Paris", days=2), add(a=1, b=[2, 3], exact=True)]')
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 1, "b": [2, 3], "exact": True})]
    assert _streamed("pythonic", '<|python_start|>[f(x="a")]<|python_end|>', 4) == ("", [("f", '{"x": "a"}')])
    for text in ("[1, 2]", "[f(1)]", "[f(x=y)]", "[f(**k)]", "[broken(", "Plain text."):  # not calls: content
        assert parser.parse(text).content == text and parser.parse(text).tool_calls == []
    assert _streamed("pythonic", "Sure.", 5) == ("Sure.", [])


def test_mistral_calls_in_both_formats() -> None:
    parser = get_tool_parser("mistral")
    assert parser.needs_special_tokens and not get_tool_parser("hermes").needs_special_tokens
    old = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {}}]'
    new = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{}'
    for text in (old, new):
        parsed = parser.parse(text)
        assert parsed.content is None
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": "Paris"}), ("add", {})]
        assert _streamed("mistral", text, 7)[1] == [("get_weather", '{"city": "Paris"}'), ("add", "{}")]
    for text in ('[TOOL_CALLS]f[ARGS]{"x": ', "[TOOL_CALLS]f{}", "[TOOL_CALLS][1]", "[TOOL_CALLS][ARGS]{}", "Bonjour."):
        assert parser.parse(text).content == text and parser.parse(text).tool_calls == []


QWEN3_CODER_TOOLS = {"get_weather": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "when": {"type": "object"}, "scale": {"type": "number"}, "code": {"type": "string"}}}}}
QWEN3_CODER_REPLY = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
                     '<parameter=when>\n{"from": "mon"}\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n'
                     "<parameter=code>\n007\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
                     "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>")
QWEN3_CODER_ARGUMENTS = {"city": "Paris", "days": 3, "metric": True, "when": {"from": "mon"}, "scale": 1.5,
                         "code": "007", "note": None}


def test_qwen3_coder_values_are_typed_by_the_tool_schemas() -> None:
    parser = get_tool_parser("qwen3_coder").for_tools(QWEN3_CODER_TOOLS)
    parsed = parser.parse(QWEN3_CODER_REPLY)
    assert parsed.content == "I will check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", QWEN3_CODER_ARGUMENTS), ("get_weather", {})]
    untyped = get_tool_parser("qwen3_coder").parse(QWEN3_CODER_REPLY)  # no schemas: every value a string
    assert json.loads(untyped.tool_calls[0].arguments)["days"] == "3"
    lax = "x <tool_call>\n<function=f>\n<parameter=a>\n1\n</tool_call> y"  # no </parameter>, </function>: vLLM's too
    assert parser.parse(lax).content == "x  y" and [(c.name, c.arguments) for c in parser.parse(lax).tool_calls] == [
        ("f", '{"a": "1"}')]
    bare = "x <tool_call>\n<function=f>\n1\n</tool_call> y"  # text that is no parameter is not read, as vLLM's
    assert parser.parse(bare).content == "x  y" and [(c.name, c.arguments) for c in parser.parse(bare).tool_calls] == [
        ("f", "{}")]
    broken = "x <tool_call>\n1\n<function=f>\n</tool_call> y"  # text before the block's first function
    assert parser.parse(broken).content == broken and parser.parse(broken).tool_calls == []


@pytest.mark.parametrize("seed", range(4))
def test_qwen3_coder_streamed_pieces_join_to_the_whole_calls(seed: int) -> None:
    reply = ChatReply(tool_mode([{"type": "function", "function": f} for f in QWEN3_CODER_TOOLS.values()], "auto",
                                None, get_tool_parser("qwen3_coder")))
    deltas, more, finish = _fed_in_pieces(reply, QWEN3_CODER_REPLY, seed, 9)
    merged = merge_deltas(deltas + more, tools=True)
    assert finish == "tool_calls" and merged["content"] == "I will check.\n"
    assert [json.loads(c["function"]["arguments"]) for c in merged["tool_calls"]] == [QWEN3_CODER_ARGUMENTS, {}]
    pieces = [d for d in deltas if d.get("tool_calls")]
    assert len(pieces) > 3  # arguments came a parameter at a time, not whole at the end


@pytest.mark.parametrize("parser_name, tag", [("granite", "<|tool_call|>"), ("granite", "<tool_call> "),
                                              ("phi4_mini_json", "functools")])
def test_granite_and_phi4_mini_lists_of_calls(parser_name: str, tag: str) -> None:
    reply = tag + '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1}}]'
    expected = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')]
    parsed = get_tool_parser(parser_name).parse(reply)
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    assert all(_streamed(parser_name, reply, seed) == ("", expected) for seed in range(3))
    for text in ("no call here", tag + "[not json]"):  # content, whole
        assert get_tool_parser(parser_name).parse(text).content == text


def test_qwen3_coder_values_json_cannot_write_stay_text() -> None:
    from asyncllm.tool_call_xml import typed_value

    assert typed_value("nan", "number") == "nan" and typed_value("1e999", "number") == "1e999"
    assert typed_value("{1, 2}", "object") == "{1, 2}" and typed_value("NaN", "array") == "NaN"
    assert typed_value("(1, 2)", "array") == (1, 2) and typed_value("x", "integer") == "x"


BLOCK_REPLIES = {
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
                    '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v31": ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     '<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}<｜tool▁call▁end｜>'
                     '<｜tool▁calls▁end｜>'),
    "kimi_k2": ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.add:1'
                '<|tool_call_argument_begin|>{"a": 1, "b": 2}<|tool_call_end|><|tool_calls_section_end|>'),
    "glm45": ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
              "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n"
              "<arg_value>2</arg_value>\n</tool_call>"),
    "minimax_m2": ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n</invoke>\n<invoke name="add">\n<parameter name="a">1</parameter>\n'
                   '<parameter name="b">2</parameter>\n</invoke>\n</minimax:tool_call>'),
    "hunyuan_a13b": ('Checking.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_calls>'),
    "jamba": ('Checking.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_calls>'),
    "seed_oss": ("Checking.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                 "<parameter=b>\n2\n</parameter>\n</function>\n</seed:tool_call>"),
}
ADD_TYPED = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                            "b": {"type": "integer"}}}}
TYPED_FUNCTIONS = {"get_weather": WEATHER["function"], "add": ADD_TYPED}


@pytest.mark.parametrize("parser_name", sorted(BLOCK_REPLIES))
def test_block_formats_whole_and_streamed(parser_name: str) -> None:
    """DeepSeek-V3 / V3.1, Kimi K2, GLM-4.5 and Seed-OSS calls: two calls after some content, the section markers
    not content; streamed in any pieces, the same calls; the schema types the XML-ish values."""
    parser = get_tool_parser(parser_name).for_tools(TYPED_FUNCTIONS)
    assert parser.needs_special_tokens
    parsed = parser.parse(BLOCK_REPLIES[parser_name])
    assert parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    if parser_name == "kimi_k2":
        assert [c.id for c in parsed.tool_calls] == ["functions.get_weather:0", "functions.add:1"]
    for seed in range(3):
        rng, stream, content, calls, pos = random.Random(seed), parser.stream(), "", [], 0
        text = BLOCK_REPLIES[parser_name]
        while pos < len(text):
            size = rng.randint(1, 7)
            piece, more = stream.feed(text[pos:pos + size])
            content, calls, pos = content + piece, calls + more, pos + size
        tail, more = stream.finish()
        assert (content + tail).strip() == "Checking."
        assert [(c.name, json.loads(c.arguments)) for c in calls + more] == [
            ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("parser_name, broken", [
    ("deepseek_v3", "x<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops\n```<｜tool▁call▁end｜>"),
    ("deepseek_v31", "x<｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜>"),
    ("kimi_k2", "x<|tool_call_begin|>f<|tool_call_argument_begin|>{}<|tool_call_end|>"),
    ("glm45", "x<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>"),
    ("minimax_m2", 'x<minimax:tool_call><invoke name="f"><parameter name="a">1</invoke></minimax:tool_call>'),
    ("hunyuan_a13b", 'x<tool_calls>[{"name": "f", "arguments": [1]}]</tool_calls>'),
    ("jamba", "x<tool_calls>not json</tool_calls>"),
])
def test_a_block_that_is_not_a_call_stays_content(parser_name: str, broken: str) -> None:
    parsed = get_tool_parser(parser_name).parse(broken)
    assert parsed.content == broken and parsed.tool_calls == []


@pytest.mark.parametrize("alias, name", [("qwen3_xml", "qwen3_coder"), ("llama4_pythonic", "pythonic"),
                                         ("llama4_json", "llama3_json")])
def test_vllms_other_names_for_the_same_formats(alias: str, name: str) -> None:
    assert type(get_tool_parser(alias)) is type(get_tool_parser(name))


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    """vLLM's ``MistralToolCall`` ids (Mistral's templates refuse others in the next turn), auto, named and required."""
    mistral = get_tool_parser("mistral")
    texts = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', '[TOOL_CALLS][{"name": "add", "arguments": {}}]')
    ids = [call.id for text in texts for call in mistral.parse(text).tool_calls]
    for kind, parts in (("auto", ('[TOOL_CALLS]add[ARGS]{', '}')), ({"type": "function", "function": {"name": "add"}},
                        ("{}",)), ("required", ('[{"name": "add", "parameters": {}}]',))):
        reply = ChatReply(tool_mode([WEATHER, ADD], kind, None, mistral))
        deltas = [d for part in parts for d in reply.feed(part)] + reply.finish("stop")[0]
        ids += [call["id"] for call in merge_deltas(deltas, tools=True)["tool_calls"]]
    assert len(ids) == 5 and all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids), ids
    assert get_tool_parser("hermes").parse(HERMES_REPLY).tool_calls[0].id.startswith("call_")


@pytest.mark.parametrize("parser_name, text", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2]}}\n'),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2]\n</function>\n"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n[2]\n"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n[2]\n</function>\n</tool_c"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n[2]\n</parameter>\n</func"),
])
@pytest.mark.parametrize("seed", range(3))
def test_a_last_call_left_open_is_a_call_streamed_and_whole(parser_name: str, text: str, seed: int) -> None:
    """vLLM's regexes take the last ``<tool_call>`` without ``</tool_call>`` (qwen3_coder's: and a parameter without
    ``</parameter>``, and a reply cut inside the closing tags): the call, its streamed pieces joined to the whole
    call's arguments, and no content."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "array"}}}}}]
    whole = ChatReply(tool_mode(tools, "auto", None, get_tool_parser(parser_name)), stream_arguments=False)
    message = merge_deltas(whole.feed(text) + whole.finish("stop")[0], tools=True)
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "add", "arguments": '{"a": 1, "b": [2]}'}
    deltas, more, finish = _fed_in_pieces(ChatReply(tool_mode(tools, "auto", None, get_tool_parser(parser_name))),
                                          text, seed, 7)
    streamed = merge_deltas(deltas + more, tools=True)
    assert finish == "tool_calls" and streamed["content"] is None
    assert streamed["tool_calls"][0]["function"] == message["tool_calls"][0]["function"]


def test_a_lone_surrogate_in_arguments_stays_an_escape() -> None:
    """``"\\ud83d"`` decodes to a lone surrogate, which UTF-8 cannot encode (the response crashed): it is written
    back as its JSON escape, the same JSON, streamed and whole."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud83d\\ude00 \\ud83d"}}\n</tool_call>'
    for stream_arguments in (False, True):
        reply = ChatReply(tool_mode([WEATHER], "auto", None, get_tool_parser("hermes")), stream_arguments=stream_arguments)
        deltas = [d for i in range(0, len(text), 4) for d in reply.feed(text[i:i + 4])] + reply.finish("stop")[0]
        arguments = merge_deltas(deltas, tools=True)["tool_calls"][0]["function"]["arguments"]
        assert arguments == '{"city": "\U0001f600 \\ud83d"}' and json.loads(arguments) == {"city": "\U0001f600 \ud83d"}
        msgspec.json.encode(deltas)  # what the server sends


def _message(text: str, parallel: bool | None, stream_arguments: bool, seed: int = 0) -> tuple[dict, str | None]:
    """The hermes ``auto`` reply to `text` (streamed: fed in pieces of 1 to 5 characters) as merged deltas."""
    mode = tool_mode([WEATHER, ADD], "auto", parallel, get_tool_parser("hermes"))
    reply = ChatReply(mode, stream_arguments=stream_arguments)
    if not stream_arguments:
        deltas = reply.feed(text)
        more, finish = reply.finish("stop")
        return merge_deltas(deltas + more, tools=True), finish
    deltas, more, finish = _fed_in_pieces(reply, text, seed, 5)
    return merge_deltas(deltas + more, tools=True), finish


@pytest.mark.parametrize("seed", range(4))
def test_whitespace_before_a_block_that_breaks_is_content_streamed_and_whole(seed: int) -> None:
    """A call, newlines, then a block whose name was read but which the reply's end cut (max_tokens): the block is
    content, with the newlines before it (nothing the model wrote is lost, as the whole reply reads it); streamed,
    the newlines were held when its first piece went out, and were dropped (2026-12-08: the forms disagreed)."""
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n\n'
            '<tool_call>\n{"name": "get_weather", "argu')
    cut = '\n\n<tool_call>\n{"name": "get_weather", "argu'
    whole, _ = _message(text, None, stream_arguments=False)
    assert whole["content"] == cut and [c["function"]["name"] for c in whole["tool_calls"]] == ["add"]
    streamed, _ = _message(text, None, stream_arguments=True, seed=seed)
    assert streamed["content"] == cut  # and the broken call as it was sent
    assert [c["function"]["name"] for c in streamed["tool_calls"]] == ["add", "get_weather"]
    content, calls = _streamed("hermes", text, seed)
    assert (content, calls) == (cut, [("add", '{"a": 1}')])


@pytest.mark.parametrize("seed", range(4))
def test_not_parallel_a_broken_first_call_leaves_the_slot_to_the_next_whole_one(seed: int) -> None:
    """``parallel_tool_calls: false`` keeps the first whole call. Streamed, a first call whose JSON then broke went
    out as it was sent (as with parallel calls) and the good call after it was dropped, while the whole reply had
    it (2026-12-08): now both have it, and finish_reason "tool_calls"."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": nope}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": nope}}\n</tool_call>\n'
    whole, finish = _message(text, False, stream_arguments=False)
    assert (whole["content"], finish) == (broken, "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [("add", '{"a": 1}')]
    streamed, finish = _message(text, False, stream_arguments=True, seed=seed)
    assert (streamed["content"], finish) == (broken, "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["tool_calls"]] == [
        ("get_weather", '{"city": '), ("add", '{"a": 1}')]  # the broken one as sent, then the first whole one
    parallel, _ = _message(text, None, stream_arguments=True, seed=seed)
    assert len(parallel["tool_calls"]) == 3


def test_not_parallel_a_first_call_still_open_keeps_the_slot() -> None:
    """``mistral`` calls are whole only at the reply's end: streamed, the second call starts while the first is
    not yet known whole, and is dropped (it is not a broken call's text)."""
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'
    for stream_arguments in (True, False):
        reply = ChatReply(tool_mode([WEATHER, ADD], "auto", False, get_tool_parser("mistral")),
                          stream_arguments=stream_arguments)
        deltas = [d for ch in text for d in reply.feed(ch)]
        more, finish = reply.finish("stop")
        message = merge_deltas(deltas + more, tools=True)
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"] and finish == "tool_calls"


@pytest.mark.parametrize("parser_name, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather\\ud83d", "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather\\ud83d", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather\\udc00", "arguments": {}}]'),
    ("jamba", '<tool_calls>[{"name": "get_weather\\udc00", "arguments": {}}]</tool_calls>'),
])
def test_a_lone_surrogate_in_a_call_name_stays_an_escape(parser_name: str, text: str) -> None:
    """A name decoded from JSON may hold a lone surrogate too: the response could not be encoded (UnicodeEncodeError
    in the server, streamed and whole; 2026-12-08). It is written back as the model wrote it."""
    for stream_arguments in (False, True):
        reply = ChatReply(tool_mode([WEATHER], "auto", None, get_tool_parser(parser_name)),
                          stream_arguments=stream_arguments)
        deltas = [d for i in range(0, len(text), 3) for d in reply.feed(text[i:i + 3])] + reply.finish("stop")[0]
        msgspec.json.encode(deltas)  # what the server sends
        name = merge_deltas(deltas, tools=True)["tool_calls"][0]["function"]["name"]
        assert name == text[text.index("get_weather"):text.index("get_weather") + 17]


@pytest.mark.parametrize("parser_name, text", [
    ("hermes", 'Ok.<tool_call>\n{"name": "now", "arguments": null}\n</tool_call>'),
    ("llama3_json", '{"name": "now", "parameters": null}'),
    ("mistral", 'Ok.[TOOL_CALLS][{"name": "now", "arguments": null}]'),
    ("granite", '<|tool_call|>[{"name": "now", "arguments": null}]'),
    ("phi4_mini_json", 'functools[{"name": "now", "arguments": null}]')])
@pytest.mark.parametrize("seed", range(3))
def test_null_arguments_are_a_call_with_arguments_null_as_vllm(parser_name: str, text: str, seed: int) -> None:
    """vLLM's parsers write ``json.dumps(call["arguments"])``: ``"arguments": null`` is a call whose arguments are
    ``null`` (here it was content, the call's JSON as text; streamed, a started call then that text)."""
    parsed = get_tool_parser(parser_name).parse(text)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("now", "null")]
    assert parsed.content in (None, "Ok.")
    assert _streamed(parser_name, text, seed) == (parsed.content or "", [("now", "null")])
    reply = ChatReply(tool_mode([ADD], "auto", None, get_tool_parser(parser_name)))
    deltas, more, finish = _fed_in_pieces(reply, text, seed, 5)
    message = merge_deltas(deltas + more, True)
    assert finish == "tool_calls" and message["tool_calls"][0]["function"] == {"name": "now", "arguments": "null"}
    assert message["content"] == parsed.content


@pytest.mark.parametrize("stream_arguments", [True, False])
def test_a_required_reply_cut_short_keeps_its_whole_calls(stream_arguments: bool) -> None:
    """``max_tokens`` cut a ``required`` reply after its first call: that call is a call (as vLLM's stream sent
    it), the unfinished one's text content, as an ``auto`` reply's (it was all content: the list's raw JSON)."""
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {"ci'
    reply = ChatReply(tool_mode([WEATHER, ADD], "required", None, None), stream_arguments=stream_arguments)
    assert reply.feed(text) == []
    deltas, finish = reply.finish("length")
    message = merge_deltas(deltas, True)
    assert finish == "length" and message["content"] == '{"name": "get_weather", "parameters": {"ci'
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("add", '{"a": 1}')]
    whole = ChatReply(tool_mode([WEATHER, ADD], "required", None, None), stream_arguments=stream_arguments)
    whole.feed(text[:text.index(", {")])  # cut right after the first call's object: no content
    deltas, finish = whole.finish("length")
    assert merge_deltas(deltas, True)["content"] is None and len(merge_deltas(deltas, True)["tool_calls"]) == 1
