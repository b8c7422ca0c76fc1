"""Property: the Responses API store (integrations/responses_store.py) behaves as a plain LRU of the documented entries.

The model, written from the module's docstring and docs/integrations/openai-server.md's "Stored responses": an
``OrderedDict`` of response id -> (body, conversation), oldest first, where

- the store is off unless enabled (ASYNCLLM_ENABLE_RESPONSES_API_STORE=1): off, ``store`` is answered ``false``,
  nothing is kept and every id is a 404 whose message names the variable;
- on, a response is kept unless its request says ``store: false``; at most ``max_entries`` are kept, and storing,
  retrieving or continuing a response makes it the most recent (the least recent goes first past the bound);
- a kept response is its body and its conversation: the input items of every turn up to it (a string ``input`` is
  one user message) and the output items of the earlier turns between them;
- a follow-up (``previous_response_id``) runs that conversation, then the previous response's output items, then its
  own ``input``: the same chat as sending the whole conversation as ``input`` with the follow-up's own
  ``instructions`` (the previous ones are not carried over); the conversation is read when the request starts, so
  an eviction before it finishes changes nothing;
- the items are shared, never copied or changed: the same object in every response of a conversation;
- an unknown, evicted, deleted, unstored or never-existing id is a 404 (``invalid_request_error``,
  ``response_not_found``, ``param`` ``previous_response_id`` for a follow-up, ``response_id`` for the routes); an
  empty ``previous_response_id`` is a 400; ``DELETE`` forgets a response; ``/cancel`` of a kept one is a 400
  (background responses are not built); there is no input-items route.

`test_store_follows_the_lru_model` drives the store's own API (`ResponseStore.begin` -> `Turn.keep`, `get`,
`delete`) with drawn operations; after each it compares the kept ids, the bound, each retrieval's body, each
follow-up's assembled items (equal, and identical objects) and chat messages, and the 404s; at the end it checks the
LRU order by storing fresh responses one at a time (each evicts the model's oldest) and that no item was changed.
`test_http_turns_follow_the_model` runs a few drawn turn sequences through the real app over HTTP (the bundled
engine, one output token): the chat each follow-up ran (recorded at `OpenAIServer._start_chat`), the bodies
retrieved against those answered, the evictions, deletes and cancels, and the error bodies.

RESPONSES_STORE_NO_SHRINK=1 selects a profile without shrinking (for mutation runs).
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import pytest
from asgi_helpers import asgi_client
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from asyncllm import envs
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.errors import ApiError
from asyncllm.integrations.openai_server import OpenAIServer, create_app
from asyncllm.integrations.responses_api import ResponsesRequest, chat_request
from asyncllm.integrations.responses_store import ResponseStore, StoredResponse

on_session_loop = pytest.mark.asyncio(loop_scope="session")  # the shared engine's loop (conftest.py)

settings.register_profile("responses_store_mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("RESPONSES_STORE_NO_SHRINK"):
    settings.load_profile("responses_store_mutations")

MODEL = "asyncllm-tiny"
NEVER = "resp_never_stored"
ENV_NAME = envs.ENABLE_RESPONSES_API_STORE.name

# ---------------------------------------------------------------- drawn items and operations
TEXT = st.text(alphabet="ab ", max_size=3)
USER_ITEM = st.one_of(
    st.builds(lambda t: {"type": "message", "role": "user", "content": t}, TEXT),
    st.builds(lambda t: {"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]}, TEXT),
    st.builds(lambda t: {"role": "developer", "content": t}, TEXT),
    st.builds(lambda t: {"type": "function_call_output", "call_id": "call_1", "output": t}, TEXT),
)
OUTPUT_ITEM = st.one_of(
    st.builds(lambda t: {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                         "content": [{"type": "output_text", "text": t, "annotations": []}]}, TEXT),
    st.builds(lambda t: {"type": "reasoning", "id": "rs_1", "summary": [],
                         "content": [{"type": "reasoning_text", "text": t}]}, TEXT),
    st.builds(lambda t: {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
                         "arguments": t, "status": "completed"}, TEXT),
)
INPUT = st.one_of(TEXT, st.lists(st.one_of(USER_ITEM, USER_ITEM, OUTPUT_ITEM), max_size=3))
INSTRUCTIONS = st.one_of(st.none(), st.sampled_from(["Be brief.", "Answer in French."]))
STORE_FLAG = st.sampled_from([None, True, False])
PREVIOUS = st.one_of(st.none(), st.integers(0, 7), st.sampled_from(["never", "empty"]))
"""No previous response, the i-th id made so far (kept, evicted, deleted or unstored), an id never made, ''."""
REF = st.one_of(st.integers(0, 7), st.just("never"))

CREATE = st.tuples(st.just("create"), INPUT, INSTRUCTIONS, STORE_FLAG, PREVIOUS,
                   st.lists(OUTPUT_ITEM, max_size=3), st.sampled_from(["completed", "incomplete", "cancelled"]),
                   st.sampled_from(["now", "now", "later", "never"]))
"""``later``: the turn finishes at a later ``finish`` operation; ``never``: it fails, nothing is kept."""
OPERATION = st.one_of(CREATE, CREATE, st.tuples(st.just("finish"), st.integers(0, 3)),
                      st.tuples(st.just("retrieve"), REF), st.tuples(st.just("delete"), REF))
CASE = st.tuples(st.booleans() | st.just(True), st.integers(1, 4), st.lists(OPERATION, max_size=14))


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


# ---------------------------------------------------------------- the model
class Slot:
    """One conversation item as the model knows it: its value, and the object once the store showed it (a drawn
    list item is known from the start; a string ``input``'s user message when a follow-up first shows it)."""

    def __init__(self, value: dict[str, Any], obj: dict[str, Any] | None = None) -> None:
        self.value, self.obj = value, obj

    def check(self, seen: Any, where: str) -> None:
        assert seen == self.value, (where, seen, self.value)
        if self.obj is None:
            self.obj = seen
        assert seen is self.obj, f"{where}: an item was copied, not shared"


@dataclass
class Entry:
    body: dict[str, Any]
    conversation: list[Slot]


@dataclass
class Model:
    enabled: bool
    max_entries: int
    entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)

    def touch(self, response_id: str) -> Entry | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def keep(self, response_id: str, entry: Entry) -> None:
        self.entries[response_id] = entry
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


