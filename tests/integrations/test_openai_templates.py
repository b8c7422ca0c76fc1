"""Chat templates through the server: continue_final_message, --chat-template, a request's own chat_template."""

from __future__ import annotations

import pytest
from asgi_helpers import asgi_client as _client
from test_openai_asgi import GREEDY

pytestmark = pytest.mark.asyncio(loop_scope="session")

PLAIN = "{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + '\\n' }}{% endfor %}"
"""A template that writes no special tokens, so its tokens are the tokenizer's on the same text."""
MESSAGES = [{"role": "user", "content": "Write a function"}, {"role": "assistant", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def template_app(bundled_engine, tmp_path_factory):
    from asyncllm.integrations.openai_server import create_app

    path = tmp_path_factory.mktemp("template") / "plain.jinja"
    path.write_text(PLAIN, encoding="utf-8")
    return create_app(bundled_engine, manage_engine=False, chat_template=str(path), trust_request_chat_template=True)


async def test_continue_final_message(app, bundled_tokenizer) -> None:
    body = {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True}
    expected = bundled_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, continue_final_message=True,
                                                     return_dict=False)
    async with _client(app) as client:
        tokenized = await client.post("/tokenize", json=body)
        chat = await client.post("/v1/chat/completions", json={**GREEDY, **body})
        both = await client.post("/v1/chat/completions", json={**GREEDY, **body, "add_generation_prompt": True})
    assert tokenized.json()["tokens"] == expected
    assert bundled_tokenizer.decode(expected).endswith("def add(a, b):")  # left open: no end of turn after it
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)
    assert (both.status_code, both.json()["error"]["param"]) == (400, "continue_final_message")


async def test_server_and_request_chat_templates(app, template_app, bundled_tokenizer) -> None:
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    async with _client(template_app) as client:
        served = (await client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})).json()
        chat = await client.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES})
        requested = (await client.post("/tokenize", json={"messages": MESSAGES, "chat_template": own})).json()
    async with _client(app) as client:
        refused = await client.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES, "chat_template": own})
    text = "[user] Write a function\n[assistant] def add(a, b):\n"
    assert served["tokens"] == bundled_tokenizer(text, add_special_tokens=False).input_ids
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == served["count"]
    assert requested["tokens"] == bundled_tokenizer("Write a functiondef add(a, b):", add_special_tokens=False).input_ids
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "chat_template")



PARTS_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}{% else %}"
                  "L:{{ m['content'] | map(attribute='text') | join('; and then, after that: ') }}{% endif %}"
                  "{% endfor %}")
"""Reads a list of parts without looping over it, so "auto" detects "string" (as vLLM); the "openai" rendering has
more tokens, so a chat rendered in the wrong format shows in its usage."""


async def test_chat_template_content_format_flag_reaches_rendering(bundled_engine, bundled_tokenizer) -> None:
    """--chat-template-content-format: text parts joined with "\\n" ("auto" here, as vLLM) or kept as parts."""
    from asyncllm.integrations.openai_server import create_app

    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    body = {"messages": [{"role": "user", "content": parts}], "add_generation_prompt": False}
    rendered = {}
    for content_format in ("auto", "openai"):
        app = create_app(bundled_engine, manage_engine=False, chat_template=PARTS_TEMPLATE,
                         chat_template_content_format=content_format)
        async with _client(app) as client:
            tokens = (await client.post("/tokenize", json=body)).json()["tokens"]
            chat = await client.post("/v1/chat/completions", json={**GREEDY, **body})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(tokens)
        rendered[content_format] = bundled_tokenizer.decode(tokens)
    assert rendered == {"auto": "S:first\nsecond", "openai": "L:first; and then, after that: second"}


async def test_text_like_parts_and_array_arguments_as_vllm_reads_them(app, bundled_tokenizer) -> None:
    """vLLM's text parts: bare strings, input_text, output_text, refusal, thinking; a text or refusal whose text is
    null dropped; a tool call's arguments a JSON array. Compared with vLLM's conversation, rendered and tokenized."""
    call = {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": "[1, 2]"}}
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}, "there",
                                             {"type": "text", "text": None}, {"type": "thinking", "thinking": "hmm"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "No."},
                                                  {"type": "refusal", "refusal": "I can't"},
                                                  {"type": "refusal", "refusal": None}]},
                {"role": "assistant", "content": None, "tool_calls": [call]}]
    vllm = [{"role": "user", "content": "Hi\nthere\nhmm"}, {"role": "assistant", "content": "No.\nI can't"},
            {"role": "assistant", "content": "",
             "tool_calls": [{**call, "function": {"name": "pick", "arguments": [1, 2]}}]}]
    text = bundled_tokenizer.apply_chat_template(vllm, add_generation_prompt=True, tokenize=False)
    async with _client(app) as client:
        tokenized = await client.post("/tokenize", json={"messages": messages})
        bad = await client.post("/tokenize", json={"messages": [{"role": "user", "content": [{"type": "refusal"}, 5]}]})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == bundled_tokenizer(text, add_special_tokens=False).input_ids
    assert bad.status_code == 400 and "got 'int'" in bad.json()["error"]["message"]


async def test_a_template_that_raises_is_a_400_everywhere(template_app) -> None:
    """Any exception a template raises (here ZeroDivisionError) is a 400 on messages, as vLLM's."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 / 0 }}"}
    async with _client(template_app) as client:
        responses = [await client.post("/tokenize", json=body),
                     await client.post("/v1/embeddings", json=body),
                     await client.post("/v1/chat/completions", json={**GREEDY, **body}),
                     await client.post("/v1/chat/completions",
                                       json={**GREEDY, **body, "use_beam_search": True, "n": 2})]
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and "ZeroDivisionError" in error["message"], error
