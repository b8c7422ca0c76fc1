"""The OpenAI-compatible app over httpx's ASGI transport: every route and its field errors (the app's own errors,
limits and engine errors mapped to statuses: tests/integrations/test_openai_asgi_errors.py)."""

from __future__ import annotations

import pytest

from asyncllm import EngineOverloadedError, SamplingParams
from asyncllm.beam_search import BeamSearchParams
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client, sse_events

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6}


async def test_models_health_metrics(app, bundled_engine) -> None:
    async with asgi_client(app) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        metrics = await client.get("/metrics")
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == bundled_engine.config.max_model_len
    [permission] = models["data"][0]["permission"]  # vLLM's ModelPermission, its defaults
    assert permission.pop("id").startswith("modelperm-") and permission.pop("created") == models["data"][0]["created"]
    assert permission == {"object": "model_permission", "allow_create_engine": False, "allow_sampling": True,
                          "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                          "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "asyncllm:num_requests_running" in metrics.text


async def test_completion_matches_engine_and_usage_is_exact(app, bundled_engine, bundled_tokenizer) -> None:
    prompt = "def add(a, b):"
    expected = await bundled_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6))
    async with asgi_client(app) as client:
        body = (await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})).json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": expected.text, "logprobs": None,
                                "finish_reason": expected.finish_reason, "stop_reason": expected.outputs[0].stop_reason}]
    prompt_tokens = len(bundled_tokenizer(prompt).input_ids)
    completion_tokens = len(expected.token_ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}


async def test_completion_list_prompts_and_n(app, bundled_engine) -> None:
    prompts = ["import os\n", "class A:"]
    async with asgi_client(app) as client:
        body = (await client.post("/v1/completions", json={**GREEDY, "prompt": prompts, "n": 2})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        expected = await bundled_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6))
        assert [c["text"] for c in body["choices"][2 * i: 2 * i + 2]] == [expected.text] * 2  # greedy samples agree


async def test_completion_stream_equals_non_stream(app) -> None:
    request = {**GREEDY, "prompt": "for i in range(", "max_tokens": 12}
    async with asgi_client(app) as client:
        whole = (await client.post("/v1/completions", json=request)).json()
        streamed = await client.post("/v1/completions", json={**request, "stream": True,
                                                                "stream_options": {"include_usage": True}})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


async def test_continuous_usage_stats(app) -> None:
    request = {**GREEDY, "prompt": "for i in range(", "max_tokens": 12, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with asgi_client(app) as client:
        events = sse_events((await client.post("/v1/completions", json=request)).text)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == events[-1]["usage"]["completion_tokens"] > counts[0]
    assert {e["usage"]["prompt_tokens"] for e in events} == {events[-1]["usage"]["prompt_tokens"]}
    assert events[-1]["choices"] == [] and events[-2]["usage"] == events[-1]["usage"]


async def test_chat_stream_and_not(app, bundled_engine) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    expected = [d async for d in bundled_engine.chat([{"role": "user", "content": "hello"}],
                                                      SamplingParams(temperature=0, max_tokens=8))]
    text = "".join(d.text for d in expected)
    request = {**GREEDY, "max_tokens": 8, "messages": messages}
    async with asgi_client(app) as client:
        whole = (await client.post("/v1/chat/completions", json=request)).json()
        streamed = await client.post("/v1/chat/completions", json={**request, "stream": True})
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    events = sse_events(streamed.text)
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:]) == text
    assert events[-1]["choices"][0]["finish_reason"] == expected[-1].finish_reason
    assert "usage" not in events[0]


async def test_stop_string_truncates(app) -> None:
    request = {**GREEDY, "prompt": "def add(a, b):", "max_tokens": 16}
    async with asgi_client(app) as client:
        text = (await client.post("/v1/completions", json=request)).json()["choices"][0]["text"]
        stop = text[3:5]
        stopped = (await client.post("/v1/completions", json={**request, "stop": [stop]})).json()
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"


async def test_completion_logprobs(app, bundled_tokenizer) -> None:
    ids = bundled_tokenizer('x = "\u20ac"').input_ids
    euro = {**GREEDY, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1}
    async with asgi_client(app) as client:
        body = (await client.post("/v1/completions", json={**GREEDY, "prompt": "x = ", "logprobs": 3})).json()
        echoed = (await client.post("/v1/completions", json=euro)).json()["choices"][0]["logprobs"]
    # vLLM's: the byte tokens of '€' are '', '', '€' (the tokens join into the text), as top_logprobs keys too
    assert echoed["tokens"][1:] == ["x", " =", ' "', "", "", "\u20ac", '"'] and "\u20ac" in echoed["top_logprobs"][-2]
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == body["usage"]["completion_tokens"]
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == 3 and top[token] == logprob == max(top.values())  # greedy: the token is the top one
    offsets = logprobs["text_offset"]
    assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(offsets))]


