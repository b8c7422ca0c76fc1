"""The Responses API's input items as chat messages (integrations/responses_input.py), merged into assistant turns as
vLLM's ``_construct_message_from_response_item`` merges them."""

from __future__ import annotations

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.integrations.responses_input import input_messages
from asyncllm.tokenizer import apply_chat_template

USER = {"type": "message", "role": "user", "content": "weather in Paris?"}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "P"}'}
CHAT_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}


def _reasoning(text: str, key: str = "content") -> dict:
    return {"type": "reasoning", "id": "rs_1", "summary": [], key: [{"type": "reasoning_text", "text": text}]}


def _reply(text: str) -> dict:
    return {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def test_an_agent_loops_reply_is_one_assistant_turn() -> None:
    """Reasoning, the reply's text and its call (sent back in that order) fill one assistant message, as vLLM."""
    assert input_messages([USER, _reasoning("I need the tool."), _reply("Let me check."), CALL, OUTPUT], None) == [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "reasoning": "I need the tool.", "content": [{"type": "text", "text": "Let me check."}],
         "tool_calls": [CHAT_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    second = {**CALL, "call_id": "call_2"}
    assert input_messages([USER, CALL, second], "Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "tool_calls": [CHAT_CALL, {**CHAT_CALL, "id": "call_2"}]}]


def test_the_merged_turn_renders_as_vllms_conversation() -> None:
    """Through the chat path (chat_messages, the engine's rendering): the ids of vLLM's conversation for the items."""
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    template = ("{% for m in messages %}{{ m.role }}|{{ m.reasoning_content }}|{{ m.content }}|"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %};{% endfor %}")
    vllm = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "reasoning": "think", "reasoning_content": "think",
             "tool_calls": [{**CHAT_CALL, "function": {"name": "get_weather", "arguments": {"city": "P"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    messages = chat_messages(input_messages([USER, _reasoning("think"), _reply("Let me check."), CALL, OUTPUT], None))
    assert apply_chat_template(tokenizer, messages, chat_template=template) == tokenizer.apply_chat_template(
        vllm, chat_template=template, add_generation_prompt=True, return_dict=False)


def test_an_assistant_field_already_set_starts_a_new_turn() -> None:
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "from the summary"}]}
    assert input_messages([_reasoning("a"), summary, {"type": "reasoning", "summary": []}, _reply("x"), _reply("y")],
                          None) == [
        {"role": "assistant", "reasoning": "a"}, {"role": "assistant", "reasoning": "from the summary"},
        {"role": "assistant", "reasoning": "", "content": [{"type": "text", "text": "x"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "y"}]}]
    with pytest.raises(InvalidRequestError, match="encrypted_content is not built"):
        input_messages([{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}], None)


def test_developer_kept_and_tool_output_parts_joined_with_newlines() -> None:
    """``developer`` reaches the template (as vLLM and chat completions); a list output's texts are joined with
    "\\n", as vLLM's chat parsing joins a tool message's parts."""
    parts = [{"type": "input_text", "text": "line one"}, {"type": "input_text", "text": "line two"}]
    messages = input_messages([{"type": "message", "role": "developer", "content": "in French"}, CALL,
                               {**OUTPUT, "output": parts}], None)
    assert messages[0] == {"role": "developer", "content": "in French"}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "line one\nline two"}
