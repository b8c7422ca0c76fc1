"""vLLM's serve options: ``--config FILE`` (YAML), ``--default-chat-template-kwargs``, and the request log
(``--enable-log-requests``, ``--max-log-len``, the deprecated ``--disable-log-requests``)."""

from __future__ import annotations

import json
import logging
from unittest.mock import patch

import pytest

from asyncllm.cli import _parser, parse_args
from asyncllm.cli_commands import request_logger
from asyncllm.cli_config import expand_config_file
from asyncllm.errors import ConfigError
from asyncllm.integrations.openai_protocol import ChatCompletionRequest, ChatTemplates, CompletionRequest
from asyncllm.integrations.openai_request_log import RequestLogger, _prompt_parts, log_prompts
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client

GREEDY = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
THINKING = ("{% for m in messages %}{{ m.content }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %} no thoughts{% else %} think{% endif %}")
"""A template that reads ``enable_thinking`` as Qwen3's does (thinking unless it is false)."""


def test_config_file_options_under_the_command_line(tmp_path, capsys) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("model: /models/from-config\nport: 8001\nmax_n: 4\nenable-log-requests: true\n"
                      "trust_request_chat_template: true\nenable_prefix_caching: false\nreturn-tokens-as-token-ids: false\n"
                      "served-model-name: [a, b]\ndefault-chat-template-kwargs: {enable_thinking: false}\n")
    args = parse_args(_parser(), ["serve", "--config", str(config), "--port", "9000", "--no-enable-log-requests"])
    assert (args.port, args.max_n, args.enable_log_requests, args.trust_request_chat_template) == (9000, 4, False, True)
    assert (args.enable_prefix_caching, args.return_tokens_as_token_ids) == (False, False)  # --no-..., nothing
    assert (args.served_model_name, args.default_chat_template_kwargs) == (["a", "b"], {"enable_thinking": False})
    assert args.model == "/models/from-config"
    assert parse_args(_parser(), ["serve", "m", f"--config={config}"]).model == "m"  # the command line's MODEL wins
    core = tmp_path / "core.yaml"
    core.write_text("max_num_seqs: 8\n")
    assert parse_args(_parser(), ["engine", "--config", str(core)]).max_num_seqs == 8
    core.write_text("max-n: 8\n")  # a serve option, and a prefix of engine flags: unknown to `engine`
    with pytest.raises(SystemExit):
        parse_args(_parser(), ["engine", "--config", str(core)])
    assert "unrecognized arguments: --max-n (the key 'max-n'" in capsys.readouterr().err
    after_dashes = ["engine", "--", "m", "--config", str(core)]  # a positional after "--", never read
    assert expand_config_file(after_dashes, _parser()) == (after_dashes, None)
    core.write_text("max_num_seqs: null\n")  # null: left unset
    assert not hasattr(parse_args(_parser(), ["engine", "--config", str(core)]), "max_num_seqs")
    for text, said in (("config: other.yaml\n", "unrecognized arguments: --config"),
                       ("enforce_eager: 'false'\n", "the key 'enforce_eager' is a flag")):
        core.write_text(text)
        with pytest.raises(SystemExit):
            parse_args(_parser(), ["engine", "--config", str(core)])
        assert said in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["serve", "--enable_auto_tool_choice"], "needs --tool-call-parser"),
                                        (["engine", "--max_num_seqs=0"], "max_num_seqs=0 is not allowed"),
                                        (["generate", "--max_tokens", "0"], "error: max_tokens"),
                                        (["bench", "latency", "--input_len", "-1"], "argument --input-len")])
def test_underscored_flag_names_are_vllms_dashed_ones(argv, said, capsys) -> None:
    """vLLM's FlexibleArgumentParser reads --max_model_len as --max-model-len: every command's names, not values."""
    from asyncllm.cli import main
    from asyncllm.cli_config import dash_flag_names

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert dash_flag_names(["serve", "m_1", "--a_b=c_d", "-x_y", "--", "--e_f"]) == [
        "serve", "m_1", "--a-b=c_d", "-x_y", "--", "--e_f"]


