"""`check_add_request` and its helpers: what the engine core refuses in a decoded `AddRequest` that a host would
have refused or filled in (a peer that is not our host, `AsyncEngine.connect`, skips those steps); the core's request
ids and adapter ids, driven through `EngineCore._handle` without workers."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from asyncllm import InvalidRequestError, SamplingParams, StructuredOutputs, protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.client_liveness import ClientLiveness
from asyncllm.engine.core import EngineCore
from asyncllm.engine.lora_ids import HostLoRAIds
from asyncllm.engine.request_keys import request_key
from asyncllm.engine.sample_groups import SampleGroups
from asyncllm.engine.validation import check_add_request, served_tasks
from asyncllm.lora import LoRARequest
from asyncllm.pooling import PoolingParams
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler
from asyncllm.sched.step_outputs import StepOutputs
from asyncllm.structured.manager import StructuredOutputManager

VOCAB = 512
GENERATES = frozenset({"generate", "embed"})
R = request_key(b"h", "r")
"""The core's key of host b"h"'s request "r" (asyncllm/engine/request_keys.py)."""


def _message(**fields: Any) -> protocol.AddRequest:
    params = SamplingParams(**fields.pop("params", {}))
    return msgspec.structs.replace(protocol.AddRequest("r", [1, 2, 3], params, [2], time.time()), **fields)


@pytest.mark.parametrize(("field", "fields", "tasks"), [
    ("n", {"params": {"n": 2}}, None),  # the host sends each sample as its own request: the core would run one
    ("bad_words", {"params": {"bad_words": ["hello"]}}, None),  # the ids the workers ban come from the host
    ("allowed_token_ids", {"params": {"allowed_token_ids": [5], "bad_words_token_ids": [[5]]}}, None),
    ("allowed_token_ids", {"params": {"allowed_token_ids": [2, 7], "stop_token_ids": [7], "min_tokens": 1}}, None),
    ("allowed_token_ids", {"params": {"allowed_token_ids": [2, 7], "stop_token_ids": [7], "min_tokens": 1,
                                      "ignore_eos": True}}, None),  # min_tokens masks EOS with ignore_eos too (vLLM)
    ("lora_request", {"lora": LoRARequest("a", 0, "/adapter")}, None),  # id 0 is the base model's
    ("lora_request", {"lora": LoRARequest("", 1, "/adapter")}, None),
    ("pooling_type", {"pooling": PoolingParams(pooling_type="MAX"), "params": {"max_tokens": 1}}, None),
    ("max_tokens", {"pooling": PoolingParams()}, None),  # a host's embed and classify sample one token
    ("model", {"pooling": PoolingParams(task="classify"), "params": {"max_tokens": 1}}, GENERATES),  # no score head
    ("model", {"pooling": PoolingParams(), "params": {"max_tokens": 1}}, frozenset({"classify"})),
    ("prompt", {}, frozenset({"embed"})),  # no LM head
])
def test_what_only_a_host_checks_names_its_field(field: str, fields: dict, tasks: frozenset[str] | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_add_request(_message(**fields), VOCAB, tasks=tasks)
    assert info.value.field == field


@pytest.mark.parametrize("fields", [
    {},
    {"params": {"bad_words": ["hello"], "bad_words_token_ids": [[7], [9, 10]]}},
    {"params": {"allowed_token_ids": [2, 5], "stop_token_ids": [7], "min_tokens": 1, "ignore_eos": True}},
    {"params": {"allowed_token_ids": [2, 7], "stop_token_ids": [7]}},  # no min_tokens: EOS and 7 may end it
    {"pooling": PoolingParams(), "params": {"max_tokens": 1}, "lora": LoRARequest("a", 1, "/adapter")},
])
def test_what_a_host_sends_passes(fields: dict) -> None:
    check_add_request(_message(**fields), VOCAB, tasks=GENERATES)


def test_token_embed_goes_where_embed_does() -> None:
    """A per-token embedding (``token_embed``, ALL pooling) is served by a model that embeds, refused by a
    classifier's core; ``token_classify`` by a classifier's only (a worker without a score head would fail)."""
    message = _message(pooling=PoolingParams(task="token_embed", pooling_type="ALL"), params={"max_tokens": 1})
    check_add_request(message, VOCAB, tasks=GENERATES)
    check_add_request(message, VOCAB, tasks=frozenset({"embed"}))
    with pytest.raises(InvalidRequestError, match="not token_embed") as info:
        check_add_request(message, VOCAB, tasks=frozenset({"classify"}))
    assert info.value.field == "model"
    per_token = _message(pooling=PoolingParams(task="token_classify", pooling_type="ALL"), params={"max_tokens": 1})
    check_add_request(per_token, VOCAB, tasks=frozenset({"classify"}))  # token_classify: where classify goes
    with pytest.raises(InvalidRequestError, match="not token_classify"):
        check_add_request(per_token, VOCAB, tasks=GENERATES)


def test_served_tasks_follow_the_architecture() -> None:
    def tasks(arch: str) -> frozenset[str] | None:
        return served_tasks([arch])

    assert tasks("LlamaForCausalLM") == GENERATES
    assert tasks("LlamaModel") == {"embed"} and tasks("BertModel") == {"embed"}
    assert tasks("Qwen3ForSequenceClassification") == {"classify"}
    assert served_tasks(None) is None  # a test runner without a config: not checked


# ------------------------------------------------------------ the core's _add_request, without workers
class _ManualPool:
    """A grammar compile pool whose jobs are done at once (a stand-in grammar: the matcher is faked too)."""

    ready_since = None

    def submit(self, structured: StructuredOutputs, client_id: bytes = b"") -> Future:
        future: Future = Future()
        future.set_result("grammar")
        return future

    def release(self, structured, future, still_wanted: bool) -> None:
        pass


def _core(monkeypatch: pytest.MonkeyPatch, now: list[float],
          **config: Any) -> tuple[EngineCore, list[protocol.RequestOutputDelta]]:
    """An `EngineCore` with a real scheduler and structured-output manager, no executor; returns the deltas sent."""
    xgr = pytest.importorskip("xgrammar")
    monkeypatch.setattr(xgr, "GrammarMatcher", lambda grammar, **kwargs: SimpleNamespace(grammar=grammar))
    sent: list[protocol.RequestOutputDelta] = []
    core = EngineCore.__new__(EngineCore)
    core.config = EngineConfig.create("dummy-model", block_size=4, **config)
    core.executor, core.tasks, core.clients = SimpleNamespace(vocab_size=VOCAB), None, {b"h"}
    core.lora_ids = HostLoRAIds()
    core.liveness = ClientLiveness()
    core.mm_cache, core.stats_reporter = SimpleNamespace(detach=lambda client_id: None), b"h"
    core.io = SimpleNamespace(send=lambda client, outputs: sent.extend(outputs.outputs))
    core.scheduler = Scheduler(core.config, 64, 256, clock=lambda: now[0])
    core.structured = StructuredOutputManager("unused", VOCAB, 30.0)
    core.structured._compilers = _ManualPool()  # type: ignore[assignment]
    core.samples = SampleGroups(core)
    return core, sent


def _add(core: EngineCore, req_id: str, structured: StructuredOutputs | None = None, **fields: Any) -> None:
    message = protocol.AddRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=8, structured=structured), [2],
                                  time.time(), **fields)
    core._handle(b"h", message)
    if structured is not None:
        core.samples.admit_compiled()


@pytest.mark.parametrize("ended_by", ["abort", "timeout", "failed", "goodbye"])
def test_a_reused_request_id_inherits_no_grammar(monkeypatch: pytest.MonkeyPatch, ended_by: str) -> None:
    """A structured request ends before any step notices (the engine idle); a new request of its id, plain or
    structured, must not get its matcher (a plain one would be masked, then aborted by the old grammar) nor its
    start_after wait."""
    now = [0.0]
    core, sent = _core(monkeypatch, now)
    _add(core, "r", StructuredOutputs(choice=["x"], start_after_token_ids=[40]), timeout=1.0)
    assert R in core.scheduler.requests and R in core.structured.matchers and R in core.structured.waiting
    if ended_by == "abort":
        core._handle(b"h", protocol.AbortRequests(["r"]))
    elif ended_by == "timeout":
        now[0] = 2.0
        assert [delta.finish_reason for _, delta in core._finish_expired()] == ["timeout"]
    elif ended_by == "failed":
        core.forget_failed({R: "bad item"})
        core.scheduler.fail_requests({R: "bad item"})
    else:
        core._handle(b"h", protocol.Goodbye())
        core.clients.add(b"h")  # it comes back
    assert R not in core.scheduler.requests
    assert not core.structured.matchers and not core.structured.waiting
    _add(core, "r")
    assert R in core.scheduler.requests and not core.structured.matchers and sent == []
    core._handle(b"h", protocol.AbortRequests(["r"]))
    _add(core, "r", StructuredOutputs(choice=["x"]))
    assert R in core.structured.matchers and not core.structured.waiting and sent == []


def test_a_free_request_id_drops_whatever_matcher_is_left_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """However the earlier request of an id ended, the core accepting the id again starts it without its grammar."""
    core, sent = _core(monkeypatch, [0.0])
    core.structured.matchers[R], core.structured.waiting[R] = object(), ([40], [])
    _add(core, "r")
    assert R in core.scheduler.requests and not core.structured.matchers and not core.structured.waiting
    message = protocol.AddRequest("s", [1, 2, 3], SamplingParams(structured=StructuredOutputs(choice=["x"])), [2], 0.0)
    core.structured.add(Request.from_add_request(message, b"h"))
    core.structured.waiting["s"] = ([40], [])  # a stale wait, not this request's (it has no start_after)
    ready, failed = core.structured.poll()
    assert [r.request_id for r in ready] == ["s"] and failed == [] and "s" not in core.structured.waiting
    assert sent == []


def test_a_refused_request_pins_no_lora_id(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The core records an adapter id once it accepted the request: a refused one does not bind the id to its path;
    two paths to one folder (a symlink) are one adapter, as for the host's `AdapterChecker`."""
    core, sent = _core(monkeypatch, [0.0], enable_lora=True)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "adapter")
    message = protocol.AddRequest("too-long", list(range(3, 300)), SamplingParams(max_tokens=8), [2], time.time(),
                                  lora=LoRARequest("a", 1, "/elsewhere"))
    core._handle(b"h", message)  # longer than max_model_len: refused by the scheduler
    assert [delta.request_id for delta in sent] == ["too-long"] and core.lora_ids.core_ids(b"h") == {}
    _add(core, "a", lora=LoRARequest("a", 1, str(tmp_path / "link")))
    _add(core, "b", lora=LoRARequest("a", 1, str(tmp_path / "adapter")))  # another path to the same folder
    _add(core, "c", lora=LoRARequest("a", 1, str(tmp_path / "link")))
    assert len(sent) == 1 and {request_key(b"h", r) for r in "abc"} <= set(core.scheduler.requests)
    assert core.lora_ids.core_ids(b"h") == {1: 1}


