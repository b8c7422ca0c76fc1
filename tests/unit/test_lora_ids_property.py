"""`HostLoRAIds` (asyncllm/engine/lora_ids.py) under drawn traffic of several hosts sharing one engine core
(hypothesis), driven as the core drives it (asyncllm/engine/core.py, asyncllm/engine/core_lora.py).

Drawn: ``max_loras`` 1 to 3 slots, ``kept_lora_ids`` 8 or 64 (the core's is at least 64; 8 reaches the idle bound
within a few ids while keeping the newest eighth, one id, as the core's does), three hosts numbering their adapters
alike (ids 1 to 12, most 4 or below; 0 is invalid), five folders (two adapters, a symlink to the first, a folder gone,
one whose reading fails with an unforeseen error), and a list of operations: `AddLoRA` (`add`), a request with an
adapter or the base model (`core_lora`, then `record` once the core took it; sometimes refused by the core's later
checks: not recorded), a burst of nine requests of consecutive ids (ending at once or running on), a request ending,
`RemoveLoRA` (`remove`, then the workers unpin: `take_unpinned`), `PinLoRA` and its ``unpin`` (core_lora.pin_lora,
the workers sometimes refusing the pin), a host detaching (the core aborts its requests, `forget_host`,
`take_unpinned`) and attaching again under a new client id or its old one, `forget_host` of a client id gone already
or never seen, a core restart (a new `HostLoRAIds`; each host adds its ids again, then pins its pinned ones again)
and a worker restart (core_lora.pin_again, one folder unreadable on the new workers).

`Model` holds the docs' rules (the module docstring, docs/lora.md "One id, one adapter", `remove_lora`, `pin_lora`,
`IdleIds`) in plain dicts: a host's id binds its folder (by realpath) under a core id never issued before by this
core (not after a `remove`, a forgotten idle id or a detached host either), the id used again keeps it (the most
recently used now); another folder for a bound id is an `InvalidRequestError` (``lora_request``, "one id, one
adapter", naming the bound folder), so is a request of an adapter not pinned while every slot is pinned, a folder
the core cannot read (``lora_path``, only when binding: requests are checked by their host), an invalid id; the
refusals of `pin_lora` all name ``lora_id`` (`pin_refusal`); pinning needs a free slot, and the last one only while
no request in the core runs another adapter; a pinned id removed, unpinned or whose host detached is unpinned on the
workers exactly once; past ``kept`` ids of a host, its least recently used ones no request runs with and not pinned
are forgotten down to an eighth of ``kept`` below it (never the newest eighth), a walk that cannot get there retried
only an eighth of ``kept`` ids later. After every operation the real object must match: each host's (and each gone
client's: nothing) host id -> core id, two hosts' ids never sharing a core id, the pinned adapters, nothing left to
unpin (`take_unpinned` empty: each was reported once, at its operation), the workers' pin and unpin commands, every
reply (type, call id, error type, field and message), and what `core_lora` resolves every id of every host to (the
bound core id, a fresh one, or the refusal), which must change nothing.
Explicit cases reach what drawn ones seldom do: a pinned id removed, a host leaving with a pin, every slot pinned,
the last slot, the recency of an id used again past ``kept``, a core restart and a worker restart.
Mutation runs: ``LORA_IDS_NO_SHRINK=1`` runs without shrinking.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from asyncllm import InvalidRequestError, LoRARequest, protocol
from asyncllm.engine import core_lora, lora_ids
from asyncllm.engine.lora_ids import HostLoRAIds, pin_refusal

HOSTS = 3
MAX_ID = 12
"""Host ids drawn: 0 (invalid) to 12, most of them 4 or below (hosts' ids overlap)."""
BURST = 9
"""A burst: one host's requests of this many consecutive ids (past ``kept`` 8: idle ids forgotten)."""
FOLDERS = ("a", "b", "la", "gone", "weird")
"""Two adapters, a symlink to ``a``, a folder gone, and one whose reading raises an unforeseen error."""
real_read_adapter = lora_ids.read_adapter

settings.register_profile("lora_ids_mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("LORA_IDS_NO_SHRINK"):
    settings.load_profile("lora_ids_mutations")


def _write_adapter(folder: str) -> None:
    """The smallest PEFT folder `read_adapter` takes: its config and one projection's A and B."""
    os.makedirs(folder)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}, f)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": np.zeros((2, 8), np.float32),
               f"{prefix}.lora_B.weight": np.zeros((8, 2), np.float32)}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each of `FOLDERS` by name: its path."""
    root = tmp_path_factory.mktemp("lora_ids")
    paths = {name: str(root / name) for name in FOLDERS}
    _write_adapter(paths["a"])
    _write_adapter(paths["b"])
    os.symlink(paths["a"], paths["la"])
    _write_adapter(paths["weird"])
    return paths


@lru_cache(maxsize=None)
def _real(path: str) -> str:
    """``os.path.realpath`` once per path (the model's identity of a folder)."""
    return os.path.realpath(path)


class Weird(RuntimeError):
    """What reading the ``weird`` folder raises: no `InvalidRequestError`."""


@dataclass
class Binding:
    """A host id bound in the core."""

    core_id: int
    real: str
    """The folder's realpath: the adapter's identity."""
    folder: str
    """The name in `FOLDERS` it was bound with (what its host adds again after a core restart)."""


@dataclass(frozen=True)
class Refusal:
    """An expected `InvalidRequestError`: its field, phrases its message holds, and how it begins."""

    field: str
    phrases: tuple[str, ...] = ()
    prefix: str = ""

    def matches(self, field: str, message: str) -> bool:
        return field == self.field and message.startswith(self.prefix) and all(p in message for p in self.phrases)


class Model:
    """The core's adapter ids by the docs' rules."""

    def __init__(self, kept: int, slots: int) -> None:
        self.kept, self.slots = kept, slots
        self.newest = kept // 8
        self.ids: dict[bytes, dict[int, Binding]] = {}
        """Client -> its host ids -> binding, least recently used first."""
        self.walk_at: dict[bytes, int] = {}
        """Client -> the number of ids at which the next walk over the requests happens (`IdleIds`)."""
        self.issued: set[int] = set()
        """Every core id this core has bound (never issued again)."""
        self.pinned: dict[int, LoRARequest] = {}
        """Core id -> the adapter pinned (under its core id)."""

    def view(self, client: bytes) -> dict[int, int]:
        return {host_id: b.core_id for host_id, b in self.ids.get(client, {}).items()}

    def lookup(self, client: bytes, host_id: int) -> Binding | None:
        return self.ids.get(client, {}).get(host_id)

    def resolve_refusal(self, client: bytes, lora: LoRARequest, request: bool) -> Refusal | None:
        """`core_lora`'s refusal: another folder for a bound id, or (a request) every slot pinned by others."""
        bound = self.lookup(client, lora.lora_int_id)
        if bound is not None and bound.real != _real(lora.lora_path):
            return Refusal("lora_request", ("one id, one adapter", bound.real))
        if request and len(self.pinned) >= self.slots and (bound is None or bound.core_id not in self.pinned):
            return Refusal("lora_request", (f"max_loras={self.slots}", "pinned"))
        return None

    def bind_refusal(self, client: bytes, lora: LoRARequest, folder: str) -> Refusal | None:
        """`bind`'s refusal (`AddLoRA`, `PinLoRA`): an invalid id, another folder, a folder the core cannot read."""
        if lora.lora_int_id < 1:
            return Refusal("lora_request", ("lora_int_id must be",))
        refusal = self.resolve_refusal(client, lora, request=False)
        if refusal is not None:
            return refusal
        if folder == "gone":
            return Refusal("lora_path", (lora.lora_path,), "the engine core cannot use it: the adapter at ")
        if folder == "weird":
            return Refusal("lora_path", (), "the engine core cannot use it: Weird: cannot read it")
        return None

    def record(self, client: bytes, host_id: int, core_id: int, real: str, folder: str, busy: set[int]) -> None:
        """Bound (or used again): the most recently used; then the host's idle ids past `kept` are forgotten."""
        ids = self.ids.setdefault(client, {})
        ids[host_id] = ids.pop(host_id, None) or Binding(core_id, real, folder)
        self.issued.add(ids[host_id].core_id)
        self._forget_idle(client, busy | self.pinned.keys())

    def _forget_idle(self, client: bytes, busy: set[int]) -> None:
        """`IdleIds`: none up to `kept`; past it (and at a walk), the oldest idle ones, never the newest eighth,
        down to an eighth below `kept`; a walk that cannot get to `kept` waits for an eighth of `kept` more ids."""
        ids = self.ids[client]
        count = len(ids)
        if count <= self.kept:
            self.walk_at[client] = self.kept + 1
            return
        if count < self.walk_at.get(client, self.kept + 1):
            return
        idle = [host_id for host_id in list(ids)[:count - self.newest] if ids[host_id].core_id not in busy]
        for host_id in idle[:count - self.kept + self.newest]:
            del ids[host_id]
        left = len(ids)
        self.walk_at[client] = self.kept + 1 if left <= self.kept else left + max(1, self.newest)

    def pin_refusal(self, core_id: int, running: set[int]) -> Refusal | None:
        """`check_pin`: no slot left, or the last one while a request of another adapter is in the core."""
        if core_id in self.pinned:
            return None
        if len(self.pinned) >= self.slots:
            return Refusal("lora_id", (f"cannot pin more adapters than max_loras={self.slots}",))
        if len(self.pinned) + 1 == self.slots and running - self.pinned.keys() - {0, core_id}:
            return Refusal("lora_id", (f"pin the last of the max_loras={self.slots}",))
        return None

    def unpin(self, core_id: int) -> list[tuple[LoRARequest, bool]]:
        """The workers' unpin command, if `core_id` was pinned."""
        pinned = self.pinned.pop(core_id, None)
        return [] if pinned is None else [(pinned, True)]

    def remove(self, client: bytes, host_id: int) -> tuple[bool, list[tuple[LoRARequest, bool]]]:
        bound = self.ids.get(client, {}).pop(host_id, None)
        return bound is not None, [] if bound is None else self.unpin(bound.core_id)

    def forget_host(self, client: bytes) -> list[tuple[LoRARequest, bool]]:
        self.walk_at.pop(client, None)
        return [command for b in self.ids.pop(client, {}).values() for command in self.unpin(b.core_id)]


class FakeCore:
    """What core_lora.py uses of `EngineCore`: the ids, the requests' core ids, the workers (recording each pin and
    unpin command, refusing folders in `broken` or every pin while `refuse`), the replies."""

    def __init__(self, ids: HostLoRAIds, live: list[tuple[bytes, int]]) -> None:
        self.lora_ids = ids
        self.live = live
        self.config = SimpleNamespace(enable_lora=True)
        self.overlap = None
        self.replies: list = []
        self.io = SimpleNamespace(send=lambda client, message: self.replies.append(message))
        self.commands: list[tuple[LoRARequest, bool]] = []
        self.broken: set[str] = set()
        self.refuse = False
        self.executor = SimpleNamespace(pin_lora=self._pin_lora)

    def running_lora_ids(self) -> set[int]:
        return {core_id for _, core_id in self.live}

    def send_outputs(self, outputs: list) -> None:
        pass

    def _pin_lora(self, command: protocol.PinLoRA) -> list[protocol.LoRAPinned]:
        self.commands.append((command.lora, command.unpin))
        ok = protocol.LoRAPinned(command.call_id, 0)
        if not command.unpin and (self.refuse or _real(command.lora.lora_path) in self.broken):
            return [ok, protocol.LoRAPinned(command.call_id, 1, error_type="InvalidRequestError",
                                            error_field="lora_id", error="unreadable")]
        return [ok, protocol.LoRAPinned(command.call_id, 1)]

    def took(self) -> tuple[list[protocol.CoreMessage], list[tuple[LoRARequest, bool]]]:
        """The replies and the workers' commands since the last call."""
        took = self.replies, self.commands
        self.replies, self.commands = [], []
        return took


def _commands(commands: list[tuple[LoRARequest, bool]]) -> list[tuple[int, bool, str, str]]:
    """Worker commands comparable regardless of the order of one operation's unpins (a pin comes before its undo)."""
    return sorted((lora.lora_int_id, unpin, lora.lora_name, lora.lora_path) for lora, unpin in commands)


def _refused(reply, refusal: Refusal) -> bool:
    return reply.error_type == "InvalidRequestError" and refusal.matches(reply.error_field, reply.error)


class Driver:
    """The real `HostLoRAIds`, driven as the core drives it, beside the model."""

    def __init__(self, paths: dict[str, str], slots: int, kept: int) -> None:
        self.paths, self.slots, self.kept = paths, slots, kept
        self.live: list[tuple[bytes, int]] = []
        """The requests in the core: (client, core id; 0: the base model)."""
        self.clients = [f"h{host}".encode() for host in range(HOSTS)]
        self.gone: list[bytes] = []
        self._new_core()

    def _new_core(self) -> None:
        self.live.clear()
        self.ids = HostLoRAIds(self.kept, lambda: {core_id for _, core_id in self.live}, self.slots)
        self.core = FakeCore(self.ids, self.live)
        self.model = Model(self.kept, self.slots)

    def lora(self, host: int, host_id: int, folder: str) -> LoRARequest:
        return LoRARequest(f"h{host}-{host_id}-{folder}", host_id, self.paths[folder])

    def _learn(self, client: bytes, host_id: int, lora: LoRARequest, folder: str) -> int:
        """The core id the real object bound ``host_id`` under (a fresh one if the model has none); recorded."""
        bound = self.model.lookup(client, host_id)
        core_id = self.ids.core_ids(client).get(host_id)
        if bound is None:
            assert core_id is not None and core_id >= 1 and core_id not in self.model.issued, (core_id, host_id)
        else:
            assert core_id == bound.core_id, (core_id, bound)
        self.model.record(client, host_id, core_id, _real(lora.lora_path), folder,
                          self.core.running_lora_ids())
        return core_id

    def add(self, host: int, host_id: int, folder: str) -> None:
        """`AddLoRA`: bound, or the refusal in the answer."""
        client, lora = self.clients[host], self.lora(host, host_id, folder)
        refusal = self.model.bind_refusal(client, lora, folder)
        reply = self.ids.add(client, protocol.AddLoRA("add", lora), True)
        if refusal is not None:
            assert reply.call_id == "add" and _refused(reply, refusal), (reply, refusal)
            return
        assert reply == protocol.LoRAAdded("add")
        self._learn(client, host_id, lora, folder)

    def request(self, host: int, host_id: int, folder: str, accepted: bool) -> None:
        """A request (``host_id`` 0: the base model): `core_lora`, then (`accepted` by the core's other checks)
        queued and `record`ed."""
        client = self.clients[host]
        lora = None if host_id == 0 else self.lora(host, host_id, folder)
        refusal = None if lora is None else self.model.resolve_refusal(client, lora, request=True)
        try:
            core = self.ids.core_lora(client, lora)
        except InvalidRequestError as exc:
            assert refusal is not None and refusal.matches(exc.field, exc.message), (exc, refusal)
            return
        assert refusal is None, refusal
        if lora is None:
            assert core is None
        else:
            bound = self.model.lookup(client, host_id)
            expected = bound.core_id if bound is not None else core.lora_int_id
            assert core == msgspec.structs.replace(lora, lora_int_id=expected), (core, bound)
            assert bound is not None or (expected >= 1 and expected not in self.model.issued), expected
        if not accepted:
            return
        self.live.append((client, 0 if core is None else core.lora_int_id))
        self.ids.record(client, host_id, core)
        if lora is not None:
            self._learn(client, host_id, lora, folder)

    def burst(self, host: int, n: int, folder: str, finish: bool) -> None:
        """`BURST` requests of consecutive ids (after ``n``, wrapping), each resolved as the model says; with
        `finish` each ends at once (idle when the next is recorded)."""
        for i in range(BURST):
            before = len(self.live)
            self.request(host, 1 + (n + i) % MAX_ID, folder, True)
            if finish and len(self.live) > before:
                self.live.pop()

    def finish(self, n: int) -> None:
        if self.live:
            del self.live[n % len(self.live)]

    def remove(self, host: int, host_id: int) -> None:
        """`RemoveLoRA`, then the workers unpin (core.py's `_handle`)."""
        client = self.clients[host]
        reply = self.ids.remove(client, protocol.RemoveLoRA("remove", host_id))
        core_lora.unpin_removed(self.core)
        removed, unpins = self.model.remove(client, host_id)
        assert reply == protocol.LoRARemoved("remove", removed)
        self._expect([], unpins)

    def pin(self, host: int, host_id: int, folder: str, workers_refuse: bool) -> None:
        """`PinLoRA`: bound as `AddLoRA`, then pinned on the workers if a slot allows (core_lora.pin_lora)."""
        client, lora = self.clients[host], self.lora(host, host_id, folder)
        refusal = self.model.bind_refusal(client, lora, folder)
        self.core.refuse = workers_refuse
        core_lora.pin_lora(self.core, client, protocol.PinLoRA("pin", lora))
        self.core.refuse = False
        replies, commands = self.core.took()
        assert len(replies) == 1 and replies[0].call_id == "pin", replies
        if refusal is not None:
            named = Refusal("lora_id", refusal.phrases, f"the adapter of lora_int_id {host_id}: " + refusal.prefix
                            if refusal.field == "lora_path" else refusal.prefix)
            assert _refused(replies[0], named), (replies[0], named)
            assert commands == []
            return
        core_id = self._learn(client, host_id, lora, folder)  # bound even when the pin is refused
        refusal = self.model.pin_refusal(core_id, self.core.running_lora_ids())
        if refusal is not None:
            assert _refused(replies[0], refusal) and commands == [], (replies, refusal)
            return
        if core_id in self.model.pinned:  # pinned again: nothing changes, the workers are not asked
            assert replies == [protocol.LoRAPinned("pin")] and commands == []
            return
        core = msgspec.structs.replace(lora, lora_int_id=core_id)
        if workers_refuse:  # nothing pinned; the rank that pinned it unpins it
            assert replies == [protocol.LoRAPinned("pin", 0, error_type="InvalidRequestError", error_field="lora_id",
                                                   error="unreadable")]
            assert commands == [(core, False), (core, True)]
            return
        self.model.pinned[core_id] = core
        assert replies == [protocol.LoRAPinned("pin")] and commands == [(core, False)]

    def unpin(self, host: int, host_id: int, folder: str) -> None:
        """`PinLoRA` with ``unpin`` (another replica refused the pin): unpinned, still bound."""
        client = self.clients[host]
        core_lora.pin_lora(self.core, client, protocol.PinLoRA("unpin", self.lora(host, host_id, folder), unpin=True))
        bound = self.model.lookup(client, host_id)
        self._expect([protocol.LoRAPinned("unpin")], [] if bound is None else self.model.unpin(bound.core_id))

    def detach(self, host: int, same_id: bool) -> None:
        """The host leaves (Goodbye or found dead): the core aborts its requests and forgets its ids; it attaches
        again (`Hello`) under a new client id, or (`same_id`) its old one."""
        client = self.clients[host]
        self.live[:] = [(c, core_id) for c, core_id in self.live if c != client]
        self.ids.forget_host(client)
        core_lora.unpin_removed(self.core)
        self._expect([], self.model.forget_host(client))
        if not same_id:
            self.gone.append(client)
            self.clients[host] = f"h{host}.{len(self.gone)}".encode()

    def forget_gone(self, n: int) -> None:
        """`forget_host` of a client id gone already, or never seen: nothing changes."""
        client = self.gone[n % len(self.gone)] if self.gone and n % 2 else b"never-%d" % n
        self.ids.forget_host(client)
        core_lora.unpin_removed(self.core)
        self._expect([], [])

    def restart(self) -> None:
        """A core restarted by its supervisor: none bound, none pinned; each host adds its ids again (least recently
        used first), then pins its pinned ones again (asyncllm/engine/engine_pins.py)."""
        bound = {host: dict(self.model.ids.get(client, {})) for host, client in enumerate(self.clients)}
        pinned = [(host, host_id, b.folder) for host, ids in bound.items() for host_id, b in ids.items()
                  if b.core_id in self.model.pinned]
        self._new_core()
        self.check()
        for host, ids in bound.items():
            for host_id, b in ids.items():
                self.add(host, host_id, b.folder)
        for host, host_id, folder in pinned:
            self.pin(host, host_id, folder, False)

    def restart_workers(self, folder: str) -> None:
        """Restarted workers pin the pinned adapters again; one they cannot read (`folder`) is unpinned."""
        self.core.broken = {_real(self.paths[folder])}
        core_lora.pin_again(self.core)
        self.core.broken = set()
        expected = []
        for core_id, lora in list(self.model.pinned.items()):
            expected.append((lora, False))
            if _real(lora.lora_path) in {_real(self.paths[folder])}:
                expected.extend(self.model.unpin(core_id))
        self._expect([], expected)

    def _expect(self, replies: list, commands: list[tuple[LoRARequest, bool]]) -> None:
        got_replies, got_commands = self.core.took()
        assert got_replies == replies
        assert _commands(got_commands) == _commands(commands), (got_commands, commands)

    def check(self) -> None:
        """Everything observable equals the model; `core_lora` resolves every id as the model does."""
        assert self.core.took() == ([], [])
        assert self.ids.take_unpinned() == []  # each unpinned adapter reported once, at its operation
        assert self.ids.pinned == self.model.pinned
        assert len(self.ids.pinned) <= self.slots
        every: list[int] = []
        for client in self.clients + self.gone:
            assert self.ids.core_ids(client) == self.model.view(client), client
            every.extend(self.model.view(client).values())
        assert len(every) == len(set(every)), every  # two hosts' ids never share a core id
        assert set(self.model.pinned) <= set(every)  # a pinned id stays bound
        for host, client in enumerate(self.clients):
            bound = self.model.view(client)
            unbound = min(set(range(1, MAX_ID + 2)) - set(bound))
            for host_id in sorted({*bound, unbound, MAX_ID + 1}):  # an id of no host: any unbound one answers alike
                self._probe(client, host, host_id)
        for client in self.gone[-2:]:
            fresh = self.ids.core_lora(client, self.lora(0, 1, "a"), request=False)
            assert fresh.lora_int_id not in self.model.issued
        assert self.ids.core_lora(self.clients[0], None) is None

    def _probe(self, client: bytes, host: int, host_id: int) -> None:
        """`core_lora` of a request with the id (its bound folder, else ``a``), and with another folder: the model's
        answer."""
        bound = self.model.lookup(client, host_id)
        lora = self.lora(host, host_id, bound.folder if bound is not None else "a")
        refusal = self.model.resolve_refusal(client, lora, request=True)
        try:
            core = self.ids.core_lora(client, lora)
        except InvalidRequestError as exc:
            assert refusal is not None and refusal.matches(exc.field, exc.message), (exc, refusal)
        else:
            assert refusal is None, (refusal, core)
            if bound is not None:
                assert core == msgspec.structs.replace(lora, lora_int_id=bound.core_id)
            else:
                assert core.lora_int_id >= 1 and core.lora_int_id not in self.model.issued, core
        if bound is not None:
            other = self.lora(host, host_id, "b" if _real(self.paths["b"]) != bound.real else "a")
            with pytest.raises(InvalidRequestError) as refused:
                self.ids.core_lora(client, other, request=False)
            assert self.model.resolve_refusal(client, other, False).matches(refused.value.field, refused.value.message)


def _read_adapter(path: str):
    """The core's folder reader, the ``weird`` folder failing with no `InvalidRequestError`."""
    if os.path.basename(path) == "weird":
        raise Weird("cannot read it")
    return real_read_adapter(path)


def run(paths: dict[str, str], slots: int, kept: int, ops: list[tuple[str, int, int, str, bool]]) -> None:
    driver = Driver(paths, slots, kept)
    with mock.patch.object(lora_ids, "read_adapter", _read_adapter):
        for kind, host, n, folder, flag in ops:
            if kind == "add":
                driver.add(host, n, folder)
            elif kind == "request":
                driver.request(host, n, folder, flag)
            elif kind == "burst":
                driver.burst(host, n, folder, flag)
            elif kind == "finish":
                driver.finish(n)
            elif kind == "remove":
                driver.remove(host, n)
            elif kind == "pin":
                driver.pin(host, n, folder, flag)
            elif kind == "unpin":
                driver.unpin(host, n, folder)
            elif kind == "detach":
                driver.detach(host, flag)
            elif kind == "forget_gone":
                driver.forget_gone(n)
            elif kind == "restart":
                driver.restart()
            else:
                driver.restart_workers(folder)
            driver.check()


KINDS = (["add"] * 3 + ["request"] * 5 + ["finish"] * 2 + ["remove"] * 3 + ["pin"] * 3
         + ["unpin", "detach", "forget_gone", "restart", "restart_workers", "burst"])


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, list[tuple[str, int, int, str, bool]]]:
    slots = draw(st.integers(1, 3))
    kept = draw(st.sampled_from([8, 64]))
    ops = draw(st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from([0, 0, 0, 1, 1, 2]),
                                  st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4]) | st.integers(0, MAX_ID),
                                  st.sampled_from(["a", "a", "b", "b", "la", "gone", "weird"]), st.booleans()),
                        min_size=20, max_size=60))
    return slots, kept, ops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