@dataclass
class Pending:
    """A turn begun and not finished: what it will keep."""

    turn: Any
    body: dict[str, Any]
    conversation: list[Slot]
    kept: bool


def _check_not_found(error: ApiError, response_id: str, param: str, enabled: bool) -> None:
    """OpenAI's 404 for an unknown response; off, the message says how to turn the store on."""
    assert (error.status, error.type, error.code, error.param) == (404, "invalid_request_error",
                                                                   "response_not_found", param)
    assert f"'{response_id}'" in error.message
    assert enabled or ENV_NAME in error.message


def _check_kept_ids(store: ResponseStore, model: Model, made: list[str]) -> None:
    """The same ids kept (every id made, and one never made), never more than the bound."""
    assert len(store) == len(model.entries) <= model.max_entries
    assert [i for i in [*made, NEVER] if i in store] == [i for i in made if i in model.entries]


class Run:
    """One drawn case against a store and the model."""

    def __init__(self, enabled: bool, max_entries: int) -> None:
        self.store = ResponseStore(max_entries, enabled=enabled)
        self.model = Model(enabled, max_entries)
        self.made: list[str] = []
        self.pending: list[Pending] = []
        self.drawn: list[tuple[Any, Any]] = []  # (object, a deep copy when drawn): never changed

    def ref(self, drawn: Any) -> str:
        if drawn == "never" or not self.made:
            return NEVER
        return "" if drawn == "empty" else self.made[drawn % len(self.made)]

    def create(self, text_or_items, instructions, store_flag, previous, output, status, finish) -> None:
        """`begin` -> the assembled history and chat checked; `keep` now, later or never."""
        previous_id = None if previous is None else self.ref(previous)
        req = ResponsesRequest(model=MODEL, input=text_or_items, instructions=instructions, store=store_flag,
                               previous_response_id=previous_id, max_output_tokens=1)
        self.drawn += [(text_or_items, copy.deepcopy(text_or_items)), (output, copy.deepcopy(output))]
        history: list[Slot] = []
        if previous_id == "":
            with pytest.raises(InvalidRequestError) as refused:
                self.store.begin(req)
            assert refused.value.field == "previous_response_id"
            return
        if previous_id is not None:
            entry = self.model.touch(previous_id)
            if entry is None:
                with pytest.raises(ApiError) as missing:
                    self.store.begin(req)
                _check_not_found(missing.value, previous_id, "previous_response_id", self.model.enabled)
                return
            history = [*entry.conversation, *(Slot(item, item) for item in entry.body["output"])]
        turn = self.store.begin(req)
        self._check_turn(turn, req, history)
        own = ([Slot(_user(text_or_items))] if isinstance(text_or_items, str)
               else [Slot(item, item) for item in text_or_items])
        response_id = f"resp_{len(self.made)}"
        self.made.append(response_id)
        body = {"id": response_id, "object": "response", "status": status, "output": output,
                "instructions": instructions, "store": turn.req.store, "previous_response_id": previous_id}
        kept = self.model.enabled and store_flag is not False
        job = Pending(turn, body, [*history, *own], kept)
        if finish == "now":
            self.finish(job)
        elif finish == "later":
            self.pending.append(job)

    def _check_turn(self, turn, req: ResponsesRequest, history: list[Slot]) -> None:
        """The effective ``store``; the history (items equal and shared); the chat: the whole conversation as input
        with the follow-up's own instructions only."""
        assert turn.req.store is (self.model.enabled and req.store is not False)
        assert (turn.req.previous_response_id, turn.req.instructions) == (req.previous_response_id, req.instructions)
        assert len(turn.history) == len(history), (turn.history, [s.value for s in history])
        for i, (seen, slot) in enumerate(zip(turn.history, history)):
            slot.check(seen, f"history item {i}")
        whole = ResponsesRequest(model=MODEL, input=[*[s.value for s in history], *_items(req.input)],
                                 instructions=req.instructions, max_output_tokens=1)
        assert turn.chat_request().messages == chat_request(whole).messages

    def finish(self, job: Pending) -> None:
        """`keep` answers the body; kept (on, and not ``store: false``) it is the most recent."""
        assert job.turn.keep(job.body) is job.body
        if job.kept:
            self.model.keep(job.body["id"], Entry(job.body, job.conversation))
            self.drawn.append((job.body, copy.deepcopy(job.body)))

    def finish_pending(self, index: int) -> None:
        if self.pending:
            self.finish(self.pending.pop(index % len(self.pending)))

    def retrieve(self, drawn: Any) -> None:
        response_id = self.ref(drawn)
        entry = self.model.touch(response_id)
        if entry is None:
            with pytest.raises(ApiError) as missing:
                self.store.get(response_id)
            _check_not_found(missing.value, response_id, "response_id", self.model.enabled)
            return
        got = self.store.get(response_id)
        assert got.body == entry.body
        for i, (seen, slot) in enumerate(zip(got.items, entry.conversation, strict=True)):
            slot.check(seen, f"kept item {i}")

    def delete(self, drawn: Any) -> None:
        response_id = self.ref(drawn)
        if self.model.entries.pop(response_id, None) is None:
            with pytest.raises(ApiError) as missing:
                self.store.delete(response_id)
            _check_not_found(missing.value, response_id, "response_id", self.model.enabled)
        else:
            self.store.delete(response_id)

    def check_lru_order(self) -> None:
        """Fresh responses stored (`put`) one at a time each evict the model's least recent, until none of the
        earlier ones is left (their order, as evictions show it)."""
        for n in range(self.model.max_entries):
            fresh = f"resp_fresh_{n}"
            self.store.put(StoredResponse({"id": fresh, "status": "completed", "output": []}, ()))  # off: nothing
            if self.model.enabled:
                self.model.keep(fresh, Entry({}, []))
                self.made.append(fresh)
            _check_kept_ids(self.store, self.model, self.made)

    def check_unchanged(self) -> None:
        for obj, snapshot in self.drawn:
            assert obj == snapshot, "an item or body was changed"


