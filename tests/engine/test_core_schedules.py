"""The central invariant under schedules that replay exactly: an engine core in this process (its real scheduler,
overlapped steps and worker process) is driven one busy-loop turn at a time (`EngineCore.run_once`), with each host
message (a request, an abort) put in its inbox before a chosen turn. The same seed gives the same steps, so a
failure reproduces, which tests/engine/test_random_schedules.py's wall-clock arrivals cannot promise.

A seed draws a configuration (as test_random_schedules does: small KV caches that preempt by recompute or swap,
prefix caching, token budgets, priorities, long-prefill caps) and a pool of prompts, half on shared stems; several
rounds of 3 to 24 requests from the pool (the same prompt concurrently too) then run on the one core, so later
rounds meet the prefix cache the earlier ones left. Greedy outputs must equal transformers', an aborted one a prefix
of them; seeded sampling must equal a synchronous core that runs one request at a time. Longer runs of the same
draws: docs/scheduling.md, "Random schedules".
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import time
from typing import Any

import msgspec
import pytest

from asyncllm import SamplingParams, protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.core import EngineCore
from engine_helpers import worker_pipeline_on
from test_random_schedules import MAX_TOKENS, _config, _reference, _sampling

HOST = b"host-0"
EOS = 1  # the tiny checkpoints' eos_token_id
MAX_TURNS = 20_000


class InboxIO:
    """The core's I/O without sockets: the test fills `inbox`; `sent` keeps what the core sends, encoded when sent
    as `CoreIO.send` does (a later change to the objects sent must not show)."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.last_heard: dict = {}
        self.sent: list[bytes] = []
        self._decoder = msgspec.msgpack.Decoder(protocol.CoreMessage)

    def send(self, client_id: bytes, message: Any) -> None:
        self.sent.append(msgspec.msgpack.encode(message))

    def take(self) -> list[Any]:
        sent, self.sent = self.sent, []
        return [self._decoder.decode(payload) for payload in sent]


