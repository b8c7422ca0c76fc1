"""The ``qwen3_coder`` / ``seed_oss`` XML call reader (asyncllm/tool_call_xml.py): each function of a block a call,
its reading cost and vLLM's ``$``."""

from __future__ import annotations

import json
import random

import pytest

from test_tool_calls import _fed_in_pieces, _streamed

from asyncllm import tool_call_xml
from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.tool_calls import get_tool_parser


def _fed(parser_name: str, text: str, sizes: list[int]) -> list[tuple[str, dict]]:
    """`text` fed in pieces of `sizes` (cycled), then finished: each call's name and arguments."""
    stream, calls, pos, k = get_tool_parser(parser_name).stream(), [], 0, 0
    while pos < len(text):
        calls += stream.feed(text[pos:pos + sizes[k % len(sizes)]])[1]
        pos, k = pos + sizes[k % len(sizes)], k + 1
    calls += stream.finish()[1]
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _held_at_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter the block reader adds the characters it holds to at each read."""
    held = [0]
    read = tool_call_xml._Block._read

    def counted(block: tool_call_xml._Block) -> bool:
        held[0] += len(block._text)
        return read(block)

    monkeypatch.setattr(tool_call_xml._Block, "_read", counted)
    return held


def test_a_long_value_fed_in_small_pieces_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The characters the block reader holds at each read, summed over a reply fed 3 characters at a time, stay
    within a few times the reply's length (read once a piece, a 40 KB value cost seconds of the event loop)."""
    held = _held_at_reads(monkeypatch)
    value = "def f(x):\n    return x > 1  # a line of code\n" * 1000
    small = "".join(f"<parameter=p{i}>\n{i}\n</parameter>\n" for i in range(200))
    text = (f"<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n{value}\n"
            f"</parameter>\n{small}</function>\n</tool_call>")
    calls = _fed("qwen3_coder", text, [3])
    assert calls == [("write", {"path": "a.py", "content": value, **{f"p{i}": str(i) for i in range(200)}})]
    assert held[0] < 3 * len(text), (held[0], len(text))


@pytest.mark.parametrize("sizes", [[3], [7, 2, 11]])
def test_text_after_a_function_is_searched_once(monkeypatch: pytest.MonkeyPatch, sizes: list[int]) -> None:
    """Text after a ``</function>`` up to the next ``<function=`` is not read: fed in pieces that hold a ``>``, the
    search for the next function goes on from where the last one stopped (from the function's end each time, it
    held the whole text each piece: quadratic), and still finds a function whose name is split between pieces."""
    held = _held_at_reads(monkeypatch)
    between = "x > 1 <function=\n not a call\n" * 300
    text = (f"<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n{between}"
            f"ok =><function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    assert _fed("qwen3_coder", text, sizes) == [("f", {"a": "1"}), ("get_weather", {"city": "Paris"})]
    assert held[0] < 10 * len(text), (held[0], len(text))  # a few pieces a read (searched again: 700 times the text)


@pytest.mark.parametrize("parser_name", ["qwen3_coder", "seed_oss"])
@pytest.mark.parametrize("ending, value", [
    ("x\n\n</function>\n</tool_call>", "x"),  # vLLM's `$` leaves out the last newline, then one more goes
    ("x\n\n</tool_call>", "x"),
    ("x\n\n\n", "x"),  # the block cut off by the reply's end: its last newline is left out too
    ("x\n\n\n\n", "x\n"),
    ("x\n</parameter>\n</function>", "x"),
    ("x\n\n</parameter>\n", "x\n"),  # a closed value: one newline at each end, as before
    ("\n\n", ""),
])
def test_a_cut_off_value_loses_newlines_as_vllm_reads_it(parser_name: str, ending: str, value: str) -> None:
    """vLLM's regexes end an open parameter (and a block the reply cuts off) at ``$``, which also matches before a
    last newline: whole and in any pieces, the value is vLLM's."""
    text = "<tool_call>\n<function=f>\n<parameter=a>\n" + ending
    if parser_name == "seed_oss":
        text = text.replace("tool_call>", "seed:tool_call>")
    rng = random.Random(0)
    for sizes in ([len(text)], [1], [rng.randint(1, 5) for _ in range(9)]):
        assert _fed(parser_name, text, sizes) == [("f", {"a": value})], sizes


XML_ADD = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "array"}}}}}, {"type": "function", "function": {"name": "g"}}]
XML_TWO_CALLS = [("add", '{"a": 1, "b": [2]}'), ("g", '{"y": "2"}')]


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2]\n</parameter>\n</function>\n"
    "<function=g>\n<parameter=y>\n2\n</parameter>\n</function>\n</tool_call>",
    # text after a last parameter, around and between the functions: not read, as vLLM's regexes skip it
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\nso\n<parameter=b>\n[2]\n</parameter>\nthen\n"
    "</function>\nand\n<function=g>\n<parameter=y>\n2\n</parameter>\nnow</function>\nend\n</tool_call>",
    # cut off: no </tool_call>, no </function>, no </parameter>, a reply cut inside the closing tags
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n[2]\n</function>\n<function=g>\n<parameter=y>\n2\n",
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n[2]\n</parameter>\n</function>\n<function=g>\n"
    "<parameter=y>\n2\n</parameter>\n</func",
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2]\n</parameter>\n</function>"
    "<function=g>\n<parameter=y>\n2\n</function>\n</tool_c",
])
@pytest.mark.parametrize("seed", range(3))
def test_each_function_of_a_qwen3_coder_block_is_a_call(text: str, seed: int) -> None:
    """Several ``<function=`` in one block are each a call, as vLLM's function regex reads them: whole, and streamed
    in any pieces (whole calls, and arguments as they come), the same calls, with no content."""
    parser = get_tool_parser("qwen3_coder")
    whole = ChatReply(tool_mode(XML_ADD, "auto", None, parser), stream_arguments=False)
    message = merge_deltas(whole.feed(text) + whole.finish("stop")[0], tools=True)
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == XML_TWO_CALLS
    deltas, more, finish = _fed_in_pieces(ChatReply(tool_mode(XML_ADD, "auto", None, parser)), text, seed, 7)
    streamed = merge_deltas(deltas + more, tools=True)
    assert finish == "tool_calls" and streamed["content"] is None
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in message["tool_calls"]]
    assert [d["tool_calls"][0]["index"] for d in deltas if d.get("tool_calls") and "id" in d["tool_calls"][0]] == [
        0, 1]  # the first call's pieces came before the second one's
    untyped = [("add", '{"a": "1", "b": "[2]"}'), ("g", '{"y": "2"}')]  # no schemas: every value a string
    assert _streamed("qwen3_coder", "x " + text, seed) == ("x ", untyped)



