"""vLLM's ``use_beam_search`` on /v1/completions and /v1/chat/completions: the choices are
`AsyncEngine.beam_search`'s beams, best first; usage; streaming; every refused combination is a 400."""

from __future__ import annotations

import pytest

from asyncllm import BeamSearchParams
from asyncllm.integrations.openai_protocol import ServerLimits
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client, sse_events

pytestmark = pytest.mark.asyncio(loop_scope="session")

BEAM = {"model": "asyncllm-tiny", "use_beam_search": True, "max_tokens": 6}
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


def _usage(prompt_tokens: int, beams) -> dict[str, int]:
    completion = sum(beam.num_output_tokens for beam in beams)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


async def test_completion_choices_are_the_engines_beams(app, bundled_engine, bundled_tokenizer) -> None:
    prompt = "def add(a, b):"
    ids = bundled_tokenizer(prompt).input_ids
    expected = (await bundled_engine.beam_search(ids, BeamSearchParams(beam_width=3, max_tokens=6))).sequences
    async with asgi_client(app) as client:
        body = (await client.post("/v1/completions", json={**BEAM, "prompt": prompt, "n": 3, "logprobs": 6})).json()
    assert body["object"] == "text_completion" and body["model"] == "asyncllm-tiny"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [beam.text for beam in expected]
    assert [c["finish_reason"] for c in body["choices"]] == [beam.finish_reason for beam in expected]
    for choice, beam in zip(body["choices"], expected):  # each chosen token's logprob and the 2 * width alternatives
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(beam.token_logprobs)
        for top, entry in zip(choice["logprobs"]["top_logprobs"], beam.logprobs, strict=True):
            assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in entry.values()})
        assert choice["logprobs"]["tokens"] == [entry[t].decoded_token for t, entry in
                                                zip(beam.tokens[len(ids):], beam.logprobs)]
    assert body["usage"] == _usage(len(ids), expected)


async def test_completion_best_of_prompt_list_and_options(app, bundled_engine, bundled_tokenizer) -> None:
    """best_of is the beam width (the best n returned); each prompt of a list (here token ids) is searched; length_penalty,
    ignore_eos and truncate_prompt_tokens reach the search."""
    prompts = [bundled_tokenizer(text).input_ids for text in ("import os\n", "class A:")]
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5)
    request = {**BEAM, "prompt": prompts, "n": 2, "best_of": 3, "max_tokens": 5, "ignore_eos": True,
               "length_penalty": 0.5, "truncate_prompt_tokens": 3}
    async with asgi_client(app) as client:
        body = (await client.post("/v1/completions", json=request)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    beams = []
    for i, prompt in enumerate(prompts):
        expected = (await bundled_engine.beam_search(prompt[-3:], params)).sequences[:2]
        assert [c["text"] for c in body["choices"][2 * i: 2 * i + 2]] == [beam.text for beam in expected]
        assert all(c["finish_reason"] == "length" for c in body["choices"])
        beams += expected
    assert body["usage"] == _usage(6, beams)  # each prompt's 3 tokens once, every returned beam's tokens


async def test_chat_choices_are_the_beams_of_the_rendered_prompt(app, bundled_engine, bundled_tokenizer) -> None:
    ids = bundled_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = (await bundled_engine.beam_search(ids, BeamSearchParams(beam_width=2, max_tokens=8))).sequences
    request = {**BEAM, "messages": MESSAGES, "n": 2, "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2,
               "temperature": 0.7, "seed": 1}  # vLLM's steps take the temperature; the raw logprobs rank the beams
    async with asgi_client(app) as client:
        body = (await client.post("/v1/chat/completions", json=request)).json()
    assert body["object"] == "chat.completion"
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": beam.text} for beam in expected]
    assert [c["finish_reason"] for c in body["choices"]] == [beam.finish_reason for beam in expected]
    for choice, beam in zip(body["choices"], expected):
        content = choice["logprobs"]["content"]
        assert [t["logprob"] for t in content] == pytest.approx(beam.token_logprobs)
        for token, entry in zip(content, beam.logprobs, strict=True):
            best_two = sorted((lp.logprob for lp in entry.values()), reverse=True)[:2]
            assert [top["logprob"] for top in token["top_logprobs"]] == pytest.approx(best_two)
    assert body["usage"] == _usage(len(ids), expected)


async def test_stream_sends_each_beam_whole(app) -> None:
    completion = {**BEAM, "prompt": "for i in range(", "n": 2, "stream_options": {"include_usage": True}}
    chat = {**BEAM, "messages": MESSAGES, "n": 2, "stream_options": {"include_usage": True}}
    async with asgi_client(app) as client:
        whole = (await client.post("/v1/completions", json={**completion, "stream_options": None})).json()
        streamed = await client.post("/v1/completions", json={**completion, "stream": True})
        whole_chat = (await client.post("/v1/chat/completions", json={**chat, "stream_options": None})).json()
        streamed_chat = await client.post("/v1/chat/completions", json={**chat, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert [e["choices"] for e in events[:-1]] == [[c] for c in whole["choices"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    events = sse_events(streamed_chat.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [(e["choices"][0]["delta"]["content"], e["choices"][0]["finish_reason"]) for e in events[2:-1]] == [
        (c["message"]["content"], c["finish_reason"]) for c in whole_chat["choices"]]
    assert events[-1]["usage"] == whole_chat["usage"]


async def test_beams_stop_at_max_model_len(app, bundled_engine) -> None:
    room = 3
    ids = [5 + i % 50 for i in range(bundled_engine.config.max_model_len - room)]
    async with asgi_client(app) as client:
        body = (await client.post("/v1/completions", json={**BEAM, "prompt": ids, "n": 2, "max_tokens": room})).json()
        over = await client.post("/v1/completions", json={**BEAM, "prompt": ids, "n": 2, "max_tokens": room + 1})
        too_long = await client.post("/v1/completions", json={**BEAM, "prompt": ids + [5] * room})
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 2 * room
    assert (over.status_code, over.json()["error"]["param"], over.json()["error"]["code"]) == (
        400, "max_tokens", "context_length_exceeded")  # as sampling: vLLM checks the length first
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input_tokens"


COMPLETION_REFUSALS = [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"top_k": 5}, "top_k"),
    ({"min_p": 0.1}, "min_p"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"stop": ["\n"]}, "stop"), ({"stop_token_ids": [5]}, "stop_token_ids"),
    ({"min_tokens": 2}, "min_tokens"), ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"echo": True}, "echo"), ({"n": 2, "logprobs": 5}, "logprobs"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 11}, "n"),  # 2 * 11 logprobs a step, over max_logprobs=20 ({"n": 2, "best_of": 129}, "best_of"), ({"max_tokens": 0}, "max_tokens"),
    ({"truncate_prompt_tokens": 600}, "truncate_prompt_tokens"),
]
CHAT_REFUSALS = [
    ({"temperature": -1.0}, "temperature"), ({"logit_bias": {"5": -1.0}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"n": 2, "logprobs": True, "top_logprobs": 5}, "top_logprobs"),
    ({"top_logprobs": 1}, "top_logprobs"), ({"stop": "x"}, "stop"), ({"best_of": 2}, "best_of"),
]


