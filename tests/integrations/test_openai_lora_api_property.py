"""Property test: vLLM's runtime LoRA routes (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``), the
adapter a request's ``model`` picks, and ``GET /v1/models`` (and ``/v1/models/{model}``) after every step.

The reference is a plain ordered dict of the loaded adapters (name -> path, parent, id), written from vLLM's
``OpenAIServingModels`` (vllm/entrypoints/openai/models/serving.py: ``load_lora_adapter``,
``_check_load_lora_adapter_request``, ``unload_lora_adapter``, ``_check_unload_lora_adapter_request``,
``show_available_models``) and its ``ModelCard`` / ``ModelPermission``:

- load: an empty ``lora_name`` is a 400 (vLLM checks an empty ``lora_path`` there too); a name already loaded is a
  400 unless ``load_inplace``, which replaces that adapter keeping its place in the listing; an adapter the engine
  refuses is a 400 and changes nothing (the replaced one stays served); else 200 and the plain text
  ``Success: LoRA adapter 'NAME' added successfully.``, the adapter listed last (a new name).
- unload: an empty ``lora_name`` is a 400, a name not loaded a 404 ``not_found_error``; ``lora_int_id`` is read and
  not used (vLLM finds the adapter by its name); else 200 and ``... removed successfully.``
- /v1/models: each served name (``root`` the model, ``parent`` null), then each adapter in load order (``root`` its
  path, ``parent`` its module's base_model_name or else the first served name), each with vLLM's one-entry
  ``permission`` list.
- a request's ``model``: left out or empty, the first served name; a served name, the base model; a loaded adapter's
  name, that adapter (its path and its current id); anything else a 404 ``model_not_found``.

With asyncllm's documented differences (docs/integrations/openai-server.md, "Loading and unloading while serving"
and the /v1/models row): a served base model name is refused as ``lora_name`` (400); any adapter that fails the
engine's check is a 400 naming ``lora_path`` (vLLM: a 404 ``NotFoundError`` when no adapter is found there); every
load takes an id never used before, ``load_inplace`` too (vLLM keeps the id), and unloading or replacing an adapter
removes its id from the engine (``remove_lora``): the engine's live ids are exactly the listed adapters'; every card
has ``max_model_len`` (vLLM's adapter cards have null); ``owned_by`` is ``asyncllm``. ``load_inplace`` keeps a
module's ``base_model_name`` as ``parent`` (vLLM's runtime load drops it: the first served name; not documented).

Drawn: programs of 6 to 16 steps over a server serving ``base`` and ``alias`` with one ``--lora-modules`` adapter
``st`` (base_model_name ``alias``): loads (names from a small pool with the served names, ``st`` and ``""``; paths
to two tiny real adapters (half the draws), one of rank 32 above ``max_lora_rank``, one of another model's shapes, a
folder that is no adapter, a missing folder and ``""``; ``load_inplace`` left out, false, true or ``"true"``),
unloads (``lora_int_id`` left out, the adapter's, another, a numeric string, or a non-integer), listings, one card's
retrieval and completions naming a served name, an adapter or an unknown name. The engine is a stand-in whose
``add_lora`` / ``remove_lora`` run asyncllm's real adapter check (`AdapterChecker`) on the tiny Llama's config and
whose ``stream`` records the adapter a request ran with, then refuses it (so no model runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import InvalidRequestError, envs
from asyncllm.integrations.openai_lora import LoRAModule
from asyncllm.integrations.openai_server import create_app
from asyncllm.lora_checker import AdapterChecker

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "80"))
SERVED = ["base", "alias"]
STATIC = "st"
MAX_MODEL_LEN = 96
NAMES = ["a", "b", STATIC, "base", "alias", ""]
PATH_KEYS = ["good1", "good2", "rank32", "other_model", "no_config", "missing", "empty"]
GOOD = {"good1", "good2"}
STUB_REFUSAL = "stand-in engine: no model runs"


# ---------------------------------------------------------------- adapters and the stand-in engine
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "head_dim": 16,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 512, "tie_word_embeddings": False}
"""A tiny Llama's config, as the adapter check reads it (no checkpoint needed: the check reads the adapter only)."""


