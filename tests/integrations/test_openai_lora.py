"""LoRA adapters through the OpenAI-compatible server: ``--lora-modules`` names route requests to their adapter
(outputs equal PEFT's), /v1/models lists them, and vLLM's runtime load/unload routes exist only with
ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING; `asyncllm serve` refuses bad LoRA flags before starting anything."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, ConfigError, envs
from asyncllm.integrations.openai_lora import LoRAModule
from asyncllm.integrations.openai_server import create_app
from hf_reference import hf_greedy
from lora_utils import make_adapter, peft_greedy

asyncio_test = pytest.mark.asyncio(loop_scope="session")

BASE = "tiny-base"
KEY = "sk-lora-test"
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 12]
MAX_TOKENS = 8
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two adapters of the tiny Llama by module name: every projection at rank 8; q, v and down at rank 4."""
    return {"sql": make_adapter(tiny_llama, str(tmp_path_factory.mktemp("sql")), seed=1),
            "chat": make_adapter(tiny_llama, str(tmp_path_factory.mktemp("chat")), seed=2, rank=4,
                                 targets=["q_proj", "v_proj", "down_proj"])}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lora_engine(tiny_llama: str):
    async with AsyncEngine(tiny_llama, enable_lora=True, max_loras=2, disable_log_stats=True) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lora_app(lora_engine, adapters):
    """Both adapters as modules, the runtime routes on, an API key; its startup (the modules' check) run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(envs.ALLOW_RUNTIME_LORA_UPDATING.name, "1")
        app = create_app(lora_engine, model_name=BASE, api_key=KEY, manage_engine=False,
                         lora_modules=[LoRAModule(name, path) for name, path in adapters.items()])
    async with app.router.lifespan_context(app):
        yield app


def _client(app, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers)


def _decoded(engine, token_ids: list[int]) -> str:
    return engine.tokenizer.decode(token_ids, skip_special_tokens=True)


async def _complete(client: httpx.AsyncClient, model: str | None, prompt=PROMPT) -> httpx.Response:
    body = {**GREEDY, "prompt": prompt, **({"model": model} if model is not None else {})}
    return await client.post("/v1/completions", json=body)


@asyncio_test
async def test_models_lists_the_base_then_each_module(lora_app, lora_engine, adapters, tiny_llama) -> None:
    async with _client(lora_app) as client:
        cards = (await client.get("/v1/models")).json()["data"]
    assert [card["id"] for card in cards] == [BASE, "sql", "chat"]
    assert (cards[0]["root"], cards[0]["parent"]) == (tiny_llama, None)
    for card in cards[1:]:
        assert (card["root"], card["parent"], card["object"]) == (adapters[card["id"]], BASE, "model")
        assert card["max_model_len"] == lora_engine.config.max_model_len


@asyncio_test
async def test_module_names_run_their_adapter(lora_app, lora_engine, adapters, tiny_llama) -> None:
    """One batch mixing both adapters and the base model (named and not): each equals its reference."""
    models = [BASE, "sql", "chat", None]
    async with _client(lora_app) as client:
        replies = await asyncio.gather(*(_complete(client, model) for model in models))
    for model, reply in zip(models, replies):
        body = reply.json()
        expected = (hf_greedy(tiny_llama, PROMPT, MAX_TOKENS) if model in (BASE, None)
                    else peft_greedy(tiny_llama, adapters[model], PROMPT, MAX_TOKENS))
        assert body["model"] == (model or BASE)  # a module's name is echoed, as vLLM does
        assert body["usage"]["completion_tokens"] == len(expected), model
        assert body["choices"][0]["text"] == _decoded(lora_engine, expected), model
    assert len({reply.json()["choices"][0]["text"] for reply in replies[:3]}) == 3  # the adapters change outputs


@asyncio_test
async def test_chat_responses_tokenize_and_streams_take_module_names(lora_app, lora_engine, adapters,
                                                                     tiny_llama) -> None:
    messages = [{"role": "user", "content": "Write a query"}]
    async with _client(lora_app) as client:
        tokens = (await client.post("/tokenize", json={"model": "chat", "messages": messages})).json()["tokens"]
        chat = (await client.post("/v1/chat/completions", json={**GREEDY, "model": "chat", "messages": messages}))
        response = await client.post("/v1/responses", json={"model": "chat", "input": "Write a query",
                                                             "max_output_tokens": MAX_TOKENS, "temperature": 0})
        streamed = await client.post("/v1/completions", json={**GREEDY, "model": "sql", "prompt": PROMPT,
                                                              "stream": True})
    expected = _decoded(lora_engine, peft_greedy(tiny_llama, adapters["chat"], tokens, MAX_TOKENS))
    assert expected  # not a vacuous comparison
    assert (chat.json()["model"], chat.json()["choices"][0]["message"]["content"]) == ("chat", expected)
    body = response.json()
    assert (body["model"], body["output"][0]["content"][0]["text"]) == ("chat", expected)
    chunks = [line[len("data: "):] for line in streamed.text.split("\n\n") if line.startswith("data: ")][:-1]
    events = [json.loads(chunk) for chunk in chunks]
    assert {event["model"] for event in events} == {"sql"}
    sql = _decoded(lora_engine, peft_greedy(tiny_llama, adapters["sql"], PROMPT, MAX_TOKENS))
    assert "".join(event["choices"][0]["text"] for event in events) == sql


@asyncio_test
async def test_unknown_model_is_404(lora_app) -> None:
    async with _client(lora_app) as client:
        completion = await _complete(client, "nope")
        tokenize = await client.post("/tokenize", json={"model": "nope", "prompt": "x"})
    for reply in (completion, tokenize):
        error = reply.json()["error"]
        assert (reply.status_code, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert "'sql'" in completion.json()["error"]["message"]  # the names it serves, adapters included


@asyncio_test
async def test_load_and_unload_round_trip(lora_app, lora_engine, tiny_llama, tmp_path) -> None:
    """Load, serve, refuse a second load of the name, unload (then 404s), reload other weights under the same
    name: a new id, so the workers cannot serve the old adapter's cached weights."""
    first = make_adapter(tiny_llama, str(tmp_path / "first"), seed=3, rank=4)
    second = make_adapter(tiny_llama, str(tmp_path / "second"), seed=4, rank=4)
    server = lora_app.state.openai_server
    load = {"lora_name": "new", "lora_path": first}
    async with _client(lora_app) as client:
        unauthorized = await client.post("/v1/load_lora_adapter", json=load, headers={"Authorization": ""})
        loaded = await client.post("/v1/load_lora_adapter", json=load)
        first_id = server.loras.get("new").lora_int_id
        cards = (await client.get("/v1/models")).json()["data"]
        served = await _complete(client, "new")
        again = await client.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": second})
        base_name = await client.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": second})
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        removed = first_id not in lora_engine._processor._lora._checked  # remove_lora: the engine forgot its id
        gone = await _complete(client, "new")
        unload_again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        reloaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": second})
        second_id = server.loras.get("new").lora_int_id
        served_again = await _complete(client, "new")
        await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert unauthorized.status_code == 401
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'new' added successfully.")
    assert (cards[-1]["id"], cards[-1]["root"], cards[-1]["parent"]) == ("new", first, BASE)
    assert served.json()["choices"][0]["text"] == _decoded(lora_engine, peft_greedy(tiny_llama, first, PROMPT,
                                                                                    MAX_TOKENS))
    for refused in (again, base_name):
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "lora_name")
    assert (unloaded.status_code, gone.status_code, removed) == (200, 404, True)
    error = unload_again.json()["error"]
    assert (unload_again.status_code, error["type"], error["param"]) == (404, "not_found_error", "lora_name")
    assert reloaded.status_code == 200 and second_id > first_id
    assert served_again.json()["choices"][0]["text"] == _decoded(lora_engine, peft_greedy(tiny_llama, second, PROMPT,
                                                                                          MAX_TOKENS))


