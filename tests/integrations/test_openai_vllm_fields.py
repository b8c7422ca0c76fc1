"""vLLM's request-field semantics the official client meets: ``stream_options`` defaults, explicit nulls of the
fields vLLM declares nullable, ``/tokenize``'s ``return_token_strs``, and the served name labelling the metrics."""

from __future__ import annotations

import msgspec
import prometheus_client
import pytest

from asyncllm.cli import _parser
from asyncllm.cli_commands import _serve_engine
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, StreamOptions, TokenizeRequest, decode_request,
)
from asgi_helpers import asgi_client, sse_events

session_loop = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "hi"}]


@session_loop
async def test_stream_options_include_usage_defaults_to_true(app) -> None:
    """As vLLM's ``StreamOptions.include_usage: bool | None = True``: ``{}`` ends with the usage chunk,
    ``continuous_usage_stats`` alone gives every chunk usage, null reads as false; without ``stream`` only an
    empty (or null) ``stream_options`` passes (vLLM's ``validate_stream_options`` tests the dict's truth)."""
    async with asgi_client(app) as client:
        async def events(options, path="/v1/completions", body=None):
            body = body or {"prompt": "x"}
            response = await client.post(path, json={**GREEDY, **body, "stream": True, "stream_options": options})
            return sse_events(response.text)

        empty = await events({})
        chat = await events({}, "/v1/chat/completions", {"messages": MESSAGES})
        continuous = await events({"continuous_usage_stats": True})
        null = await events({"include_usage": None})
        unstreamed = [(await client.post("/v1/completions", json={**GREEDY, "prompt": "x", "stream_options": o}))
                      for o in ({}, None, {"include_usage": None}, {"continuous_usage_stats": False})]
    for stream in (empty, chat):
        assert stream[-1]["choices"] == [] and stream[-1]["usage"]["completion_tokens"] == 2, stream
        assert all(event["usage"] is None for event in stream[:-1])
    assert continuous[-1]["choices"] == [] and all(event["usage"] for event in continuous)
    assert all(event["choices"] and "usage" not in event for event in null)
    assert [r.status_code for r in unstreamed] == [200, 200, 400, 400]
    assert unstreamed[2].json()["error"]["param"] == "stream_options"
    assert StreamOptions().usage and not StreamOptions(include_usage=False, continuous_usage_stats=True).continuous


def test_nullable_fields_take_their_defaults() -> None:
    """Each field vLLM declares ``X | None = default`` takes JSON null as its default; the fields vLLM declares not
    nullable still refuse it, and a wrong type is still a 400 naming the field."""
    completion = decode_request(b'{"prompt": "x", "stream": null, "echo": null, "presence_penalty": null, '
                                b'"frequency_penalty": null, "return_token_ids": null, "max_tokens": null}',
                                CompletionRequest)
    assert (completion.stream, completion.echo, completion.presence_penalty, completion.frequency_penalty,
            completion.return_token_ids, completion.max_tokens) == (False, False, 0.0, 0.0, False, None)
    chat = decode_request(b'{"messages": [], "stream": null, "n": null, "logprobs": null, "presence_penalty": null, '
                          b'"frequency_penalty": null}', ChatCompletionRequest)
    assert (chat.stream, chat.n, chat.logprobs, chat.presence_penalty, chat.frequency_penalty) == (
        False, 1, False, 0.0, 0.0)
    assert decode_request(b'{"prompt": "x", "return_token_strs": null}', TokenizeRequest).return_token_strs is False
    lax = decode_request(b'{"messages": [], "n": "2", "max_tokens": 4.0, "seed": 1.0, "stream": "true"}',
                         ChatCompletionRequest)  # pydantic's lax reading, vLLM's: a whole float, a numeric string
    assert (lax.n, lax.max_tokens, lax.seed, lax.stream) == (2, 4, 1, True)
    assert decode_request(b'{"prompt": "x", "logprobs": "1"}', CompletionRequest).logprobs == 1
    for body, kind, field in ((b'{"prompt": "x", "n": null}', CompletionRequest, "n"),  # vLLM's n: int = 1
                              (b'{"prompt": "x", "ignore_eos": null}', CompletionRequest, "ignore_eos"),
                              (b'{"prompt": "x", "stream": "yes"}', CompletionRequest, "stream"),
                              (b'{"prompt": "x", "max_tokens": 4.5}', CompletionRequest, "max_tokens"),
                              (b'{"prompt": "x", "stop": 5}', CompletionRequest, "stop"),
                              (b'{"messages": [], "n": true}', ChatCompletionRequest, "n")):  # bools: counts only
        with pytest.raises(InvalidRequestError) as caught:
            decode_request(body, kind)
        assert caught.value.field == field, caught.value