# two hosts' adapter 1 of one folder: two core ids; host 0 removes its 1 and adds it again: a third, never an old one
@example(case=(2, 64, [("add", 0, 1, "a", False), ("add", 1, 1, "a", False), ("remove", 0, 1, "a", False),
                       ("remove", 0, 1, "a", False), ("add", 0, 1, "a", False), ("request", 1, 1, "a", True)]))
# a pinned id removed while its request runs: unpinned on the workers once; the request keeps its core id
@example(case=(2, 64, [("pin", 0, 2, "a", False), ("request", 0, 2, "a", True), ("remove", 0, 2, "a", False),
                       ("request", 0, 2, "b", True), ("pin", 0, 2, "b", False)]))
# another host's unpin of its own id 1 (not bound) leaves host 1's pinned; host 1 detaching with a pinned id:
# unpinned, its ids gone; attached again, its id 1 of the same folder is new
@example(case=(2, 64, [("pin", 1, 1, "a", False), ("unpin", 0, 1, "a", False), ("add", 0, 1, "a", False),
                       ("unpin", 0, 1, "a", False), ("add", 1, 3, "b", False), ("detach", 1, 0, "a", False),
                       ("forget_gone", 0, 1, "a", False), ("add", 1, 1, "a", False), ("pin", 1, 1, "a", False)]))
