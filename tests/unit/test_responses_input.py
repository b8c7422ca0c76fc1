"""The Responses API's input items as chat messages (integrations/responses_input.py), merged into assistant turns as
vLLM's ``_construct_message_from_response_item`` merges them; its ``text.format`` as chat's ``response_format``."""

from __future__ import annotations

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.integrations.responses_api import ResponsesRequest, chat_request
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
        {"role": "assistant", "reasoning": "I need the tool.", "content": _reply("Let me check.")["content"],
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
        {"role": "assistant", "reasoning": "", "content": _reply("x")["content"]},
        {"role": "assistant", "content": _reply("y")["content"]}]
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


def test_text_parts_read_as_the_chat_path_reads_them() -> None:
    """A message's text parts pass through as they are (chat_messages reads them); an output's texts are
    `text_part_text`'s, joined with "\\n": a refusal's too, a text part of text None skipped, one without text
    refused; a part neither text nor input_image is refused."""
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}
    parts = ["bare", {"type": "input_text", "text": "hi"}, image]
    assert input_messages([{"type": "message", "role": "user", "content": parts}], None) == [
        {"role": "user", "content": [*parts[:2], {"type": "image_url", "image_url": {"url": image["image_url"]}}]}]
    output = [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": None}, "bare"]
    assert input_messages([{**OUTPUT, "output": output}], None)[0]["content"] == "no\nbare"
    with pytest.raises(InvalidRequestError, match="input_text part needs a str 'text'"):
        input_messages([{**OUTPUT, "output": [{"type": "input_text"}]}], None)
    with pytest.raises(InvalidRequestError, match="only text content parts"):
        input_messages([{"type": "message", "role": "user", "content": [{"type": "input_file"}]}], None)


def test_text_format_forwards_openais_keys_and_refuses_others_by_name() -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True, "description": "A city"}
    request = chat_request(ResponsesRequest(input="x", text={"format": fmt}))
    assert request.response_format == {"type": "json_schema", "json_schema": {k: fmt[k] for k in list(fmt)[1:]}}
    for bad, key in [({**fmt, "strict_mode": True}, "strict_mode"), ({"type": "json_object", "schema": {}}, "schema"),
                     ({"type": "text", "name": "x"}, "name")]:
        with pytest.raises(InvalidRequestError) as info:
            chat_request(ResponsesRequest(input="x", text={"format": bad}))
        assert info.value.field == f"text.format.{key}"
