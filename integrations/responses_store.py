"""Stored responses of the Responses API: ``store``, ``previous_response_id`` and the ``/v1/responses/{id}`` routes.

As vLLM's (``VLLM_ENABLE_RESPONSES_API_STORE``), the store is off unless the
server starts with ASYNCLLM_ENABLE_RESPONSES_API_STORE=1. Off, ``store`` is
accepted and answered ``false``, nothing is kept, and a ``previous_response_id``
or a retrieval is a 404. On, every response made without ``store: false`` is kept
in this process's memory, at most ASYNCLLM_RESPONSES_API_STORE_MAX_ENTRIES of
them (least recently used first out: storing, retrieving or continuing a
response makes it the most recent).

A kept response is its body (what ``POST /v1/responses`` answered, which
``GET /v1/responses/{id}`` returns) and its conversation: the input items of
every turn up to it, the outputs of the earlier turns between them. A request
with ``previous_response_id`` runs that conversation, then the previous
response's output items, then its own ``input`` (OpenAI's definition: the
output items are input items; the previous ``instructions`` are not carried
over). The items are shared, never copied or changed, between the responses of
one conversation, so a chain of turns costs one reference per item per turn.

One store per server process (per app): several host processes behind one
address each have their own, so a follow-up must reach the process that kept
its previous response (sticky routing), as with vLLM. The store is guarded by a
lock (requests on the event loop, and threads), and a request takes its
previous conversation when it starts: an eviction while it runs changes nothing.
``background`` responses are not built, so there is nothing to cancel:
``POST /v1/responses/{id}/cancel`` of a kept response is vLLM's 400.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm import envs
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.errors import ApiError
from asyncllm.integrations.openai_http import json_response
from asyncllm.integrations.openai_protocol import ChatCompletionRequest
from asyncllm.integrations.responses_api import ResponsesRequest, chat_request, check_request, input_items

__all__ = ["ResponseStore", "StoredResponse", "Turn", "DEFAULT_MAX_ENTRIES"]

logger = logging.getLogger("asyncllm.integrations.openai")

DEFAULT_MAX_ENTRIES = envs.RESPONSES_API_STORE_MAX_ENTRIES.default


@dataclass(frozen=True)
class StoredResponse:
    """A kept response: its body and the input items of its conversation (everything before its output)."""

    body: dict[str, Any]
    items: tuple[dict[str, Any], ...]

    def history(self) -> tuple[dict[str, Any], ...]:
        """The items a follow-up runs before its own input: the conversation, then this response's output."""
        return self.items + tuple(self.body["output"])


@dataclass
class Turn:
    """One ``POST /v1/responses`` against the store: the request (``store`` made the effective flag), the items
    before its input (from ``previous_response_id``), and `keep` for its finished body."""

    req: ResponsesRequest
    history: tuple[dict[str, Any], ...] = ()
    target: ResponseStore | None = field(default=None, repr=False)

    def chat_request(self, auto_tools: bool = True) -> ChatCompletionRequest:
        """The chat this turn runs (`auto_tools`: the server has a tool-call parser; `responses_api.chat_request`)."""
        return chat_request(self.req, self.history, auto_tools)

    def keep(self, body: dict[str, Any]) -> dict[str, Any]:
        """Store a finished response (when ``store`` is on for it); returns `body`."""
        if self.req.store and self.target is not None:
            self.target.put(StoredResponse(body, (*self.history, *input_items(self.req.input))))
        return body


class ResponseStore:
    """Kept responses by id, least recently used first out; `enabled` False keeps nothing (every id unknown)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, enabled: bool = True) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.enabled = enabled
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> ResponseStore:
        """ASYNCLLM_ENABLE_RESPONSES_API_STORE and ASYNCLLM_RESPONSES_API_STORE_MAX_ENTRIES (read when the app is
        made)."""
        enabled = envs.ENABLE_RESPONSES_API_STORE.get()
        store = cls(envs.RESPONSES_API_STORE_MAX_ENTRIES.get(), enabled=enabled)
        if enabled:
            logger.info("Responses API store on: up to %d responses kept in this process's memory", store.max_entries)
        return store

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, response: StoredResponse) -> None:
        """Keep `response` as the most recent, dropping the least recently used past `max_entries`."""
        if not self.enabled:
            return
        with self._lock:
            self._entries[response.body["id"]] = response
            self._entries.move_to_end(response.body["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The kept response (now the most recent); a 404 naming `param` when unknown, evicted or never stored."""
        with self._lock:
            response = self._entries.get(response_id)
            if response is not None:
                self._entries.move_to_end(response_id)
        if response is None:
            raise self._not_found(response_id, param)
        return response

    def delete(self, response_id: str) -> None:
        with self._lock:
            found = self._entries.pop(response_id, None)
        if found is None:
            raise self._not_found(response_id, "response_id")

    def begin(self, req: ResponsesRequest) -> Turn:
        """A request's turn: the fields not built refused (`check_request`), ``store`` resolved (on unless ``false``,
        and only with the store enabled) and its ``previous_response_id`` looked up (404 when unknown)."""
        check_request(req)
        if req.previous_response_id is not None and not req.previous_response_id:
            raise InvalidRequestError("previous_response_id", "must be the id of a stored response, got ''")
        history = () if req.previous_response_id is None else self.get(req.previous_response_id,
                                                                         "previous_response_id").history()
        req = msgspec.structs.replace(req, store=self.enabled and req.store is not False)
        return Turn(req, history, self)

    def _not_found(self, response_id: str, param: str) -> ApiError:
        why = "" if self.enabled else (": this server stores no responses (start it with "
                                       f"{envs.ENABLE_RESPONSES_API_STORE.name}=1 to keep them)")
        return ApiError(404, f"Response with id '{response_id}' not found{why}.", "invalid_request_error",
                        param=param, code="response_not_found")

    # ------------------------------------------------------------ routes
    def routes(self, guard: Callable[[Any], Any]) -> Sequence[Route]:
        """``GET``/``DELETE /v1/responses/{response_id}`` and ``POST /v1/responses/{response_id}/cancel``, each
        wrapped in `guard` (the server's error mapping; the API key is checked before routing: openai_auth.py's
        `ApiKeyGate`)."""
        return [Route("/v1/responses/{response_id}", guard(self._retrieve_or_delete), methods=["GET", "DELETE"]),
                Route("/v1/responses/{response_id}/cancel", guard(self._cancel), methods=["POST"])]

    async def _retrieve_or_delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            self.delete(response_id)
            return json_response({"id": response_id, "object": "response", "deleted": True})
        query = request.query_params
        if query.get("stream", "false").lower() not in ("false", "0"):
            raise InvalidRequestError("stream", "streaming a stored response is for background responses, "
                                                "which are not built")
        if query.get("include") or query.get("include[]"):
            raise InvalidRequestError("include", "extra output data is not built")
        return json_response(self.get(response_id).body)

    async def _cancel(self, request: Request) -> Response:
        response = self.get(request.path_params["response_id"])
        raise InvalidRequestError("response_id", f"Cannot cancel a synchronous response (its status is "
                                                 f"{response.body['status']!r}); only background responses "
                                                 "can be cancelled, and they are not built")