@session_loop
async def test_nulls_through_the_server(app) -> None:
    nulls = {"stream": None, "presence_penalty": None, "frequency_penalty": None}
    async with asgi_client(app) as client:
        completion = await client.post("/v1/completions", json={**GREEDY, **nulls, "prompt": "x", "echo": None})
        chat = await client.post("/v1/chat/completions", json={**GREEDY, **nulls, "messages": MESSAGES, "n": None,
                                                               "logprobs": None})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2, completion.text
    [choice] = chat.json()["choices"]
    assert chat.status_code == 200 and choice["logprobs"] is None, chat.text


@session_loop
async def test_tokenize_returns_token_strs_when_asked(app, bundled_tokenizer) -> None:
    """vLLM's ``return_token_strs``: the tokenizer's ``convert_ids_to_tokens`` of the ids; null otherwise."""
    async with asgi_client(app) as client:
        prompt = [(await client.post("/tokenize", json={"prompt": "Hello world", **flag})).json()
                  for flag in ({}, {"return_token_strs": True})]
        chat = (await client.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True})).json()
    assert prompt[0]["token_strs"] is None and prompt[1]["tokens"] == prompt[0]["tokens"]
    for body in (prompt[1], chat):
        assert body["token_strs"] == bundled_tokenizer.convert_ids_to_tokens(body["tokens"]) and body["token_strs"]