@pytest.mark.parametrize(("request_body", "param"), [
    ({"prompt": "x", "foo": 1}, "foo"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (the prompt alone)
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": "<longer than max_model_len>"}, "input_tokens"),  # found when tokenized (vLLM param)
    ({}, "prompt"),
])
async def test_invalid_completion_is_400_naming_the_field(app, bundled_engine, request_body, param) -> None:
    if request_body.get("prompt") == "<longer than max_model_len>":
        request_body = {"prompt": "x " * bundled_engine.config.max_model_len}
    async with asgi_client(app) as client:
        response = await client.post("/v1/completions", json={"model": MODEL, **request_body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(("request_body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),  # the part
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_tokens"),
])
async def test_invalid_chat_is_400(app, request_body, param) -> None:
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json={"model": MODEL, **request_body})
    assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text


async def test_a_request_without_model_gets_the_served_model(app) -> None:
    body = {k: v for k, v in GREEDY.items() if k != "model"}
    async with asgi_client(app) as client:
        named = await client.post("/v1/completions", json={**GREEDY, "prompt": "import os"})
        unnamed = await client.post("/v1/completions", json={**body, "prompt": "import os"})
        chat = await client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x"}]})
    assert unnamed.status_code == 200 and chat.status_code == 200, (unnamed.text, chat.text)
    assert unnamed.json()["model"] == chat.json()["model"] == MODEL
    assert unnamed.json()["choices"][0]["text"] == named.json()["choices"][0]["text"]


async def test_vllm_priority_and_cache_salt(app, bundled_engine) -> None:
    body = {**GREEDY, "prompt": "class Salted:\n    def method(self, value):\n        return value * 2\n" * 2}
    chat = {**GREEDY, "messages": [{"role": "user", "content": "x"}]}
    hits, texts = [], []
    async with asgi_client(app) as client:
        refused = await client.post("/v1/completions", json={**body, "priority": 1})
        refused_chat = await client.post("/v1/chat/completions", json={**chat, "priority": -2})
        salted_chat = await client.post("/v1/chat/completions", json={**chat, "cache_salt": "c", "priority": 0})
        for salt in ("a", "a", "b"):
            before = bundled_engine.stats().prefix_cache_hits
            texts.append((await client.post("/v1/completions", json={**body, "cache_salt": salt})).json())
            hits.append(bundled_engine.stats().prefix_cache_hits - before)
    assert [(r.status_code, r.json()["error"]["param"]) for r in (refused, refused_chat)] == [(400, "priority")] * 2
    assert salted_chat.status_code == 200
    assert hits[0] == 0 and hits[1] >= 16 and hits[2] == 0, hits  # a salt shares only with its own salt
    assert len({t["choices"][0]["text"] for t in texts}) == 1


async def test_vllm_tokenize_detokenize_and_version(app, bundled_tokenizer) -> None:
    prompt, messages = "def add(a, b):", [{"role": "user", "content": "hi"}]
    async with asgi_client(app) as client:
        tokens = (await client.post("/tokenize", json={"model": MODEL, "prompt": prompt})).json()
        plain = (await client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})).json()
        chat = (await client.post("/tokenize", json={"messages": messages})).json()
        usage = (await client.post("/v1/chat/completions", json={**GREEDY, "messages": messages})).json()["usage"]
        text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        errors = [await client.post("/detokenize", json={"tokens": [len(bundled_tokenizer)]}),
                  await client.post("/tokenize", json={}),
                  await client.post("/tokenize", json={"prompt": "x", "messages": messages}),
                  await client.post("/tokenize", json={"model": "gpt-4", "prompt": "x"})]
        version = await client.get("/version")
    assert tokens["tokens"] == bundled_tokenizer(prompt).input_ids and tokens["count"] == len(tokens["tokens"])
    assert plain["tokens"] == bundled_tokenizer(prompt, add_special_tokens=False).input_ids
    assert chat["count"] == usage["prompt_tokens"]  # what a chat completion runs
    assert text == {"prompt": bundled_tokenizer.decode(tokens["tokens"])}
    assert [r.status_code for r in errors] == [400, 400, 400, 404]
    assert [r.json()["error"]["param"] for r in errors[:3]] == ["tokens", "prompt", "prompt"]
    assert version.status_code == 200 and version.json()["version"]