def write_adapter(folder: str, rank: int, seed: int, in_features: int = 64) -> str:
    """A PEFT LoRA adapter of the tiny Llama on q_proj (`in_features` other than 64: another model's), written with
    numpy."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, in_features), dtype=np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((64, rank), dtype=np.float32)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}, f)
    return folder


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"good1": write_adapter(str(root / "good1"), 4, 1), "good2": write_adapter(str(root / "good2"), 8, 2),
            "rank32": write_adapter(str(root / "rank32"), 32, 3),
            "other_model": write_adapter(str(root / "other_model"), 4, 4, in_features=32),
            "no_config": str(root), "missing": str(root / "missing"), "empty": ""}


class StandInEngine:
    """What the routes under test use of an engine: `add_lora` / `remove_lora` through asyncllm's adapter check (a
    bad adapter is its `InvalidRequestError`), the config /v1/models reads, and a `stream` that records the adapter
    and refuses the request."""

    def __init__(self, model: str) -> None:
        self.config = SimpleNamespace(model=model, max_model_len=MAX_MODEL_LEN, generation_config="auto",
                                      override_generation_config=None)
        self.checker = AdapterChecker(SimpleNamespace(**MODEL_CONFIG), max_lora_rank=16)
        self.started, self.model_name, self.tokenizer = True, None, None
        self.added: list[Any] = []
        """The adapters added (checked), in order."""
        self.live: set[int] = set()
        self.streamed: list[Any] = []

    async def start(self) -> None:
        pass

    async def add_lora(self, request: Any) -> None:
        self.checker.check(request)
        self.added.append(request)
        self.live.add(request.lora_int_id)

    async def remove_lora(self, lora_id: int) -> bool:
        self.checker.forget(lora_id)
        known = lora_id in self.live
        self.live.discard(lora_id)
        return known

    def default_sampling_fields(self) -> dict[str, Any]:
        return {}

    def stream(self, prompt: Any, params: Any, **options: Any) -> Any:
        self.streamed.append(options.get("lora_request"))
        raise InvalidRequestError("prompt", STUB_REFUSAL)


# ---------------------------------------------------------------- the reference
class Reference:
    """The loaded adapters in listing order, name -> [path, parent (None: the first served name), id]."""

    def __init__(self, static_path: str, static_id: int) -> None:
        self.loras: dict[str, list[Any]] = {STATIC: [static_path, "alias", static_id]}
        self.ids_seen = {static_id}

    def load(self, name: str, path_key: str, inplace: bool) -> tuple[int, set[str]]:
        """The status and the params a refusal may name (vLLM's checks, then asyncllm's documented ones)."""
        params = set()
        if name == "":
            params.add("lora_name")
        if path_key == "empty":
            params.add("lora_path")
        if name in SERVED or (name in self.loras and not inplace):
            params.add("lora_name")
        if params:
            return 400, params
        if path_key not in GOOD:
            return 400, {"lora_path"}
        return 200, set()

    def loaded(self, name: str, path: str, new_id: int) -> None:
        assert new_id not in self.ids_seen, f"id {new_id} used again"
        self.ids_seen.add(new_id)
        if name in self.loras:  # load_inplace: same place, same parent
            self.loras[name][0], self.loras[name][2] = path, new_id
        else:
            self.loras[name] = [path, None, new_id]

    def unload(self, name: str | None) -> tuple[int, str | None]:
        if not name:
            return 400, "lora_name"
        if name not in self.loras:
            return 404, "lora_name"
        del self.loras[name]
        return 200, None

    def cards(self, root: str) -> list[dict[str, Any]]:
        base = [{"id": name, "object": "model", "owned_by": "asyncllm", "root": root, "parent": None,
                 "max_model_len": MAX_MODEL_LEN} for name in SERVED]
        return base + [{"id": name, "object": "model", "owned_by": "asyncllm", "root": path,
                        "parent": parent or SERVED[0], "max_model_len": MAX_MODEL_LEN}
                       for name, (path, parent, _) in self.loras.items()]

    def model(self, model: str | None) -> tuple[int, Any]:
        """A completion's status and the adapter it runs with: (name, path, id), None for the base model."""
        if not model or model in SERVED:
            return 400, None  # reaches the engine (which refuses every request)
        if model in self.loras:
            path, _, lora_id = self.loras[model]
            return 400, (model, path, lora_id)
        return 404, None