def test_served_model_name_labels_the_metrics() -> None:
    """As vLLM's ``PrometheusStatLogger`` (``model_config.served_model_name``): ``serve --served-model-name foo bar``
    labels every series ``foo``, and an attached host learning its model keeps it; without one, the name the app
    serves (the bundled model's ``asyncllm-tiny``, not its folder)."""
    def labels(engine) -> set[str]:
        text = prometheus_client.generate_latest(engine.metrics_registry).decode()
        return {line.split('model_name="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("asyncllm:prompt_tokens_total{")}

    named, _ = _serve_engine(_parser().parse_args(["serve", "--served-model-name", "foo", "bar"]))
    named._replicas[0].observer.set_model_name("/models/from-the-core")  # what an attached host learns
    plain, _ = _serve_engine(_parser().parse_args(["serve"]))
    assert labels(named) == {"foo"}
    assert labels(plain) == {"asyncllm-tiny"}


def test_logprob_counts_take_bools_as_vllm() -> None:
    """vLLM's ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` are ``int | None`` in pydantic's lax mode: true
    is 1 and false 0 there (only there, and a string is still a 400: `test_nullable_fields_take_their_defaults`)."""
    completion = decode_request(b'{"prompt": "x", "logprobs": true, "prompt_logprobs": false}', CompletionRequest)
    assert (completion.logprobs, completion.prompt_logprobs) == (1, 0)
    assert type(completion.logprobs) is int and type(completion.prompt_logprobs) is int
    chat = decode_request(b'{"messages": [], "logprobs": true, "top_logprobs": true}', ChatCompletionRequest)
    assert (chat.logprobs, chat.top_logprobs) == (True, 1) and type(chat.top_logprobs) is int


@session_loop
async def test_logprobs_as_vllm_reads_them(app) -> None:
    """Completions' ``logprobs: true`` is ``logprobs: 1``; chat's ``top_logprobs`` null (or left out) with
    ``logprobs: true`` is 0, each token's own logprob and ``top_logprobs: []`` (vLLM's ``top_logprobs`` default);
    without ``logprobs`` a ``top_logprobs`` of 0 is accepted (no logprobs), above 0 is a 400; above the engine's
    ``max_logprobs`` (or -1 under it) the 400 names ``top_logprobs``, not the engine's ``logprobs``."""
    chat_body = {**GREEDY, "messages": MESSAGES}
    async with asgi_client(app) as client:
        completion = await client.post("/v1/completions", json={**GREEDY, "prompt": "x", "logprobs": True})
        null = await client.post("/v1/chat/completions", json={**chat_body, "logprobs": True, "top_logprobs": None})
        streamed = await client.post("/v1/chat/completions", json={**chat_body, "logprobs": True, "stream": True,
                                                                   "top_logprobs": None})
        zero = await client.post("/v1/chat/completions", json={**chat_body, "top_logprobs": 0})
        two = await client.post("/v1/chat/completions", json={**chat_body, "top_logprobs": 2})
        over = [await client.post("/v1/chat/completions", json={**chat_body, "logprobs": True, "top_logprobs": top})
                for top in (21, -1)]  # above the engine's max_logprobs (20): named as the client wrote it
    logprobs = completion.json()["choices"][0]["logprobs"]
    assert completion.status_code == 200 and len(logprobs["tokens"]) == 2, completion.text
    assert all(1 <= len(top) <= 2 and token in top for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]))
    content = null.json()["choices"][0]["logprobs"]["content"]
    content += [entry for event in sse_events(streamed.text) for choice in event["choices"]
                for entry in (choice.get("logprobs") or {}).get("content") or []]
    assert len(content) == 4 and all(entry["top_logprobs"] == [] for entry in content), content
    assert all(list(entry) == ["token", "logprob", "bytes", "top_logprobs"] for entry in content)
    assert all(entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0 for entry in content)
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None, zero.text
    assert two.status_code == 400 and two.json()["error"]["param"] == "top_logprobs", two.text
    assert [(r.status_code, r.json()["error"]["param"]) for r in over] == [(400, "top_logprobs")] * 2
    assert all(r.json()["error"]["message"].startswith("top_logprobs: at most 20") for r in over)


def test_an_empty_cache_salt_is_refused_as_vllm() -> None:
    """vLLM's server: "Parameter 'cache_salt' must be a non-empty string if provided" (the engine API keeps "")."""
    from asyncllm.integrations.openai_embeddings import EmbeddingRequest
    from asyncllm.integrations.openai_score import ScoreRequest
    from asyncllm.integrations.responses_api import ResponsesRequest

    bodies = [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": []}),
              (EmbeddingRequest, {"input": "x"}), (ScoreRequest, {"text_1": "a", "text_2": "b"}),
              (ResponsesRequest, {"input": "x"})]
    for kind, body in bodies:
        with pytest.raises(InvalidRequestError) as info:
            decode_request(msgspec.json.encode({"model": "m", **body, "cache_salt": ""}), kind)
        assert info.value.field == "cache_salt", kind
        assert decode_request(msgspec.json.encode({"model": "m", **body, "cache_salt": "t"}), kind).cache_salt == "t"


def test_logit_bias_is_clamped_to_openais_range_as_vllms() -> None:
    """vLLM's server clamps each bias to [-100, 100] (a -1000 to ban a token is -100)."""
    from asyncllm.integrations.openai_protocol import ServerLimits
    from asyncllm.integrations.openai_sampling import completion_params

    req = decode_request(b'{"prompt": "x", "logit_bias": {"5": -1000, "7": 250.5, "9": 3}}', CompletionRequest)
    assert completion_params(req, ServerLimits()).logit_bias == {5: -100.0, 7: 100.0, 9: 3.0}