# every slot pinned: a request of another adapter (a new id too) refused, the pinned one's taken; a second pin refused
@example(case=(1, 64, [("pin", 0, 1, "a", False), ("request", 0, 2, "b", True), ("request", 1, 1, "a", True),
                       ("request", 0, 1, "a", True), ("pin", 2, 1, "b", False), ("unpin", 0, 1, "a", False),
                       ("request", 0, 2, "b", True)]))
# the last slot: refused while another adapter's request is in the core (not a base-model one, nor one of a pinned
# adapter), pinned once it ended; pinning a pinned id again with every slot pinned changes nothing (a symlink too)
@example(case=(2, 64, [("pin", 0, 1, "a", False), ("request", 0, 1, "a", True), ("request", 0, 0, "a", True),
                       ("request", 1, 1, "b", True), ("pin", 0, 2, "b", False), ("finish", 0, 2, "a", False),
                       ("pin", 0, 2, "b", False), ("pin", 0, 2, "b", False), ("pin", 0, 1, "la", True)]))
# past kept=8, 1 and 2 forgotten (3 to 9 kept); 3 used again is the most recently used: at 11 ids, 4 and 5 go
@example(case=(1, 8, [("burst", 0, 0, "a", True), ("request", 0, 3, "a", True), ("finish", 0, 0, "a", False),
                      ("request", 0, 10, "b", True), ("request", 0, 11, "b", True), ("finish", 0, 0, "a", False),
                      ("finish", 0, 0, "a", False), ("request", 0, 12, "b", True)]))