async def test_detokenize_takes_the_ids_the_model_generates(app, bundled_engine, bundled_tokenizer,
                                                            monkeypatch) -> None:
    """A model vocabulary padded past the tokenizer's: the engine generates those ids as no text, and /detokenize
    takes them the same way (vLLM's decode skips them); ids past the model's are refused."""
    known = len(bundled_tokenizer)
    assert bundled_engine.vocab_size == known  # the bundled model pads nothing: pretend it does
    monkeypatch.setattr(bundled_engine, "vocab_size", known + 8)
    async with asgi_client(app) as client:
        padded = await client.post("/detokenize", json={"tokens": [5, known + 7, 6]})
        past = await client.post("/detokenize", json={"tokens": [known + 8]})
    assert padded.json() == {"prompt": bundled_tokenizer.decode([5, 6])}
    assert past.status_code == 400 and f"[0, {known + 8})" in past.json()["error"]["message"]


async def test_chat_template_variables(app) -> None:
    chat = {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}
    async with asgi_client(app) as client:
        counts = [(await client.post("/tokenize", json={"messages": chat["messages"], **extra})).json()["count"]
                  for extra in ({}, {"add_generation_prompt": False})]
        prompt_tokens = [(await client.post("/v1/chat/completions", json={**chat, **extra})).json()["usage"]["prompt_tokens"]
                         for extra in ({"chat_template_kwargs": {"add_generation_prompt": False}},
                                       {"add_generation_prompt": False})]
        reserved = await client.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"tokenize": True}})
    assert counts[1] < counts[0] and prompt_tokens == [counts[1]] * 2
    assert (reserved.status_code, reserved.json()["error"]["param"]) == (400, "chat_template_kwargs")


class _FailingEngine:
    """Stands in for an engine whose requests fail with `error` (overloaded, dead)."""

    def __init__(self, error: Exception, alive: bool = True) -> None:
        from asyncllm.config import EngineConfig

        self.error, self.alive, self.started = error, alive, True
        self.config = EngineConfig.create("fake", max_model_len=64)
        self.metrics_registry = None

    def stream(self, prompt, params, **options):
        return self._Stream(self.error)

    chat = stream

    def default_sampling_fields(self) -> dict:
        return {}

    def stats(self):
        from asyncllm.outputs import EngineStats

        return EngineStats(engine_alive=self.alive)

    class _Stream:
        def __init__(self, error: Exception) -> None:
            self.error, self.collector = error, None

        async def __anext__(self):
            raise self.error

        async def aclose(self) -> None:
            pass


async def test_allowed_token_ids_and_bad_words_fields(app, bundled_tokenizer) -> None:
    body = {**GREEDY, "prompt": "import os", "max_tokens": 4, "ignore_eos": True}
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        only = (await client.post("/v1/completions", json={**body, "allowed_token_ids": [42]})).json()
        word = plain.split()[0] if plain.split() else plain
        banned = (await client.post("/v1/completions", json={**body, "bad_words": [word]})).json()
    assert only["choices"][0]["text"] == bundled_tokenizer.decode([42] * 4)
    assert banned["choices"][0]["text"] != plain


async def test_prompt_logprobs_and_truncation_fields(app, bundled_engine, bundled_tokenizer) -> None:
    prompt = "import os\nimport sys\n"
    body = {**GREEDY, "prompt": prompt, "max_tokens": 2}
    chat = {**GREEDY, "max_tokens": 2, "messages": [{"role": "user", "content": prompt}], "prompt_logprobs": 1}
    async with asgi_client(app) as client:
        completion = (await client.post("/v1/completions", json={**body, "prompt_logprobs": 2})).json()
        chat_body = (await client.post("/v1/chat/completions", json=chat)).json()
        streamed = await client.post("/v1/completions", json={**body, "prompt_logprobs": 2, "stream": True})
        unlisted = await client.post("/v1/completions", json={**body, "prompt_logprobs": -1, "stream": True})
        zero = await client.post("/v1/completions", json={**body, "prompt_logprobs": 0, "stream": True})
        no = await client.post("/v1/chat/completions", json={**chat, "prompt_logprobs": False, "stream": True})
        cut = (await client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 3,
                                                          "return_token_ids": True})).json()
        beam = (await client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 3,
                                                           "use_beam_search": True, "n": 2})).json()
    expected = await bundled_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    entries = completion["choices"][0]["prompt_logprobs"]
    assert len(entries) == completion["usage"]["prompt_tokens"] == len(expected.prompt_token_ids) and entries[0] is None
    for token_id, entry, want in zip(expected.prompt_token_ids[1:], entries[1:], expected.prompt_logprobs[1:]):
        assert str(token_id) in entry and entry == {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in want.items()}
    assert len(chat_body["prompt_logprobs"]) == chat_body["usage"]["prompt_tokens"]
    assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "prompt_logprobs")
    assert unlisted.status_code == 400 and "streaming" in unlisted.json()["error"]["message"]
    # as vLLM's: 0 (false) asks for no prompt logprobs, so it streams; the stream carries none
    assert zero.status_code == no.status_code == 200 and zero.text.endswith("data: [DONE]\n\n")
    assert "prompt_logprobs" not in zero.text + no.text and '"content"' in no.text
    assert cut["usage"]["prompt_tokens"] == 3
    ids = bundled_tokenizer(prompt).input_ids
    kept = ids[:1] + ids[-2:]  # vLLM's: the tokenizer cuts the text on the left, BOS kept; beam search too
    assert cut["choices"][0]["prompt_token_ids"] == kept
    beams = await bundled_engine.beam_search(kept, BeamSearchParams(2, 2))
    assert [c["text"] for c in beam["choices"]] == [b.text for b in beams.sequences[:2]]