def test_each_host_has_its_own_lora_ids(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Two hosts name different adapters with one lora_int_id: each runs its own (its own core id, so its own slot,
    CPU cache entry and prefix-cache keys); a host that detaches and comes back (an API server redeployed) gets a
    new core id for the same id and folder, so the workers read the folder again (an adapter retrained in place)."""
    core, sent = _core(monkeypatch, [0.0], enable_lora=True)
    core.clients.add(b"g")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _add(core, "x", lora=LoRARequest("sql", 7, a))
    core._handle(b"g", protocol.AddRequest("y", [1, 2, 3], SamplingParams(max_tokens=8), [2], time.time(),
                                           lora=LoRARequest("chat", 7, b)))
    running = {key: (r.lora.lora_name, r.lora.lora_path, r.lora_int_id) for key, r in core.scheduler.requests.items()}
    assert sent == [] and running == {request_key(b"h", "x"): ("sql", a, 1), request_key(b"g", "y"): ("chat", b, 2)}
    _add(core, "z", lora=LoRARequest("chat", 7, b))  # the same host: its id 7 is a's
    assert [(d.request_id, d.error_type) for d in sent] == [("z", "InvalidRequestError")]
    assert sent[0].error == (f"lora_request: lora_int_id 7 already names the adapter at {os.path.realpath(a)}: "
                             "one id, one adapter")
    core._handle(b"h", protocol.Goodbye())
    assert core.lora_ids.core_ids(b"h") == {} and core.lora_ids.core_ids(b"g") == {7: 2}
    core.clients.add(b"h")  # it comes back, its id 7 now names b (or a retrained in place): a new core id
    _add(core, "z", lora=LoRARequest("chat", 7, b))
    _add(core, "w", lora=LoRARequest("sql", 8, a))
    assert len(sent) == 1 and core.lora_ids.core_ids(b"h") == {7: 3, 8: 4}
    assert core.scheduler.requests[request_key(b"h", "z")].lora_int_id == 3


def _adapter_folder(folder) -> str:
    """The smallest PEFT folder `read_adapter` takes: its config and one projection's A and B (numpy, no model)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": np.zeros((2, 8), np.float32),
               f"{prefix}.lora_B.weight": np.zeros((8, 2), np.float32)}, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_add_lora_binds_the_hosts_id_in_the_core(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`AddLoRA` (`AsyncEngine.add_lora`): the core binds the host's id to the folder (its requests then run that core
    id) and refuses, naming the field, an id of another folder, a folder it cannot read, an engine without LoRA."""
    core, _ = _core(monkeypatch, [0.0], enable_lora=True)
    replies: list[protocol.LoRAAdded] = []
    core.io = SimpleNamespace(send=lambda client, message: replies.append(message))
    a, b = _adapter_folder(tmp_path / "a"), _adapter_folder(tmp_path / "b")
    for call_id, lora in (("ok", LoRARequest("sql", 3, a)), ("clash", LoRARequest("chat", 3, b)),
                          ("missing", LoRARequest("gone", 4, str(tmp_path / "gone")))):
        core._handle(b"h", protocol.AddLoRA(call_id, lora))
    errors = [(r.call_id, r.error_type, r.error_field, r.error.split(":")[0]) for r in replies]
    assert errors == [("ok", "", "", ""), ("clash", "InvalidRequestError", "lora_request", "lora_int_id 3 already names "
                                                                                           "the adapter at " + a),
                      ("missing", "InvalidRequestError", "lora_path", "the engine core cannot use it")]
    assert core.lora_ids.core_ids(b"h") == {3: 1}
    _add(core, "r", lora=LoRARequest("sql", 3, a))
    assert core.scheduler.requests[R].lora_int_id == 1
    core.config = EngineConfig.create("dummy-model", block_size=4)  # without enable_lora
    core._handle(b"h", protocol.AddLoRA("off", LoRARequest("sql", 5, a)))
    assert (replies[-1].error_field, replies[-1].error) == ("lora_request", "this engine serves no LoRA adapters: "
                                                                             "start it with enable_lora=True")


def test_remove_lora_forgets_the_hosts_id_only(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`RemoveLoRA` (`AsyncEngine.remove_lora`): the host's id is forgotten (N add/remove cycles leave no entry),
    another host's same id stays, a running request keeps its core id, an unknown id answers False, and the id used
    again, even for another folder, is bound afresh under a new core id (the workers read that folder)."""
    core, _ = _core(monkeypatch, [0.0], enable_lora=True)
    core.clients.add(b"g")
    replies: list = []
    core.io = SimpleNamespace(send=lambda client, message: replies.append(message))
    a, b = _adapter_folder(tmp_path / "a"), _adapter_folder(tmp_path / "b")
    core._handle(b"g", protocol.AddLoRA("g", LoRARequest("sql", 3, a)))
    for i in range(5):
        core._handle(b"h", protocol.AddLoRA(f"add{i}", LoRARequest("sql", 10 + i, a)))
        core._handle(b"h", protocol.RemoveLoRA(f"rm{i}", 10 + i))
    assert core.lora_ids._ids == {b"g": {3: (1, os.path.realpath(a))}, b"h": {}}
    _add(core, "r", lora=LoRARequest("sql", 3, a))
    core._handle(b"h", protocol.RemoveLoRA("running", 3))
    core._handle(b"h", protocol.RemoveLoRA("unknown", 3))
    assert core.scheduler.requests[R].lora_int_id == 7 and core.lora_ids.core_ids(b"g") == {3: 1}
    core._handle(b"h", protocol.AddLoRA("again", LoRARequest("chat", 3, b)))
    assert core.lora_ids.core_ids(b"h") == {3: 8}
    assert [(r.call_id, r.removed) for r in replies if isinstance(r, protocol.LoRARemoved)] == [
        *((f"rm{i}", True) for i in range(5)), ("running", True), ("unknown", False)]
    assert all(not r.error_type for r in replies)