# ---------------------------------------------------------------- the drawn programs
def load_op() -> st.SearchStrategy:
    paths = st.one_of(st.sampled_from(sorted(GOOD)), st.sampled_from(PATH_KEYS))  # a good one half the time
    return st.tuples(st.just("load"), st.sampled_from(NAMES), paths, st.sampled_from([None, False, True, "true"]))


def unload_op() -> st.SearchStrategy:
    return st.tuples(st.just("unload"), st.sampled_from([*NAMES, None]),
                     st.sampled_from([None, "own", 12345, "7", "x"]))


def other_op() -> st.SearchStrategy:
    models = st.sampled_from([*NAMES, None, "nope"])
    return st.one_of(st.tuples(st.just("listing")), st.tuples(st.just("complete"), models),
                     st.tuples(st.just("retrieve"), st.sampled_from(["a", "b", STATIC, "base", "alias", "nope"])))


PROGRAMS = st.lists(st.one_of(load_op(), load_op(), unload_op(), other_op()), min_size=6, max_size=16)


# ---------------------------------------------------------------- running a program
class Run:
    """One program against a fresh app over a fresh stand-in engine, checked step by step."""

    def __init__(self, app: Any, engine: StandInEngine, paths: dict[str, str], client: httpx.AsyncClient) -> None:
        self.app, self.engine, self.paths, self.client = app, engine, paths, client
        self.ref = Reference(paths["good1"], engine.added[0].lora_int_id)
        self.started = app.state.openai_server.created

    async def step(self, op: tuple) -> None:
        await getattr(self, op[0])(*op[1:])
        await self.check_models()

    async def load(self, name: str, path_key: str, inplace: Any) -> None:
        body: dict[str, Any] = {"lora_name": name, "lora_path": self.paths[path_key]}
        if inplace is not None:
            body["load_inplace"] = inplace
        added = len(self.engine.added)
        reply = await self.client.post("/v1/load_lora_adapter", json=body)
        status, params = self.ref.load(name, path_key, inplace in (True, "true"))
        assert reply.status_code == status, (body, reply.text)
        if status == 200:
            assert reply.text == f"Success: LoRA adapter '{name}' added successfully."
            new = self.engine.added[-1]
            assert len(self.engine.added) == added + 1 and new.lora_name == name
            self.ref.loaded(name, self.paths[path_key], new.lora_int_id)
        else:
            error = reply.json()["error"]
            assert error["param"] in params and error["type"] == "invalid_request_error", (body, error)

    async def unload(self, name: str | None, int_id: Any) -> None:
        body: dict[str, Any] = {} if name is None else {"lora_name": name}
        if int_id == "own":
            int_id = self.ref.loras[name][2] if name in self.ref.loras else 1
        if int_id is not None:
            body["lora_int_id"] = int_id
        reply = await self.client.post("/v1/unload_lora_adapter", json=body)
        if int_id == "x":  # not an integer: the body is refused whatever the name (or its absence)
            status, params = 400, {"lora_int_id", "lora_name" if name is None else "lora_int_id"}
        else:
            status, param = self.ref.unload(name)
            params = {param}
        assert reply.status_code == status, (body, reply.text)
        if status == 200:
            assert reply.text == f"Success: LoRA adapter '{name}' removed successfully."
            return
        error = reply.json()["error"]
        assert error["param"] in params, (body, error)
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), error

    async def complete(self, model: str | None) -> None:
        body: dict[str, Any] = {"prompt": [1, 2, 3], "max_tokens": 1}
        if model is not None:
            body["model"] = model
        streamed = len(self.engine.streamed)
        reply = await self.client.post("/v1/completions", json=body)
        status, lora = self.ref.model(model)
        error = reply.json()["error"]
        assert reply.status_code == status, (model, reply.text)
        if status == 404:
            assert (error["code"], error["param"]) == ("model_not_found", "model"), error
            assert len(self.engine.streamed) == streamed
            return
        assert STUB_REFUSAL in error["message"], error
        ran = self.engine.streamed[-1]
        assert (None if ran is None else (ran.lora_name, ran.lora_path, ran.lora_int_id)) == lora, model

    async def listing(self) -> None:
        pass  # every step lists the models afterwards

    async def retrieve(self, model: str) -> None:
        reply = await self.client.get(f"/v1/models/{model}")
        expected = [card for card in self.ref.cards(self.engine.config.model) if card["id"] == model]
        if not expected:
            error = reply.json()["error"]
            assert (reply.status_code, error["code"]) == (404, "model_not_found"), reply.text
            return
        assert reply.status_code == 200
        self.check_card(reply.json(), expected[0])

    async def check_models(self) -> None:
        reply = await self.client.get("/v1/models")
        body = reply.json()
        assert (reply.status_code, body["object"]) == (200, "list")
        expected = self.ref.cards(self.engine.config.model)
        assert [card["id"] for card in body["data"]] == [card["id"] for card in expected]
        for card, want in zip(body["data"], expected):
            self.check_card(card, want)
        assert self.engine.live == {lora_id for _, _, lora_id in self.ref.loras.values()}  # no id left behind

    def check_card(self, card: dict[str, Any], expected: dict[str, Any]) -> None:
        assert {key: card[key] for key in expected} == expected
        assert set(card) == {*expected, "created", "permission"}, card
        now = int(time.time())
        assert isinstance(card["created"], int) and self.started <= card["created"] <= now
        [permission] = card["permission"]
        assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
        assert {key: permission[key] for key in PERMISSION} == PERMISSION
        assert isinstance(permission["created"], int) and permission["created"] <= now