@asyncio_test
async def test_load_inplace_serves_the_new_weights(lora_app, lora_engine, tiny_llama, tmp_path) -> None:
    """vLLM's bodies: ``load_inplace`` replaces the adapter of a served name, even from the same folder retrained in
    place (an RL loop's), and a bad one leaves the old served; unload takes ``lora_int_id`` (not checked, as vLLM)."""
    first = make_adapter(tiny_llama, str(tmp_path / "first"), seed=3, rank=4)
    second = make_adapter(tiny_llama, str(tmp_path / "second"), seed=4, rank=4)
    folder = tmp_path / "policy"
    shutil.copytree(first, folder)
    expected = [_decoded(lora_engine, peft_greedy(tiny_llama, path, PROMPT, MAX_TOKENS)) for path in (first, second)]
    load = {"lora_name": "pol", "lora_path": str(folder), "load_inplace": True}
    async with _client(lora_app) as client:
        statuses = [(await client.post("/v1/load_lora_adapter", json=load)).status_code]
        texts = [(await _complete(client, "pol")).json()["choices"][0]["text"]]
        shutil.rmtree(folder)
        shutil.copytree(second, folder)
        replaced_id = lora_app.state.openai_server.loras.get("pol").lora_int_id
        statuses.append((await client.post("/v1/load_lora_adapter", json=load)).status_code)
        assert replaced_id not in lora_engine._processor._lora._checked  # the replaced id removed from the engine
        bad = await client.post("/v1/load_lora_adapter", json={**load, "lora_path": str(tmp_path / "missing")})
        refused = await client.post("/v1/load_lora_adapter", json={**load, "load_inplace": False})
        texts.append((await _complete(client, "pol")).json()["choices"][0]["text"])
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "pol", "lora_int_id": 12345})
    assert statuses == [200, 200] and texts == expected and expected[0] != expected[1]
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "lora_path")
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "lora_name")
    assert unloaded.status_code == 200 and lora_app.state.openai_server.loras.get("pol") is None