def test_each_host_has_its_own_request_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts of one core may use the same request id: each is its own request, a host aborts only its own, and each
    host's outputs and errors name its ids as it sent them (asyncllm/engine/request_keys.py)."""
    core, sent = _core(monkeypatch, [0.0])
    core.clients.add(b"g")
    _add(core, "r")
    core._handle(b"g", protocol.AddRequest("r", [4, 5], SamplingParams(max_tokens=8), [2], time.time()))
    g_r = request_key(b"g", "r")
    assert sent == [] and set(core.scheduler.requests) == {R, g_r}
    _add(core, "r")  # the same host again: refused, naming its id
    assert [(d.request_id, d.error) for d in sent] == [("r", "request_id: 'r' is already used by an unfinished request")]
    core._handle(b"g", protocol.AbortRequests(["r", R]))  # not even the key names another host's request
    assert set(core.scheduler.requests) == {R}
    wire: list[tuple[bytes, protocol.Outputs]] = []
    core.io = SimpleNamespace(send=lambda client, message: wire.append((client, message)))
    core.weights, core.sleep = SimpleNamespace(weights_version=0), SimpleNamespace(sleep_level=0, awaiting_weights=False)
    outputs = StepOutputs([(b"g", protocol.RequestOutputDelta(g_r, [], "abort", error=f"{g_r!r} failed"))])
    outputs.token_lists(b"h")[0].append(R)
    outputs.token_lists(b"h")[1].append(7)
    core.send_outputs(outputs)
    hosts = {client: (message.token_req_ids, [(d.request_id, d.error) for d in message.outputs]) for client, message in wire}
    assert hosts == {b"h": (["r"], []), b"g": ([], [("r", "'r' failed")])}