async def test_refused_combinations_name_the_field(app) -> None:
    async with asgi_client(app) as client:
        for path, base, cases in (("/v1/completions", {**BEAM, "prompt": "x"}, COMPLETION_REFUSALS),
                                  ("/v1/chat/completions", {**BEAM, "messages": MESSAGES}, CHAT_REFUSALS)):
            for fields, param in cases:
                for stream in (False, True):
                    response = await client.post(path, json={**base, **fields, "stream": stream})
                    assert response.status_code == 400, (path, fields, response.text)
                    assert response.json()["error"]["param"] == param, (path, fields, response.text)
            # the refusals sampling shares: stream options without a stream
            response = await client.post(path, json={**base, "stream_options": {"include_usage": True}})
            assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options", response.text
        # length_penalty means something only with beam search; use_beam_search false is ordinary sampling
        for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            response = await client.post(path, json={**base, "max_tokens": 2, "length_penalty": 0.5})
            assert response.status_code == 400 and response.json()["error"]["param"] == "length_penalty"
            response = await client.post(path, json={**base, "max_tokens": 2, "use_beam_search": False})
            assert response.status_code == 200


async def test_server_limits_apply(bundled_engine) -> None:
    app = create_app(bundled_engine, manage_engine=False, limits=ServerLimits(max_n=2, max_tokens=4))
    async with asgi_client(app) as client:
        too_wide = await client.post("/v1/completions", json={**BEAM, "prompt": "x", "n": 3})
        too_long = await client.post("/v1/completions", json={**BEAM, "prompt": "x", "max_tokens": 5})
        capped = (await client.post("/v1/chat/completions", json={"messages": MESSAGES, "use_beam_search": True,
                                                                  "n": 2})).json()
    assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "n"
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert capped["usage"]["completion_tokens"] <= 2 * 4 and len(capped["choices"]) == 2


async def test_too_many_logprobs_are_refused_before_the_search_runs(app, bundled_engine, monkeypatch) -> None:
    async def no_search(*args, **kwargs):
        raise AssertionError("the search ran")

    monkeypatch.setattr(bundled_engine, "beam_search", no_search)
    async with asgi_client(app) as client:
        completion = await client.post("/v1/completions", json={**BEAM, "prompt": "x", "n": 2, "logprobs": 5})
        chat = await client.post("/v1/chat/completions", json={**BEAM, "messages": MESSAGES, "n": 2,
                                                                "logprobs": True, "top_logprobs": 5})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "logprobs", completion.text
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs", chat.text