# past kept=8: the least recently used idle ids forgotten, never a pinned or a running one nor the newest; a
# forgotten id binds another folder afresh; a burst of running requests walks once, then waits for one more id
@example(case=(3, 8, [("pin", 0, 1, "a", False), ("request", 0, 2, "a", True), ("burst", 0, 2, "b", True),
                      ("add", 0, 3, "a", False), ("burst", 1, 0, "a", False), ("burst", 1, 9, "b", False)]))
# kept=8: host 0's nine ids all running, a futile walk: the next only at ten ids, whatever host 1 binds meanwhile
@example(case=(1, 8, [("burst", 0, 0, "a", False), *[("finish", 0, 0, "a", False)] * BURST,
                      ("request", 1, 1, "a", True), ("request", 0, 9, "a", True), ("request", 0, 1, "a", True),
                      ("request", 0, 10, "a", True)]))
# a symlink to a bound folder is that adapter; another folder is refused naming the bound one; the workers refuse a
# pin: nothing pinned; pins the core cannot read name lora_id and whose folder
@example(case=(2, 64, [("add", 0, 1, "a", False), ("add", 0, 1, "la", False), ("pin", 0, 1, "la", True),
                       ("add", 0, 1, "b", False), ("pin", 0, 4, "gone", False), ("pin", 0, 5, "weird", False),
                       ("add", 0, 0, "a", False), ("pin", 0, 0, "a", False), ("request", 0, 5, "gone", True)]))
