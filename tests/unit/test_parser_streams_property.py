"""Property: a tool-call or reasoning parser fed a reply in any pieces reads it as it reads the whole reply."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncllm.reasoning import REASONING_PARSERS, get_reasoning_parser
from asyncllm.tool_calls import TOOL_PARSERS, get_tool_parser

FRAGMENTS = ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"x": 1}}', '{"name": "g", "parameters": {}}',
             "<think>", "</think>", "<|python_tag|>", "[f(a=1)]", "; ", "\n", " ", "text", "<", "</", "{", "[", "Ω",
             "[TOOL_CALLS]", "f[ARGS]", '{"x": 1}', '[{"name": "f", "arguments": {}}]', "<function=f>", "<parameter=x>",
             "</parameter>", "</function>"]
replies = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)
cuts = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=40)


def _pieces(text: str, sizes: list[int]) -> list[str]:
    out, pos, k = [], 0, 0
    while pos < len(text):
        size = sizes[k % len(sizes)]
        out.append(text[pos:pos + size])
        pos, k = pos + size, k + 1
    return out


@settings(max_examples=150, deadline=None)
@given(reply=replies, sizes=cuts, name=st.sampled_from(sorted(TOOL_PARSERS)))
@example(reply='<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>{"name": "f", "arguments": {"x": 1}}',
         sizes=[1], name="glm45")  # the spaces of content after a call, each its own piece, are content
def test_tool_parsers_stream_like_whole(reply: str, sizes: list[int], name: str) -> None:
    stream, content, calls = get_tool_parser(name).stream(), "", []
    for piece in _pieces(reply, sizes):
        text, new = stream.feed(piece)
        content, calls = content + text, calls + new
    text, new = stream.finish()
    content, calls = content + text, calls + new
    whole = get_tool_parser(name).parse(reply)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (content.strip() if calls else content) == (whole.content or "")
    if not calls:
        assert content == reply  # no call: nothing the model wrote is lost


@settings(max_examples=150, deadline=None)
@given(reply=replies, sizes=cuts, name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_reasoning_parsers_stream_like_whole(reply: str, sizes: list[int], name: str) -> None:
    whole_stream = get_reasoning_parser(name).stream()
    whole = tuple(a + b for a, b in zip(whole_stream.feed(reply), whole_stream.finish()))
    stream, reasoning, content = get_reasoning_parser(name).stream(), "", ""
    for piece in _pieces(reply, sizes):
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    assert (reasoning + r, content + c) == whole


@settings(max_examples=150, deadline=None)
@given(reply=replies, sizes=cuts, reasoning=st.sampled_from([None, *sorted(REASONING_PARSERS)]),
       kind=st.sampled_from(["none", "auto", "named"]))
def test_chat_reply_streamed_merges_to_the_whole_message(reply: str, sizes: list[int], reasoning: str | None,
                                                         kind: str) -> None:
    from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
    from asyncllm.integrations.openai_tools import tool_mode

    tools = [{"type": "function", "function": {"name": "f"}}]
    choice = {"none": "none", "auto": "auto", "named": {"type": "function", "function": {"name": "f"}}}[kind]
    mode = tool_mode(tools, choice, None, get_tool_parser("hermes"))
    parser = get_reasoning_parser(reasoning) if reasoning else None

    def message(pieces: list[str]) -> tuple[dict, str | None]:
        reply_ = ChatReply(mode, parser)
        deltas = [d for piece in pieces for d in reply_.feed(piece)]
        more, finish = reply_.finish("stop")
        merged = merge_deltas(deltas + more, tools=kind != "none")
        for call in merged.get("tool_calls", ()):
            call.pop("id")  # fresh per reply
        return merged, finish

    assert message(_pieces(reply, sizes)) == message([reply])