@pytest.mark.asyncio(loop_scope="session")
async def test_default_chat_template_kwargs_under_the_requests(bundled_engine, bundled_tokenizer) -> None:
    args = parse_args(_parser(), ["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    app = create_app(bundled_engine, manage_engine=False, chat_template=THINKING,
                     default_chat_template_kwargs=args.default_chat_template_kwargs)
    messages = [{"role": "user", "content": "hi"}]
    async with asgi_client(app) as client:
        default = await client.post("/tokenize", json={"messages": messages})
        asked = await client.post("/tokenize", json={"messages": messages,
                                                     "chat_template_kwargs": {"enable_thinking": True}})
        chat = await client.post("/v1/chat/completions", json={**GREEDY, "messages": messages, "return_token_ids": True})
    quiet, thinking = (bundled_tokenizer(text, add_special_tokens=False).input_ids for text in ("hi no thoughts", "hi think"))
    assert (default.json()["tokens"], asked.json()["tokens"]) == (quiet, thinking)
    assert chat.json()["prompt_token_ids"] == quiet
    with pytest.raises(ConfigError, match="default_chat_template_kwargs"):
        ChatTemplates.create(default_kwargs={"tools": []})  # an argument of apply_chat_template, not a variable


def test_request_fields_win_over_default_chat_template_kwargs() -> None:
    """vLLM's ``ChatParams.with_defaults``: the server's defaults lie under the request's template variables, its
    ``reasoning_effort`` and ``add_generation_prompt`` included, and the ``enable_thinking`` that ``reasoning_effort``
    sets (``build_chat_params``); until 2026-12-08 a default ``reasoning_effort`` (or ``add_generation_prompt``)
    overrode the request's field, and ``reasoning_effort`` set no ``enable_thinking``."""
    templates = ChatTemplates.create(default_kwargs={"reasoning_effort": "low", "add_generation_prompt": False,
                                                     "enable_thinking": False})
    messages = [{"role": "user", "content": "hi"}]
    asked = templates.kwargs(ChatCompletionRequest(messages=messages, reasoning_effort="high"))
    assert (asked["reasoning_effort"], asked["add_generation_prompt"], asked["enable_thinking"]) == (
        "high", True, True)
    unset = templates.kwargs(ChatCompletionRequest(messages=messages))
    assert (unset["reasoning_effort"], unset["add_generation_prompt"], unset["enable_thinking"]) == ("low", True, False)
    own = templates.kwargs(ChatCompletionRequest(messages=messages, reasoning_effort="high",
                                                 chat_template_kwargs={"enable_thinking": True}))
    assert (own["reasoning_effort"], own["enable_thinking"]) == ("high", True)


@pytest.mark.asyncio(loop_scope="session")
async def test_request_log_lines(bundled_engine, caplog, capsys) -> None:
    args = parse_args(_parser(), ["serve", "--enable-log-requests", "--max-log-len", "4", "--disable-log-requests"])
    assert "asyncllm serve: warning: option '--disable-log-requests' is deprecated" in capsys.readouterr().err
    assert request_logger(args, _parser()) == RequestLogger(max_log_len=4)
    assert request_logger(parse_args(_parser(), ["serve", "--disable-log-requests"]), _parser()) is None
    caplog.set_level(logging.DEBUG, logger="asyncllm.integrations.openai.requests")
    async with asgi_client(create_app(bundled_engine, manage_engine=False, request_logger=RequestLogger(4))) as client:
        done = await client.post("/v1/completions", json={**GREEDY, "prompt": ["hello world", "x"]},
                                 headers={"X-Request-Id": "abc"})
        ids = await client.post("/v1/completions", json={**GREEDY, "prompt": [5, 6, 7, 8, 9], "request_id": "ids"})
        chat = await client.post("/v1/chat/completions", json={**GREEDY, "messages": [{"role": "user", "content": "hi"}]})
    assert done.status_code == ids.status_code == chat.status_code == 200
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "asyncllm.integrations.openai.requests"]
    assert lines[0] == ("DEBUG", "Request cmpl-abc-0 details: prompt: 'hell', prompt_token_ids: None, "
                                 "prompt_embeds shape: None.")
    assert lines[1][0] == "INFO" and lines[1][1].startswith("Received request cmpl-abc-0: params: SamplingParams(")
    assert lines[1][1].endswith(", lora_request: None.") and "max_tokens=2" in lines[1][1]
    assert lines[2] == ("DEBUG", "Request cmpl-abc-1 details: prompt: 'x', prompt_token_ids: None, "
                                 "prompt_embeds shape: None.")
    assert lines[4] == ("DEBUG", "Request cmpl-ids-0 details: prompt: None, prompt_token_ids: [5, 6, 7, 8], "
                                 "prompt_embeds shape: None.")
    assert lines[6] == ("DEBUG", f"Request {chat.json()['id']} details: prompt: '[{{\"r', prompt_token_ids: None, "
                                 "prompt_embeds shape: None.")
    assert len(lines) == 8 and lines[7][1].startswith(f"Received request {chat.json()['id']}: params: ")
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                                         {"type": "text", "text": "what?"}]}
    assert json.loads(_prompt_parts([image])[0]) == [{"role": "user", "content": [
        {"type": "image_url"}, {"type": "text", "text": "what?"}]}]  # a media part's data never reaches the log
    caplog.clear()
    caplog.set_level(logging.INFO, logger="asyncllm.integrations.openai.requests")
    with patch("asyncllm.integrations.openai_request_log._prompt_parts", side_effect=AssertionError):
        log_prompts(RequestLogger(), CompletionRequest(model="m", prompt="p"), "cmpl", ["p"], None, None)
    assert [r.levelname for r in caplog.records] == ["INFO"]  # below DEBUG the prompt is not even built