# a core restart: hosts add their ids again and pin again (new core ids from the start); restarted workers that
# cannot read a pinned folder unpin it: removing its id then unpins nothing
@example(case=(2, 64, [("add", 0, 1, "b", False), ("pin", 1, 1, "la", False), ("pin", 0, 2, "b", False),
                       ("request", 2, 1, "b", True), ("restart", 0, 0, "a", False),
                       ("restart_workers", 0, 0, "b", False), ("remove", 0, 2, "b", False),
                       ("remove", 1, 1, "a", False)]))
def test_host_lora_ids_follow_the_docs(paths: dict[str, str], case) -> None:
    run(paths, *case)


def test_an_engine_without_lora_binds_nothing(paths: dict[str, str]) -> None:
    """`AddLoRA` and `PinLoRA` on an engine without LoRA: refused (``lora_request``; the pin's names ``lora_id``),
    nothing bound or pinned."""
    ids = HostLoRAIds(8, frozenset, 0)
    reply = ids.add(b"h", protocol.AddLoRA("add", LoRARequest("a", 1, paths["a"])), False)
    assert (reply.error_type, reply.error_field) == ("InvalidRequestError", "lora_request")
    assert "enable_lora=True" in reply.error and ids.core_ids(b"h") == {}
    with pytest.raises(InvalidRequestError) as refused:
        ids.bind(b"h", LoRARequest("a", 1, paths["a"]), False)
    named = pin_refusal(refused.value, 1)
    assert named.field == "lora_id" and named.message == refused.value.message and ids.pinned == {}


def test_pin_refusal_names_lora_id_and_keeps_the_code() -> None:
    """`pin_refusal`: a ``lora_id`` refusal as it is; another field's renamed (a folder's saying whose), its code
    kept."""
    kept = InvalidRequestError("lora_id", "no slot")
    assert pin_refusal(kept, 3) is kept
    path = pin_refusal(InvalidRequestError("lora_path", "the engine core cannot use it: x", code="c"), 3)
    assert (path.field, path.message, path.code) == ("lora_id", "the adapter of lora_int_id 3: the engine core "
                                                                "cannot use it: x", "c")
    clash = pin_refusal(InvalidRequestError("lora_request", "one id, one adapter", code="d"), 3)
    assert (clash.field, clash.message, clash.code) == ("lora_id", "one id, one adapter", "d")
