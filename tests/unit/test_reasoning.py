"""Reasoning parsers without a model: whole replies, replies streamed in any pieces, and with tool calls."""

from __future__ import annotations

import random

import pytest

from asyncllm.errors import ConfigError
from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.reasoning import get_reasoning_parser
from asyncllm.tool_calls import get_tool_parser

CASES = {  # reply: (deepseek_r1's split, qwen3's split)
    "<think>\nLet me see.\n</think>\n\nIt is 4.": (("\nLet me see.\n", "It is 4."), ("\nLet me see.\n", "It is 4.")),
    "Opened by the prompt.</think>\n\nFour.": (("Opened by the prompt.", "Four."),
                                               (None, "Opened by the prompt.</think>\n\nFour.")),
    "<think>cut short while thinking": (("cut short while thinking", None), ("cut short while thinking", None)),
    "No thinking at all": (("No thinking at all", None), (None, "No thinking at all")),
    "": ((None, None), (None, None)),
}


def _streamed(name: str, text: str, seed: int) -> tuple[str | None, str | None]:
    rng, stream, reasoning, content, pos = random.Random(seed), get_reasoning_parser(name).stream(), "", "", 0
    while pos < len(text):
        size = rng.randint(1, 6)
        r, c = stream.feed(text[pos:pos + size])
        reasoning, content, pos = reasoning + r, content + c, pos + size
    r, c = stream.finish()
    return reasoning + r or None, content + c or None


@pytest.mark.parametrize("reply", list(CASES))
def test_whole_and_streamed_splits(reply: str) -> None:
    for name, expected in zip(("deepseek_r1", "qwen3"), CASES[reply]):
        assert get_reasoning_parser(name).parse(reply) == expected, name
        assert all(_streamed(name, reply, seed) == expected for seed in range(8)), name


@pytest.mark.parametrize("reply", list(CASES))
def test_mistral_splits_as_qwen3_with_its_think_tokens(reply: str) -> None:
    """Magistral's ``[THINK]`` / ``[/THINK]`` read as qwen3 reads ``<think>`` / ``</think>``."""
    magistral = reply.replace("</think>", "[/THINK]").replace("<think>", "[THINK]")
    expected = tuple(None if part is None else part.replace("</think>", "[/THINK]") for part in CASES[reply][1])
    assert get_reasoning_parser("mistral").parse(magistral) == expected
    assert all(_streamed("mistral", magistral, seed) == expected for seed in range(8))
    assert get_reasoning_parser("mistral").needs_special_tokens


@pytest.mark.parametrize("reply", list(CASES))
def test_glm45_minimax_m2_and_seed_oss_split_as_their_models_write(reply: str) -> None:
    """GLM-4.5 as qwen3, MiniMax-M2 as deepseek_r1, Seed-OSS as qwen3 with ``<seed:think>`` / ``</seed:think>``."""
    for name, expected in (("glm45", CASES[reply][1]), ("minimax_m2", CASES[reply][0])):
        assert get_reasoning_parser(name).parse(reply) == expected, name
        assert all(_streamed(name, reply, seed) == expected for seed in range(4)), name
    seed = reply.replace("</think>", "</seed:think>").replace("<think>", "<seed:think>")
    expected = tuple(None if part is None else part.replace("</think>", "</seed:think>") for part in CASES[reply][1])
    assert get_reasoning_parser("seed_oss").parse(seed) == expected
    assert all(_streamed("seed_oss", seed, s) == expected for s in range(4))


def test_qwen3_answer_streams_at_once() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("Hello") == ("", "Hello") and stream.feed(" there") == ("", " there")


def test_reasoning_then_a_tool_call() -> None:
    reply = ChatReply(tool_mode([{"type": "function", "function": {"name": "f"}}], "auto", None,
                                get_tool_parser("hermes")), get_reasoning_parser("deepseek_r1"))
    text = 'I should call f.</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    deltas = [d for i in range(0, len(text), 5) for d in reply.feed(text[i:i + 5])]
    more, finish = reply.finish("stop")
    message = merge_deltas(deltas + more, tools=True)
    assert message["reasoning"] == "I should call f." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'} and finish == "tool_calls"


def test_unknown_reasoning_parser() -> None:
    with pytest.raises(ConfigError, match="reasoning_parser.*qwen3"):
        get_reasoning_parser("o1")


def test_a_named_call_after_thoughts() -> None:
    """With a reasoning parser the server lets a tool choice's grammar start after </think>: thoughts, then the call."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    reply = ChatReply(tool_mode(tools, {"type": "function", "function": {"name": "f"}}, None, None),
                      get_reasoning_parser("deepseek_r1"))
    deltas = reply.feed("Use f.</think>\n\n") + reply.feed('{"x": 1}')
    more, finish = reply.finish("stop")
    message = merge_deltas(deltas + more, tools=True)
    assert message["reasoning"] == "Use f." and message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


def test_hunyuan_a13b_answer_tags_are_not_content() -> None:
    reply = "<think>\nsum it\n</think>\n<answer>\nIt is 4.\n</answer>"
    assert get_reasoning_parser("hunyuan_a13b").parse(reply) == ("\nsum it\n", "It is 4.")
    assert all(_streamed("hunyuan_a13b", reply, seed) == ("\nsum it\n", "It is 4.") for seed in range(8))
    assert get_reasoning_parser("hunyuan_a13b").parse("plain answer") == (None, "plain answer")
    cut = "<think>x</think><answer>half </ans"  # cut short: the held-back characters are content
    assert get_reasoning_parser("hunyuan_a13b").parse(cut) == ("x", "half </ans")