@pytest.mark.asyncio(loop_scope="session")
async def test_score_rerank_and_tokenize_are_logged(bundled_engine, caplog) -> None:
    """As vLLM's: /score and /rerank log an embedding model's texts (text_1's, then text_2's) as ``score-ID-i`` /
    ``rerank-ID-i`` with the pooling params, ID the X-Request-Id header (else random), the response's id;
    /tokenize and /detokenize their prompt as ``tokn-ID``, params None; /v1/embeddings its inputs as ``embd-ID-i``."""
    caplog.set_level(logging.DEBUG, logger="asyncllm.integrations.openai.requests")
    async with asgi_client(create_app(bundled_engine, manage_engine=False, request_logger=RequestLogger())) as client:
        scored = await client.post("/score", json={"text_1": "a", "text_2": ["b", "c"]}, headers={"X-Request-Id": "s"})
        reranked = (await client.post("/rerank", json={"query": "q", "documents": ["d"]})).json()
        tokens = (await client.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "t"})).json()["tokens"]
        await client.post("/detokenize", json={"tokens": tokens}, headers={"X-Request-Id": "d"})
        embedded = await client.post("/v1/embeddings", json={"input": ["e"]}, headers={"X-Request-Id": "e"})
    assert embedded.json()["id"] == "embd-e"  # the id it was logged under
    records = [r for r in caplog.records if r.name == "asyncllm.integrations.openai.requests"]
    rerank = reranked["id"]
    assert scored.json()["id"] == "score-s" and rerank.startswith("rerank-")
    details = [(f"score-s-{i}", repr(text), None) for i, text in enumerate("abc")]
    details += [(f"{rerank}-0", "'q'", None), (f"{rerank}-1", "'d'", None), ("tokn-t", "'hi'", tokens),
                ("tokn-d", "None", tokens), ("embd-e-0", "'e'", None)]
    assert [r.getMessage() for r in records if r.levelname == "DEBUG"] == [
        f"Request {rid} details: prompt: {text}, prompt_token_ids: {ids}, prompt_embeds shape: None."
        for rid, text, ids in details]
    infos = [r.getMessage() for r in records if r.levelname == "INFO"]
    assert infos[0].startswith("Received request score-s-0: params: PoolingParams(") and len(infos) == len(details)
    assert infos[-2] == "Received request tokn-d: params: None, lora_request: None."