def _items(text_or_items: Any) -> list[dict[str, Any]]:
    """The docs' ``input`` as items: a string is one user message."""
    return [_user(text_or_items)] if isinstance(text_or_items, str) else list(text_or_items)


def _run(enabled: bool, max_entries: int, operations: list[tuple]) -> None:
    run = Run(enabled, max_entries)
    for operation in operations:
        kind, *args = operation
        if kind == "create":
            run.create(*args)
        elif kind == "finish":
            run.finish_pending(*args)
        else:
            getattr(run, kind)(*args)
        _check_kept_ids(run.store, run.model, run.made)
    run.check_lru_order()
    run.check_unchanged()


def _create(input_="x", previous=None, *, instructions=None, store=None, output=None, finish="now"):
    """An explicit create operation (`output`: one assistant message by default)."""
    output = [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "ok", "annotations": []}]}] if output is None else output
    return ("create", input_, instructions, store, previous, output, "completed", finish)


ITEMS = [{"type": "message", "role": "user", "content": "a"},
         {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]}]


@settings(max_examples=1000, deadline=None)
@given(case=CASE)
# retrieving makes A the most recent: C evicts B, and continuing B is a 404
@example(case=(True, 2, [_create(), _create(), ("retrieve", 0), _create(), _create("y", 1)]))
# continuing makes A the most recent, even when that follow-up fails (C evicts B, not A)
@example(case=(True, 2, [_create(), _create(), _create("y", 0, finish="never"), _create(), ("retrieve", 0)]))
# a three-turn chain: every earlier input and output, in order; the first turn's instructions not carried
@example(case=(True, 4, [_create(ITEMS, instructions="Be brief."), _create("b", 0), _create([ITEMS[0]], 1)]))
# deleted: retrieve, continue and delete again are 404s
@example(case=(True, 3, [_create(), ("delete", 0), ("retrieve", 0), _create("y", 0), ("delete", 0)]))
# store off: store true is answered false, nothing kept, every id a 404 naming the variable
@example(case=(False, 2, [_create(store=True), ("retrieve", 0), _create("y", 0), ("delete", 0)]))
# store false: not kept, its follow-up a 404; an id never made and '' refused
@example(case=(True, 2, [_create(store=False), _create("y", 0), _create("z", "never"), _create("z", "empty")]))
# an eviction while a follow-up runs changes nothing: B keeps A's conversation once A is gone
@example(case=(True, 2, [_create(ITEMS), _create("b", 0, finish="later"), _create(), _create(), ("finish", 0),
                         _create("c", 1)]))