PERMISSION = {"allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
              "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
              "group": None, "is_blocking": False}


async def run_program(program: list[tuple], paths: dict[str, str]) -> None:
    engine = StandInEngine("/models/base-model")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(envs.ALLOW_RUNTIME_LORA_UPDATING.name, "1")
        app = create_app(engine, model_name=SERVED, manage_engine=False,
                         lora_modules=[LoRAModule(STATIC, paths["good1"], base_model_name="alias")])
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            run = Run(app, engine, paths, client)
            await run.check_models()
            for op in program:
                await run.step(op)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(PROGRAMS)
def test_lora_routes_and_models_follow_the_reference(paths, program) -> None:
    asyncio.run(run_program(program, paths))


# ---------------------------------------------------------------- plain examples
EXAMPLE_PROGRAMS = {
    "an empty name to unload is a 400, as vLLM's": [("unload", "", None), ("unload", "", 1)],
    "load_inplace keeps the place and the parent": [("load", "a", "good2", None), ("load", STATIC, "good2", True),
                                                   ("complete", STATIC), ("load", "a", "good1", "true")],
    "a bad adapter in place leaves the old served": [("load", STATIC, "rank32", True), ("complete", STATIC),
                                                    ("load", STATIC, "missing", True), ("retrieve", STATIC)],
    "unload by name, whatever the id; then 404s": [("unload", STATIC, 12345), ("unload", STATIC, "own"),
                                                  ("complete", STATIC), ("retrieve", STATIC),
                                                  ("load", STATIC, "good1", False), ("complete", STATIC)],
    "served names and duplicates are 400s naming lora_name": [
        ("load", "base", "good1", True), ("load", STATIC, "good1", None), ("load", "", "good1", None),
        ("load", "b", "empty", None), ("load", "b", "other_model", None), ("load", "b", "no_config", None)],
}


@pytest.mark.parametrize("program", EXAMPLE_PROGRAMS.values(), ids=EXAMPLE_PROGRAMS.keys())
def test_examples(paths, program) -> None:
    asyncio.run(run_program(program, paths))
