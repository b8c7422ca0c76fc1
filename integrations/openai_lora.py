"""LoRA adapters served as models of their own (vLLM's ``--lora-modules``), and the runtime adapter routes.

A request whose ``model`` is a module's name runs with that adapter. Each
module gets an id never used before in this server (the workers keep an
adapter's weights under its id, so a name loaded again gets a new one).
With ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING, vLLM's ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter`` change the set while serving.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm import envs
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.integrations.errors import ApiError
from asyncllm.integrations.openai_http import text_response
from asyncllm.integrations.openai_protocol import decode_request
from asyncllm.integrations.starlette import engine_lifespan
from asyncllm.lora import LoRARequest

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["LoRAModule", "LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "ServedLoRA", "LoRAModels",
           "lora_routes", "server_lifespan", "start_server"]

logger = logging.getLogger("asyncllm.integrations.openai")


class LoRAModule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A LoRA adapter served as a model of its own (vLLM's ``--lora-modules``): requests send `name` as ``model``."""

    name: str
    path: str
    """A PEFT LoRA adapter folder or hub id."""
    base_model_name: str | None = None
    """The served model it adapts (its ``parent`` in /v1/models); None: the first served name."""

    @classmethod
    def parse(cls, raw: str) -> LoRAModule:
        """``NAME=PATH``, or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``; `ValueError`
        saying what is wrong."""
        text = raw.strip()
        if text.startswith("{"):
            try:
                module = msgspec.json.decode(text, type=cls)
            except msgspec.DecodeError as exc:  # ValidationError included: a missing or unknown key
                raise ValueError(f"{raw!r}: {exc}") from None
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"{raw!r} is neither NAME=PATH nor a JSON object with name and path")
            module = cls(name.strip(), path.strip())
        for field in ("name", "path", "base_model_name"):
            value = getattr(module, field)
            if value is not None and not value.strip():
                raise ValueError(f"{raw!r}: its {field} is empty")
        return module


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``POST /v1/load_lora_adapter``: serve the adapter at `lora_path` as the model `lora_name`."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """Replace the adapter served as `lora_name` (an RL loop's new weights under the same name): new requests run
    the new one, running ones finish on the old; False: a name already served is a 400."""


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``POST /v1/unload_lora_adapter``: stop serving the model `lora_name`."""

    lora_name: str
    lora_int_id: int | None = None
    """Accepted and not checked, as vLLM's: the adapter is found by its name (ids are the server's own)."""


@dataclass(frozen=True)
class ServedLoRA:
    """A LoRA adapter served under its own model name."""

    request: LoRARequest
    """What requests naming it run with: its name, its id (fixed while served), its path as given."""
    parent: str | None = None
    """The served model it adapts (``base_model_name``); None: the first served name."""


class LoRAModels:
    """The server's LoRA modules by model name, in the order /v1/models lists them."""

    def __init__(self, modules: Sequence[LoRAModule], served_names: list[str]) -> None:
        self.loras: dict[str, ServedLoRA] = {}
        self._next_id = 1
        self._lock = anyio.Lock()
        self.checked = False
        """Whether `check` passed (the app's startup checks the modules once)."""
        for module in modules:
            self.loras[module.name] = ServedLoRA(self._new_request(module.name, module.path), module.base_model_name)
        self.check_names([module.name for module in modules], served_names)  # a shared core's: at startup

    def get(self, model: str) -> LoRARequest | None:
        served = self.loras.get(model)
        return None if served is None else served.request

    async def check(self, engine: AsyncEngine, served_names: list[str]) -> None:
        """Check every module with the (started) engine: a `ConfigError` naming the first bad one, with what
        is wrong (no folder, not a LoRA adapter, another model's shapes, an engine without enable_lora)."""
        self.check_names(list(self.loras), served_names)  # again: a shared core's model is known now
        for name, served in list(self.loras.items()):
            try:
                await engine.add_lora(served.request)
            except InvalidRequestError as exc:
                raise ConfigError("lora_modules", f"{name}={served.request.lora_path}", exc.message) from None
        self.checked = True

    def check_names(self, names: list[str], served: list[str]) -> None:
        """`ConfigError` for a module name given twice or equal to a `served` model name, or a base_model_name
        that is not one (no `served` names: not known yet, checked at startup)."""
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError("lora_modules", name, "two LoRA modules have this name")
            if name in served:
                raise ConfigError("lora_modules", name, f"it is a served model name ({served}); name the adapter "
                                                        "otherwise")
            parent = self.loras[name].parent
            if served and parent is not None and parent not in served:
                raise ConfigError("lora_modules", name, f"its base_model_name {parent!r} is not a served model "
                                                        f"name ({served})")

    async def load(self, engine: AsyncEngine, req: LoadLoRAAdapterRequest, served_names: list[str]) -> LoRARequest:
        """Serve the adapter at ``lora_path`` as ``lora_name``, checked first (a bad adapter, or a name already
        served without ``load_inplace``, is an `InvalidRequestError`). ``load_inplace`` replaces a served adapter
        of that name as an unload and a load would: a new id, so the workers read the folder again (the old
        adapter stays served until the new one passed its check, then its id is removed from the engine)."""
        if not req.lora_name.strip():
            raise InvalidRequestError("lora_name", "must not be empty")
        async with self._lock:
            replaced = self.loras.get(req.lora_name) if req.load_inplace else None
            if req.lora_name in served_names or (req.lora_name in self.loras and replaced is None):
                raise InvalidRequestError("lora_name", f"the model {req.lora_name!r} is already served (unload the "
                                                       "adapter first, or load it with load_inplace, to replace it)")
            lora = self._new_request(req.lora_name, req.lora_path)
            try:
                await engine.add_lora(lora)
            except InvalidRequestError as exc:
                raise InvalidRequestError("lora_path", exc.message, code=exc.code) from None
            self.loras[req.lora_name] = ServedLoRA(lora, None if replaced is None else replaced.parent)
            if replaced is not None:
                await engine.remove_lora(replaced.request.lora_int_id)
        return lora

    async def unload(self, engine: AsyncEngine, req: UnloadLoRAAdapterRequest) -> None:
        """Stop serving ``lora_name`` (a 404 if no adapter has that name) and remove its id from the engine
        (`AsyncEngine.remove_lora`); requests running with it finish with it. An empty name is a 400, as vLLM's."""
        if not req.lora_name:
            raise InvalidRequestError("lora_name", "must not be empty")
        async with self._lock:
            served = self.loras.pop(req.lora_name, None)
            if served is None:
                raise ApiError(404, f"the LoRA adapter {req.lora_name!r} cannot be found; loaded: {list(self.loras)}",
                               "not_found_error", param="lora_name", code="model_not_found")
            await engine.remove_lora(served.request.lora_int_id)

    def _new_request(self, name: str, path: str) -> LoRARequest:
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request


def lora_routes(server: OpenAIServer) -> list[Route]:
    """vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` over the server's `LoRAModels`, each
    wrapped in its error mapping `guard` (the API key is checked before routing: openai_auth.py's `ApiKeyGate`);
    answered in plain text, as vLLM's."""
    logger.warning("runtime LoRA updating is on (%s): API clients may load adapters from this server's "
                   "disk or the hub; serve trusted clients only", envs.ALLOW_RUNTIME_LORA_UPDATING.name)

    async def load(request: Request) -> Response:
        """Serve the adapter at ``lora_path`` as the model ``lora_name``."""
        req = decode_request(await server._body(request), LoadLoRAAdapterRequest)
        lora = await server.loras.load(server.engine, req, server.model_names)
        logger.info("loaded LoRA adapter %r from %s (id %d)", lora.lora_name, lora.lora_path, lora.lora_int_id)
        return text_response(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        """Stop serving the model ``lora_name`` (404 if no adapter has that name)."""
        req = decode_request(await server._body(request), UnloadLoRAAdapterRequest)
        await server.loras.unload(server.engine, req)
        logger.info("unloaded LoRA adapter %r", req.lora_name)
        return text_response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return [Route("/v1/load_lora_adapter", server._guarded(load), methods=["POST"]),
            Route("/v1/unload_lora_adapter", server._guarded(unload), methods=["POST"])]


def server_lifespan(server: OpenAIServer, manage_engine: bool) -> Any:
    """The app's lifespan: the engine's (`manage_engine`), with the LoRA modules checked at startup (the engine
    started, `ConfigError` naming the first bad one; a failed check closes a managed engine); None: neither."""
    engine_life = engine_lifespan(server.engine) if manage_engine else None
    if not server.loras.loras:
        return engine_life

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[dict[str, Any] | None]:
        if engine_life is None:
            await start_server(server)
            yield None
            return
        async with engine_life(app) as state:
            await start_server(server)
            yield state

    return lifespan


async def start_server(server: OpenAIServer) -> None:
    """The app's startup: the engine started, the LoRA modules checked with it, once (`asyncllm serve` runs it before
    the server starts, so a bad module is one line and exit 2; the lifespan's run then finds it done)."""
    await server.engine.start()
    if not server.loras.checked:
        await server.loras.check(server.engine, server.model_names)
