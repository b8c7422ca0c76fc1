"""What Responses-API clients built against OpenAI and vLLM (Codex-like agents) send: accepted as vLLM accepts it.

Codex sends ``include: ["reasoning.encrypted_content"]`` with ``store: false``, ``reasoning: {"effort", "summary"}``,
``client_metadata``, function tools beside hosted and client-side ones (``web_search``, ``local_shell``, ``custom``)
and ``tool_choice: "auto"`` whether or not the server reads calls; until 2026-12-08 each of these was a 400.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from asgi_helpers import asgi_client
from openai.types.responses import Response

from asyncllm.integrations.responses_api import ResponsesRequest, chat_request, check_request, response_body



MODEL = "asyncllm-tiny"
SHELL = {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "string", "enum": ["ls", "pwd"]}},
                        "required": ["command"], "additionalProperties": False}}
HOSTED = [{"type": "web_search"}, {"type": "local_shell"},
          {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "s"}}]
CODEX = {"include": ["reasoning.encrypted_content"], "store": False, "prompt_cache_key": "thread-1",
         "reasoning": {"effort": "medium", "summary": "auto"}, "client_metadata": {"installation": "x"},
         "parallel_tool_calls": False, "tool_choice": "auto", "text": {"verbosity": "low"}}
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def test_codex_fields_are_accepted_and_effort_reaches_the_template() -> None:
    """vLLM's include values and OpenAI's reasoning settings are accepted (vLLM's ``ResponsesRequest`` takes them);
    ``reasoning.effort`` is the chat template's ``reasoning_effort``, as vLLM's ``build_chat_params`` passes it."""
    req = ResponsesRequest(input="hi", **CODEX)
    check_request(req)
    check_request(ResponsesRequest(input="hi", reasoning={"effort": "high", "generate_summary": "concise"},
                                   include=["file_search_call.results", "message.input_image.image_url"]))
    assert chat_request(req).reasoning_effort == "medium"
    assert chat_request(ResponsesRequest(input="hi")).reasoning_effort is None


def test_service_tier_and_reasoning_are_echoed() -> None:
    """The response carries the request's ``service_tier`` (default ``auto``) and ``reasoning``, as vLLM's
    ``ResponsesResponse.from_request``; they were left out."""
    body = response_body(ResponsesRequest(input="hi", service_tier="default", **CODEX), MODEL, [], "stop", USAGE)
    assert (body["service_tier"], body["reasoning"]) == ("default", CODEX["reasoning"])
    plain = Response.model_validate(response_body(ResponsesRequest(input="hi"), MODEL, [], "stop", USAGE))
    assert (plain.service_tier, plain.reasoning) == ("auto", None)


def test_tools_of_other_types_are_left_out_of_the_chat() -> None:
    """Hosted and client-side tools are accepted and left out of the template, as vLLM leaves them out
    (``iter_response_function_tool_dicts``); they were a 400 naming ``tools``."""
    chat = chat_request(ResponsesRequest(input="hi", tools=[*HOSTED, SHELL]))
    assert [tool["function"]["name"] for tool in chat.tools] == ["shell"] and chat.tool_choice is None
    alone = chat_request(ResponsesRequest(input="hi", tools=HOSTED, tool_choice="auto"))
    assert (alone.tools, alone.tool_choice) == (None, None)


def test_namespace_tools_are_flattened_and_their_calls_named_back() -> None:
    """Codex sends its MCP tools as ``namespace`` tools: as vLLM, each function reaches the template as
    ``<namespace>__<name>``, a call of it comes back as ``{"namespace", "name"}``, and such a call sent back is the
    flat name again (they were a 400, and would have been left out)."""
    files = {"type": "namespace", "name": "mcp__files", "description": "Files", "tools": [
        {"type": "function", "name": "read", "description": "Read", "parameters": {"type": "object"}},
        {"type": "custom", "name": "raw"}]}
    req = ResponsesRequest(input="hi", tools=[SHELL, files])
    assert [tool["function"]["name"] for tool in chat_request(req).tools] == ["shell", "mcp__files__read"]
    deltas = [{"tool_calls": [{"id": "call_1", "function": {"name": "mcp__files__read", "arguments": "{}"}}]},
              {"tool_calls": [{"id": "call_2", "function": {"name": "shell", "arguments": "{}"}}]}]
    body = response_body(req, MODEL, deltas, "tool_calls", USAGE)
    calls = Response.model_validate(body).output
    assert [(call.namespace, call.name) for call in calls] == [("mcp__files", "read"), (None, "shell")]
    sent_back = chat_request(ResponsesRequest(input=[body["output"][0]], tools=[files])).messages
    assert sent_back[0]["tool_calls"][0]["function"]["name"] == "mcp__files__read"


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_on_a_server_without_a_tool_parser_calls_none(choice) -> None:
    """vLLM's Responses API serves ``tool_choice: "auto"`` (the default) without ``--tool-call-parser``: the tools
    reach the template and the reply is text; here it was a 400 naming ``tool_choice``, which the client never
    sent. A forced call needs no parser (a grammar), so it stays."""
    chat = chat_request(ResponsesRequest(input="hi", tools=[SHELL], tool_choice=choice), auto_tools=False)
    assert (chat.tool_choice, len(chat.tools)) == ("none", 1)
    assert chat_request(ResponsesRequest(input="hi", tools=[SHELL], tool_choice=choice)).tool_choice in (None, "auto")
    assert chat_request(ResponsesRequest(input="hi", tools=[SHELL], tool_choice="required"),
                        auto_tools=False).tool_choice == "required"


@pytest.mark.parametrize("choice", [
    {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "shell"}]},
    {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]},
    {"type": "web_search_preview"}, {"type": "file_search"}, {"type": "code_interpreter"},
    {"type": "image_generation"}, {"type": "custom", "name": "apply_patch"}, {"type": "mcp", "server_label": "x"},
    {"type": "shell"}, {"type": "apply_patch"}])
def test_tool_choices_of_other_types_call_none(choice) -> None:
    """OpenAI's other ``tool_choice`` objects (vLLM's ``ResponsesRequest`` takes openai's ``ToolChoice``) are accepted:
    as vLLM's ``_parse_tool_calls``, which parses calls only for ``auto``, ``required`` and a function, the tools
    reach the template and the reply is text; the response echoes the choice. They were a 400 naming
    ``tool_choice``."""
    req = ResponsesRequest(input="hi", tools=[*HOSTED, SHELL], tool_choice=choice)
    chat = chat_request(req)
    assert (chat.tool_choice, [tool["function"]["name"] for tool in chat.tools]) == ("none", ["shell"])
    assert chat_request(ResponsesRequest(input="hi", tools=HOSTED, tool_choice=choice)).tool_choice is None
    assert response_body(req, MODEL, [], "stop", USAGE)["tool_choice"] == choice


def test_a_forced_namespaced_function_by_its_own_name() -> None:
    """A forced ``{"type": "function", "name": "read"}`` names a ``namespace`` tool's function as the client knows
    it (vLLM accepts it and names the call ``read``); here the call is forced on the template's ``mcp__files__read``
    and written back with its namespace. It was a 400: "names 'read', which is not among the tools"."""
    files = {"type": "namespace", "name": "mcp__files", "tools": [
        {"type": "function", "name": "read", "parameters": {"type": "object"}}]}
    for choice in ({"type": "function", "name": "read"},
                   {"type": "function", "name": "read", "namespace": "mcp__files"}):
        chat = chat_request(ResponsesRequest(input="hi", tools=[SHELL, files], tool_choice=choice))
        assert chat.tool_choice == {"type": "function", "function": {"name": "mcp__files__read"}}
    flat = chat_request(ResponsesRequest(input="hi", tools=[SHELL, files], tool_choice={"type": "function",
                                                                                        "name": "shell"}))
    assert flat.tool_choice == {"type": "function", "function": {"name": "shell"}}


@pytest.mark.asyncio(loop_scope="session")
async def test_codex_like_turns_through_the_official_client(app) -> None:
    """Two streamed turns as Codex sends them, on a server without a tool-call parser: the first with the reply's
    tools in its prompt, the second sending back a reasoning item (null content and encrypted_content), a call and
    its output as text parts; every event parses with the official client."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
    client = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http)
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]}
    turn = {"model": MODEL, "instructions": "You code.", "tools": [SHELL, *HOSTED], "max_output_tokens": 4,
            "temperature": 0, "stream": True, **{k: v for k, v in CODEX.items() if k != "client_metadata"},
            "extra_body": {"client_metadata": CODEX["client_metadata"]}}
    first = [event async for event in await client.responses.create(input=[user], **turn)]
    done = first[-1].response
    assert done.service_tier == "auto" and done.reasoning.effort == "medium" and done.output[0].type == "message"
    async with asgi_client(app) as raw:  # the function tool reached the template: the chat's prompt with it
        chat_tools = [{"type": "function", "function": {k: SHELL[k] for k in ("name", "description", "parameters")}}]
        messages = [{"role": "system", "content": "You code."}, {"role": "user", "content": "list files"}]
        rendered = (await raw.post("/tokenize", json={"messages": messages, "tools": chat_tools})).json()
    assert done.usage.input_tokens == rendered["count"]
    history = [user, {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look"}],
                      "content": None, "encrypted_content": None},
               {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
                "arguments": '{"command": "ls"}', "status": "completed"},
               {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "a"}]},
               *[item.model_dump() for item in done.output]]
    second = [event async for event in await client.responses.create(input=history, **turn)]
    assert second[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in second] == list(range(len(second)))