async def test_several_served_model_names(bundled_engine) -> None:
    from asyncllm.integrations.openai_server import create_app

    app = create_app(bundled_engine, model_name=["tiny", "tiny-alias"], manage_engine=False)
    async with asgi_client(app) as client:
        models = (await client.get("/v1/models")).json()["data"]
        alias = await client.post("/v1/completions", json={**GREEDY, "model": "tiny-alias", "prompt": "x"})
        unnamed = await client.post("/v1/completions", json={"max_tokens": 2, "prompt": "x"})
        other = await client.post("/v1/completions", json={**GREEDY, "model": "asyncllm-tiny", "prompt": "x"})
    assert [m["id"] for m in models] == ["tiny", "tiny-alias"]
    assert alias.status_code == 200 and alias.json()["model"] == "tiny-alias"  # the name asked for, as vLLM's
    assert unnamed.json()["model"] == "tiny"
    assert other.status_code == 404 and "tiny-alias" in other.json()["error"]["message"]


async def test_sagemaker_ping_and_invocations(app) -> None:
    async with asgi_client(app) as client:
        ping = await client.get("/ping")
        completion = await client.post("/invocations", json={**GREEDY, "prompt": "import os"})
        direct = await client.post("/v1/completions", json={**GREEDY, "prompt": "import os"})
        chat = await client.post("/invocations", json={**GREEDY, "messages": [{"role": "user", "content": "x"}]})
        neither = await client.post("/invocations", json={"model": MODEL})
    assert ping.status_code == 200 and ping.json() == {"status": "ok"}
    assert completion.json()["object"] == "text_completion"
    assert completion.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert chat.json()["object"] == "chat.completion"
    assert (neither.status_code, neither.json()["error"]["param"]) == (400, "body")


class _RecordingEngine(_FailingEngine):
    """Records the SamplingParams of each request (which then fails as overloaded)."""

    def __init__(self) -> None:
        super().__init__(EngineOverloadedError("recorded"))
        self.params: list = []

    def stream(self, prompt, params, **options):
        self.params.append(params)
        return self._Stream(self.error)

    chat = stream


async def test_the_mistral_parser_keeps_special_tokens_for_the_requests_it_reads() -> None:
    """[TOOL_CALLS] is a special token: auto tool choice with the mistral parser must see it in the text."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for parser, tool_choice, keeps in [("mistral", "auto", True), ("mistral", "none", False),
                                       ("hermes", "auto", False)]:
        engine = _RecordingEngine()
        app = create_app(engine, model_name="fake", manage_engine=False, tool_call_parser=parser)
        async with asgi_client(app) as client:
            await client.post("/v1/chat/completions", json={"model": "fake", "tools": tools, "tool_choice": tool_choice,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        assert engine.params[0].skip_special_tokens is not keeps, (parser, tool_choice)


async def test_reset_prefix_cache_route_exists_only_in_dev_mode(bundled_engine, monkeypatch) -> None:
    from asyncllm import envs

    prompt = "import os\nimport sys\n" * 12  # several full blocks
    async with asgi_client(create_app(bundled_engine, manage_engine=False)) as client:
        assert (await client.post("/reset_prefix_cache")).status_code == 404
    monkeypatch.setenv(envs.SERVER_DEV_MODE.name, "1")
    async with asgi_client(create_app(bundled_engine, manage_engine=False)) as client:
        for _ in range(2):
            await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})
        hits = bundled_engine.stats().prefix_cache_hits
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})
        assert bundled_engine.stats().prefix_cache_hits == hits  # forgotten: nothing hit
        await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})
        assert bundled_engine.stats().prefix_cache_hits > hits  # cached again by the last request