@pytest.mark.parametrize("literal", ["{1, 2}", "b'x'", "1j", "{[1]: 2}"])
def test_pythonic_literals_json_cannot_write_are_content(literal: str) -> None:
    """As vLLM's pythonic parser: a reply it cannot turn into JSON arguments is content, never a server error."""
    stream = get_tool_parser("pythonic").stream()
    text = f"[f(a={literal})]"
    content, calls = stream.feed(text)
    more_content, more_calls = stream.finish()
    assert calls + more_calls == [] and content + more_content == text


def test_qwen3_coder_numbers_and_booleans_as_vllm_types_them() -> None:
    typed_value = tool_call_xml.typed_value
    assert [typed_value(text, "number") for text in ("2.0", "1e3", "2.5", "3", "-0.0")] == [2, 1000, 2.5, 3, 0]
    assert all(type(typed_value(text, "number")) is int for text in ("2.0", "1e3"))
    assert [typed_value(text, "boolean") for text in ("true", "TRUE", "false", "yes", "1")] == [
        True, True, False, False, False]  # anything but true is false, as vLLM's
    assert typed_value("7", "unsigned") == 7


@pytest.mark.parametrize("properties", [["city"], "city", 5, True])
@pytest.mark.parametrize("parser_name", ["qwen3_coder", "seed_oss", "glm45", "minimax_m2"])
def test_a_schema_whose_properties_are_no_object_types_nothing(parser_name: str, properties: object) -> None:
    """A tool's ``parameters`` with ``properties`` that is no object (a client's mistake that only a constraint would
    refuse) names no parameter: every value is a string, where reading the tools raised (a 500 for ``"auto"``)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                            "properties": properties}}}]
    mode = tool_mode(tools, "auto", None, get_tool_parser(parser_name))
    reply = {"qwen3_coder": "<tool_call>\n<function=f>\n<parameter=city>\n1\n</parameter>\n</function>\n</tool_call>",
             "seed_oss": "<seed:tool_call>\n<function=f>\n<parameter=city>\n1\n</parameter>\n</function>\n"
                         "</seed:tool_call>",
             "glm45": "<tool_call>f\n<arg_key>city</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
             "minimax_m2": '<minimax:tool_call>\n<invoke name="f">\n<parameter name="city">1</parameter>\n</invoke>\n'
                           "</minimax:tool_call>"}[parser_name]
    chat = ChatReply(mode, stream_arguments=False)
    message = merge_deltas(chat.feed(reply) + chat.finish("stop")[0], tools=True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("f", '{"city": "1"}')]