# branches: two follow-ups of one response share its items; the bound 1 keeps only the newest
@example(case=(True, 1, [_create(ITEMS), _create("b", 0), _create("c", 0)]))
@example(case=(True, 3, [_create(ITEMS), _create("b", 0), _create("c", 0), _create("d", 1), _create("e", 2)]))
# a string input's user message is one object in every later turn
@example(case=(True, 4, [_create("a"), _create("b", 0), _create("c", 1), _create("d", 1), ("retrieve", 0)]))
def test_store_follows_the_lru_model(case) -> None:
    """The store's own API against the model, after every operation (the module docstring lists what is checked)."""
    _run(*case)


# ---------------------------------------------------------------- over HTTP, through the real app
HTTP_OPERATION = st.one_of(
    st.tuples(st.just("create"), st.sampled_from(["def f(", "x = 1", "hi"]), INSTRUCTIONS, STORE_FLAG,
              st.one_of(st.none(), st.integers(0, 5), st.just("never")), st.booleans()),
    st.tuples(st.sampled_from(["retrieve", "delete", "cancel"]), REF),
)
HTTP_CASE = st.tuples(st.booleans() | st.just(True), st.integers(1, 3), st.lists(HTTP_OPERATION, min_size=1,
                                                                                  max_size=5))


def _answered(reply) -> dict[str, Any]:
    """The body answered: the JSON, or a stream's last ``response.completed`` / ``response.incomplete`` response."""
    if not reply.headers["content-type"].startswith("text/event-stream"):
        return reply.json()
    payloads = [json.loads(line[6:]) for line in reply.text.split("\n") if line.startswith("data: {")]
    assert payloads[-1]["type"] in ("response.completed", "response.incomplete"), payloads[-1]
    return payloads[-1]["response"]


def _check_http_not_found(reply, response_id: str, param: str, enabled: bool) -> None:
    """OpenAI's 404 body ``{"error": {"message", "type", "param", "code"}}``."""
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "response_not_found", param)
    assert response_id in error["message"] and (enabled or ENV_NAME in error["message"])


