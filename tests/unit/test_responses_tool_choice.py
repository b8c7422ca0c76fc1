"""The Responses API's ``tool_choice`` as chat completions read it (integrations/responses_api.py `chat_request`)."""

from __future__ import annotations

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.integrations.responses_api import ResponsesRequest, chat_request
from asyncllm.tool_calls import get_tool_parser


@pytest.mark.parametrize("tools", [None, []])
def test_auto_without_tools_is_no_tool_calling(tools) -> None:
    """``"auto"`` is the Responses API's default choice (the echoed response says so) and ``tools`` defaults to none,
    so a request that sends ``tool_choice: "auto"`` without tools (a client resending the echoed settings) is served
    without tool calling, as OpenAI's and vLLM's Responses API serve it; it was a 400 ("'auto' needs tools")."""
    chat = chat_request(ResponsesRequest(input="hi", tools=tools, tool_choice="auto"))
    assert tool_mode(chat.tools, chat.tool_choice, chat.parallel_tool_calls, get_tool_parser("hermes")).kind == "none"
    with pytest.raises(InvalidRequestError, match="'required' needs function tools"):  # a call that cannot be made:
        chat_request(ResponsesRequest(input="hi", tools=tools, tool_choice="required"))  # still refused