@asyncio_test
async def test_load_of_a_bad_adapter_is_400(lora_app, tiny_llama, tmp_path) -> None:
    high_rank = make_adapter(tiny_llama, str(tmp_path / "r32"), seed=5, rank=32)
    cases = {str(tmp_path): "no adapter_config.json", str(tmp_path / "missing"): "missing",
             high_rank: "max_lora_rank=16"}
    async with _client(lora_app) as client:
        replies = [await client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
                   for path in cases]
        unknown_field = await client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": high_rank,
                                                                          "lora_int_id": 9})
        models = (await client.get("/v1/models")).json()["data"]
    for reply, why in zip(replies, cases.values()):
        error = reply.json()["error"]
        assert (reply.status_code, error["param"]) == (400, "lora_path") and why in error["message"], error
    assert (unknown_field.status_code, unknown_field.json()["error"]["param"]) == (400, "lora_int_id")
    assert "bad" not in [card["id"] for card in models]


@asyncio_test
async def test_runtime_routes_exist_only_with_the_env_var(lora_engine, monkeypatch) -> None:
    body = {"lora_name": "x", "lora_path": "/nowhere"}
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv(envs.ALLOW_RUNTIME_LORA_UPDATING.name, raising=False)
        else:
            monkeypatch.setenv(envs.ALLOW_RUNTIME_LORA_UPDATING.name, value)
        async with _client(create_app(lora_engine, manage_engine=False)) as client:
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                assert (await client.post(route, json=body)).status_code == 404, (value, route)
    monkeypatch.setenv(envs.ALLOW_RUNTIME_LORA_UPDATING.name, "maybe")
    with pytest.raises(ConfigError, match=envs.ALLOW_RUNTIME_LORA_UPDATING.name):
        create_app(lora_engine, manage_engine=False)


def test_module_names_are_checked_when_the_app_is_made(adapters) -> None:
    engine = AsyncEngine(disable_log_stats=True)  # never started
    sql = LoRAModule("sql", adapters["sql"])
    bad = {"two LoRA modules have this name": [sql, LoRAModule("sql", adapters["chat"])],
           "served model name": [LoRAModule(BASE, adapters["sql"])],
           "base_model_name 'other'": [LoRAModule("sql", adapters["sql"], base_model_name="other")]}
    for why, modules in bad.items():
        with pytest.raises(ConfigError, match=why):
            create_app(engine, model_name=BASE, lora_modules=modules)


@asyncio_test
async def test_startup_fails_when_the_engine_serves_no_adapters(bundled_engine, adapters) -> None:
    app = create_app(bundled_engine, manage_engine=False, lora_modules=[LoRAModule("sql", adapters["sql"])])
    with pytest.raises(ConfigError, match="lora_modules='sql=.*enable_lora=True"):
        async with app.router.lifespan_context(app):
            pass


def test_cli_refuses_bad_lora_flags(capsys) -> None:
    from asyncllm.cli import main

    cases = {("--lora-modules", "sql=/tmp/sql"): "--lora-modules needs --enable-lora",
             ("--enable-lora", "--lora-modules", "sql"): "neither NAME=PATH nor a JSON object",
             ("--enable-lora", "--lora-modules", '{"name": "sql"}'): "missing required field `path`",
             ("--enable-lora", "--lora-modules", "a=/x", "a=/y"): "two LoRA modules"}
    for argv, why in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", *argv])
        assert exit_info.value.code == 2 and why in capsys.readouterr().err, argv


def test_the_last_lora_modules_list_wins_as_vllms(tmp_path) -> None:
    """vLLM's LoRAParserAction sets the list: a later --lora-modules (the command line's over --config's) replaces."""
    from asyncllm.cli import _parser, parse_args

    config = tmp_path / "serve.yaml"
    config.write_text("lora-modules: [a=/x]\n")
    for argv in (["--config", str(config), "--lora-modules", "b=/y", "c=/z"],
                 ["--lora-modules", "a=/x", "--lora-modules", "b=/y", "c=/z"]):
        args = parse_args(_parser(), ["serve", "m", *argv])
        assert [module.name for module in args.lora_modules] == ["b", "c"], argv


def test_lora_module_forms() -> None:
    assert LoRAModule.parse("sql=/a/b=c") == LoRAModule("sql", "/a/b=c")
    assert LoRAModule.parse('{"name": "sql", "path": "/a", "base_model_name": "m"}') == LoRAModule("sql", "/a", "m")
    for raw in ("sql=", "=/a", '{"name": "sql", "path": "/a", "rank": 8}'):
        with pytest.raises(ValueError):
            LoRAModule.parse(raw)