class Core:
    """An `EngineCore` and its inbox, one host attached; `turn()` runs one turn of its loop and collects outputs."""

    def __init__(self, path: str, config: dict[str, Any], pipelined: bool) -> None:
        self.io = InboxIO()
        with worker_pipeline_on() if pipelined else contextlib.nullcontext():  # read by the worker at its start
            self.core = EngineCore(EngineConfig.create(path, **config), self.io)
        self.put(protocol.Hello(pid=os.getpid(), wire_protocol=protocol.wire_protocol()))
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    def put(self, message: Any) -> None:
        self.io.inbox.put((HOST, message))

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0) -> None:
        self.tokens[request_id] = []
        self.put(protocol.AddRequest(request_id, prompt, params, [EOS], time.time(), priority=priority))

    def turn(self) -> None:
        """One `run_once`; the outputs it sent applied as a host applies them: each message's full deltas, then its
        one-token lists, and nothing for a request that ended (finished, or its stream closed)."""
        self.core.run_once()
        for message in self.io.take():
            if not isinstance(message, protocol.Outputs):
                continue
            for delta in message.outputs:
                assert delta.error is None, delta
                if delta.request_id not in self.finished:
                    self.tokens[delta.request_id] += delta.new_token_ids
                    self.record(delta)
                if delta.finish_reason is not None:
                    self.finished.add(delta.request_id)
            for request_id, token in zip(message.token_req_ids, message.token_ids):
                if request_id not in self.finished:
                    self.tokens[request_id].append(token)

    def record(self, delta: protocol.RequestOutputDelta) -> None:
        """What a host keeps of a full delta besides its tokens (nothing here)."""

    def alone(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """One request run to its end with nothing else queued."""
        request_id = f"alone-{len(self.tokens)}"
        self.add(request_id, prompt, params)
        for _ in range(MAX_TURNS):
            self.turn()
            if request_id in self.finished:
                return self.tokens[request_id]
        raise AssertionError(f"{request_id} did not finish in {MAX_TURNS} turns")

    def close(self) -> None:
        self.core.shutdown()


def _pool(rng: random.Random, size: int = 40) -> list[list[int]]:
    stems = [[rng.randrange(3, 500) for _ in range(n)] for n in (16, 20, 33)]
    pool = []
    for _ in range(size):
        head = rng.choice(stems) if rng.random() < 0.5 else []
        pool.append(head + [rng.randrange(3, 500) for _ in range(rng.randint(1, 88 - len(head)))])
    return pool


def _round(core: Core, rng: random.Random, pool: list[list[int]], tag: str, sampled: bool,
           prioritised: bool, draw=_sampling) -> list[dict[str, Any]]:
    """3 to 24 requests arriving at drawn turns, a fifth closed part-way; run until every one ended. ``sampled``:
    their settings are ``draw(rng)``'s, else greedy."""
    spread = rng.choice([0, 5, 20, 60])
    requests = []
    for i in range(rng.randint(3, 24)):
        params = draw(rng) if sampled else SamplingParams(temperature=0.0, max_tokens=rng.randint(1, MAX_TOKENS))
        params.n = 1
        abort = rng.randint(1, params.max_tokens) if rng.random() < 0.2 else None
        requests.append(dict(id=f"{tag}-{i}", prompt=rng.choice(pool), params=params, abort=abort,
                             at=rng.randint(0, spread), priority=rng.randrange(3) if prioritised else 0, abort_at=None))
    for turn in range(MAX_TURNS):
        for r in requests:
            if r["at"] == turn:
                core.add(r["id"], r["prompt"], r["params"], r["priority"])
            if r["abort_at"] == turn and r["id"] not in core.finished:
                core.put(protocol.AbortRequests([r["id"]]))
                core.finished.add(r["id"])  # a host that closed the stream reads nothing more
        core.turn()
        for r in requests:
            if r["abort"] is not None and r["abort_at"] is None and len(core.tokens.get(r["id"], ())) >= r["abort"]:
                r["abort_at"] = turn + 1 + rng.randrange(3)  # the host's abort lands a few turns later
        if turn >= spread and all(r["id"] in core.finished for r in requests):
            return requests
    raise AssertionError(f"{tag}: requests unfinished after {MAX_TURNS} turns")


def _check(requests: list[dict[str, Any]], core: Core, want_of, what: str) -> None:
    for r in requests:
        got, want = core.tokens[r["id"]], want_of(r)
        if r["abort"] is not None:
            want = want[: len(got)]
        assert got == want, f"{what} {r['id']} (prompt of {len(r['prompt'])}, abort after {r['abort']}): {r['params']}"


def sampling_cores(path: str, rng: random.Random, kind: type[Core]) -> tuple[dict[str, Any], Core, Core]:
    """A drawn configuration without priorities, a core of it, and a roomy synchronous core that runs one request
    at a time (`Core.alone`): seeded sampling's reference."""
    config = _config(rng)
    config.pop("scheduling_policy", None)
    core = kind(path, config, pipelined=rng.random() < 0.5)
    alone = kind(path, dict(disable_log_stats=True, max_model_len=128, async_scheduling=False,
                            enable_prefix_caching=False, max_num_seqs=1), pipelined=False)
    return config, core, alone


# Drawn for their reach: overlapped steps on 9 and 12 blocks (prefix caching; swap with priorities), pipelined
# workers in two of three; seeded sampling with swap, overlapped and synchronous.
@pytest.mark.parametrize("seed", [20_001, 20_025, 20_028])
def test_greedy_equals_transformers_on_replayable_schedules(tiny_llama: str, seed: int) -> None:
    rng = random.Random(seed)
    config = _config(rng)
    core = Core(tiny_llama, config, pipelined=rng.random() < 0.5)
    try:
        pool = _pool(rng)
        for k in range(4):
            requests = _round(core, rng, pool, f"r{k}", False, config.get("scheduling_policy") == "priority")
            _check(requests, core, lambda r: _reference(tiny_llama, tuple(r["prompt"]))[: r["params"].max_tokens],
                   f"seed {seed} {config} round {k}")
        assert not core.core.scheduler.requests
    finally:
        core.close()


@pytest.mark.parametrize("seed", [30_005, 30_031])
def test_seeded_sampling_equals_one_request_at_a_time_on_replayable_schedules(tiny_llama: str, seed: int) -> None:
    rng = random.Random(seed)
    config, core, alone = sampling_cores(tiny_llama, rng, Core)
    try:
        pool = _pool(rng)
        for k in range(2):
            requests = _round(core, rng, pool, f"r{k}", True, False)
            _check(requests, core, lambda r: alone.alone(r["prompt"], r["params"]), f"seed {seed} {config} round {k}")
    finally:
        core.close()
        alone.close()


def test_a_seed_replays_the_same_steps(tiny_llama: str) -> None:
    """What makes a failure reproducible: two cores given the same draw run the same number of steps and preemptions
    and give the same tokens (a schedule that depended on timing would differ somewhere)."""
    runs = []
    for _ in range(2):
        rng = random.Random(7)
        core = Core(tiny_llama, dict(disable_log_stats=True, max_model_len=128, async_scheduling=True,
                                     enable_prefix_caching=True, num_gpu_blocks_override=12, max_num_seqs=4,
                                     preemption_mode="swap", swap_space=0.001), pipelined=False)
        try:
            _round(core, rng, _pool(rng), "r", False, False)
            stats = core.core.scheduler.get_stats()
            runs.append((core.core.scheduler.num_steps_total, stats.num_preemptions_total, core.tokens))
        finally:
            core.close()
    assert runs[0][1] > 0, "the draw should preempt"
    assert runs[0] == runs[1]