class HttpRun:
    """A drawn turn sequence against the app; the model keeps (answered body, conversation items as JSON)."""

    def __init__(self, http, chats: list, enabled: bool, max_entries: int) -> None:
        self.http, self.chats = http, chats
        self.model = Model(enabled, max_entries)
        self.made: list[str] = []

    def ref(self, drawn: Any) -> str:
        return NEVER if drawn == "never" or not self.made else self.made[drawn % len(self.made)]

    async def create(self, text: str, instructions, store_flag, previous, stream: bool) -> None:
        previous_id = None if previous is None else self.ref(previous)
        body = {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 1, "stream": stream,
                **({} if instructions is None else {"instructions": instructions}),
                **({} if store_flag is None else {"store": store_flag}),
                **({} if previous_id is None else {"previous_response_id": previous_id})}
        self.chats.clear()
        reply = await self.http.post("/v1/responses", json=body)
        entry = None if previous_id is None else self.model.touch(previous_id)
        if previous_id is not None and entry is None:
            _check_http_not_found(reply, previous_id, "previous_response_id", self.model.enabled)
            assert self.chats == []  # refused before the engine
            return
        assert reply.status_code == 200, reply.text
        answered = _answered(reply)
        history = [] if entry is None else [*entry.conversation, *entry.body["output"]]
        whole = ResponsesRequest(model=MODEL, input=[*history, _user(text)], instructions=instructions,
                                 max_output_tokens=1)
        (ran,) = self.chats
        assert ran.messages == chat_request(whole).messages  # the docs' conversation, own instructions only
        kept = self.model.enabled and store_flag is not False
        assert (answered["store"], answered["previous_response_id"]) == (kept, previous_id)
        self.made.append(answered["id"])
        if kept:
            self.model.keep(answered["id"], Entry(answered, [*history, _user(text)]))

    async def retrieve(self, drawn: Any) -> None:
        response_id = self.ref(drawn)
        reply = await self.http.get(f"/v1/responses/{response_id}")
        entry = self.model.touch(response_id)
        if entry is None:
            _check_http_not_found(reply, response_id, "response_id", self.model.enabled)
        else:
            assert (reply.status_code, reply.json()) == (200, entry.body)

    async def delete(self, drawn: Any) -> None:
        response_id = self.ref(drawn)
        reply = await self.http.delete(f"/v1/responses/{response_id}")
        if self.model.entries.pop(response_id, None) is None:
            _check_http_not_found(reply, response_id, "response_id", self.model.enabled)
        else:
            assert reply.json() == {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, drawn: Any) -> None:
        """A kept response is finished: a 400 naming ``response_id`` (background responses are not built)."""
        response_id = self.ref(drawn)
        reply = await self.http.post(f"/v1/responses/{response_id}/cancel")
        if self.model.touch(response_id) is None:
            _check_http_not_found(reply, response_id, "response_id", self.model.enabled)
        else:
            assert (reply.status_code, reply.json()["error"]["param"]) == (400, "response_id"), reply.text


@pytest.fixture
def recorded_chats(monkeypatch) -> list:
    """The chat requests `OpenAIServer._start_chat` ran (what the engine was asked)."""
    chats: list = []
    start_chat = OpenAIServer._start_chat

    def recording(self, req, *args, **kwargs):
        chats.append(req)
        return start_chat(self, req, *args, **kwargs)

    monkeypatch.setattr(OpenAIServer, "_start_chat", recording)
    return chats


@on_session_loop
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=HTTP_CASE)
# a chain (instructions on the first turn only), an eviction by the bound 2, retrievals, a cancel
@example(case=(True, 2, [("create", "def f(", "Be brief.", None, None, False),
                         ("create", "x = 1", None, True, 0, True), ("create", "hi", None, None, 1, False),
                         ("retrieve", 0), ("retrieve", 2), ("cancel", 1)]))
# retrieving over HTTP makes A the most recent: C evicts B; deleting A answers the deleted object, then a 404
@example(case=(True, 2, [("create", "hi", None, None, None, False), ("create", "x = 1", None, None, None, True),
                         ("retrieve", 0), ("create", "def f(", None, None, None, False), ("retrieve", 1),
                         ("delete", 0), ("retrieve", 0)]))
# store off: answered store false, everything a 404 naming the variable
@example(case=(False, 2, [("create", "hi", None, True, None, False), ("create", "hi", None, None, 0, False),
                          ("retrieve", 0), ("cancel", 0), ("delete", 0)]))
async def test_http_turns_follow_the_model(bundled_engine, monkeypatch, recorded_chats, case) -> None:
    """The real app over HTTP against the model: the chat each follow-up ran, the bodies retrieved, the 404s."""
    enabled, max_entries, operations = case
    monkeypatch.setenv(ENV_NAME, "1" if enabled else "0")
    monkeypatch.setenv(envs.RESPONSES_API_STORE_MAX_ENTRIES.name, str(max_entries))
    app = create_app(bundled_engine, manage_engine=False)
    async with asgi_client(app) as http:
        run = HttpRun(http, recorded_chats, enabled, max_entries)
        for kind, *args in operations:
            await getattr(run, kind)(*args)
            store = app.state.openai_server.responses_store
            assert len(store) == len(run.model.entries) <= max_entries
            assert [i for i in run.made if i in store] == [i for i in run.made if i in run.model.entries]
        if run.made:
            assert (await http.get(f"/v1/responses/{run.made[0]}/input_items")).status_code == 404
