"""Structured output through the OpenAI server: `response_format` (OpenAI's) and `structured_outputs` (vLLM's)."""

from __future__ import annotations

import json
import re

import pytest
from asgi_helpers import asgi_client as _client

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.asyncio(loop_scope="session")

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a", "b"],
}
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 100}
CHAT = {"messages": [{"role": "user", "content": "Answer in JSON"}]}


def _json(text: str) -> object:
    # strict=False: xgrammar's maxLength string rule admits U+0000-U+001F, which strict JSON refuses
    return json.loads(text, strict=False)


async def test_response_format_json_schema_and_json_object(app) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}
    async with _client(app) as client:
        chat = await client.post("/v1/chat/completions",
                                 json={**CHAT, **SAMPLED, "n": 4, "response_format": schema_format})
        completion = await client.post("/v1/completions", json={"prompt": "{", **SAMPLED, "n": 2,
                                                                "response_format": {"type": "json_object"}})
    assert chat.status_code == 200 and completion.status_code == 200, (chat.text, completion.text)
    contents = [choice["message"]["content"] for choice in chat.json()["choices"]]
    assert len(contents) == 4 and len(set(contents)) > 1  # really sampled
    for choice, content in zip(chat.json()["choices"], contents):
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(_json(content), SCHEMA)
    assert all(isinstance(_json(choice["text"]), dict) for choice in completion.json()["choices"])


async def test_structured_outputs_regex_choice_grammar_and_json_object(app) -> None:
    cases = [({"regex": r"[a-z]{3}-\d{2}"}, r"[a-z]{3}-\d{2}"), ({"choice": ["yes", "no"]}, r"yes|no"),
             ({"grammar": 'root ::= "x" [0-9] "y"'}, r"x[0-9]y"), ({"grammar": 'start: "x" /[0-9]/ "y"'}, r"x[0-9]y")]
    async with _client(app) as client:
        for structured, pattern in cases:
            response = await client.post("/v1/completions", json={"prompt": "id:", **SAMPLED, "n": 3,
                                                                  "structured_outputs": structured})
            assert response.status_code == 200, response.text
            assert all(re.fullmatch(pattern, c["text"]) for c in response.json()["choices"]), response.text
        chat = await client.post("/v1/chat/completions",
                                 json={**CHAT, **SAMPLED, "structured_outputs": {"json_object": True}})
    assert isinstance(_json(chat.json()["choices"][0]["message"]["content"]), dict)


async def test_streamed_json_schema_output_parses(app) -> None:
    body = {**CHAT, **SAMPLED, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}}
    async with _client(app) as client:
        response = await client.post("/v1/chat/completions", json=body)
    events = [json.loads(line[len("data: "):]) for line in response.text.split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    jsonschema.validate(_json(text), SCHEMA)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    # keys OpenAI does not define are refused as unknown fields (vLLM ignores them: no schema would apply)
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema"),
    ({"response_format": {"type": "text", "strict": True}}, "response_format.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "json_object": True}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "structured_outputs"),
    ({"structured_outputs": {"json": True}}, "structured_outputs"),  # vLLM's 400 too (it hung the request)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}}, "response_format"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs"),  # unenforced
    # the core's compile errors name the field too (not "structured")
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start: ("x" '}}, "structured_outputs"),  # Lark
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"structured_outputs": {"json": {"type": "integer", "maximum": 10**30}}}, "structured_outputs"),  # xgrammar's
])
async def test_bad_constraints_are_400_naming_the_field(app, extra, param) -> None:
    async with _client(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
        after = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+|Check failed", response.json()["error"]["message"])  # xgrammar's
    assert after.status_code == 200  # the engine keeps serving


async def test_json_keys_come_in_the_schemas_order(app) -> None:
    """As xgrammar in vLLM and OpenAI: properties in the schema's order ("reasoning" before "answer"), not sorted."""
    schema = {"type": "object", "properties": {"z": {"type": "boolean"}, "a": {"type": "boolean"}},
              "required": ["z", "a"], "additionalProperties": False}
    async with _client(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "temperature": 0,
                                                              "structured_outputs": {"json": schema}})
    assert response.status_code == 200, response.text
    assert list(_json(response.json()["choices"][0]["text"])) == ["z", "a"]


@pytest.mark.parametrize("extra, param", [
    ({"bad_words": list("0123456789")}, "bad_words"),
    ({"allowed_token_ids": [0, 1]}, "allowed_token_ids"),
])
async def test_vocabulary_limits_that_leave_the_grammar_no_token_are_named(app, extra, param) -> None:
    """A grammar whose every next token bad_words or allowed_token_ids forbid fails at that step with a 400 naming
    the field and the grammar (not "structured": the grammar alone is fine); the engine keeps serving."""
    body = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[0-9]"}, **extra}
    async with _client(app) as client:
        response = await client.post("/v1/completions", json=body)
        after = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, param), response.text
    assert error["message"].startswith(f"{param}: forbids every token the grammar (structured output) allows next")
    assert after.status_code == 200
