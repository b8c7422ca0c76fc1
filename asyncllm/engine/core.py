"""The engine core: a plain synchronous busy loop in its own process.

receive requests and aborts -> schedule one step -> the executor runs it on the workers -> update requests with the
sampled tokens -> send outputs to the host that owns each request (engine/sync_step.py; with async_scheduling, the
next step is scheduled and submitted before the current one's output is collected: engine/overlap.py). Run as
``python -m asyncllm.engine.core``.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # a host's child from its first line: a Ctrl-C during the imports below is the host's
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (no traceback here); main() then ignores both, ignore_group_signals

import argparse  # noqa: E402 - after the Ctrl-C is ignored
import functools
import logging
import os
import queue
import sys
import time
from collections import defaultdict

import msgspec

from asyncllm import errors, protocol
from asyncllm.child_logging import configure_child_logging
from asyncllm.config import EngineConfig
from asyncllm.engine.client_liveness import ClientLiveness
from asyncllm.engine.core_io import CoreIO, fail_startup, unknown_host_answer
from asyncllm.engine.core_sleep import SleepController
from asyncllm.engine.core_weights import WeightUpdater
from asyncllm.engine.overlap import OverlappedSteps
from asyncllm.engine.sync_step import sync_step
from asyncllm.engine.kv_budget import served_config, swap_blocks
from asyncllm.engine.core_lora import pin_again, pin_lora, unpin_removed
from asyncllm.engine.lora_ids import HostLoRAIds
from asyncllm.engine.request_keys import host_outputs, request_key, request_keys
from asyncllm.engine.sample_groups import SampleGroups
from asyncllm.engine.validation import check_add_request, served_tasks
from asyncllm.lora import kept_lora_ids
from asyncllm.mm.core_cache import CoreProcessorCache
from asyncllm.procutil import exit_when_parent_dies, ignore_group_signals, report_crashes
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler
from asyncllm.sched.step_outputs import StepOutputs
from asyncllm.structured.manager import StructuredOutputManager
from asyncllm.workers.executor import Executor
from asyncllm.workers.restart import WorkerRestarter

logger = logging.getLogger("asyncllm.engine.core")

_IDLE_POLL_S = 0.05
_IDLE_HEALTH_CHECK_S = 0.5
"""While idle, check the workers this often: a dead one is restarted before a request needs it."""


class EngineCore:
    """Owns the scheduler and the executor; `run()` is the busy loop."""
    model_name = ""  # the model as its launcher named it (`Ready.model`: attached hosts' label); "": none given

    def __init__(self, config: EngineConfig, io: CoreIO, hf_config_json: str | None = None, auto_fit: bool = False,
                 model_name: str = ""):
        self.config = config
        self.model_name = model_name
        self.io = io
        self.clients: set[bytes] = set()
        self.tasks: frozenset[str] | None = None
        """What the model serves ("generate", "embed", "classify"), as the workers report it; None: unknown (requests
        are not checked)."""
        self.lora_ids = HostLoRAIds(kept_lora_ids(config.lora_config.resolved_max_cpu_loras), self.running_lora_ids,
                                    config.max_loras if config.enable_lora else 0)
        """Each host's LoRA adapter ids -> the core's (asyncllm/engine/lora_ids.py); a detached host's are
        forgotten (`forget_host`), and each host's least recently used idle ones past a bound."""
        self.stats_reporter: bytes | None = None
        """The one host that exports the engine-wide metrics (the earliest still attached)."""
        self.liveness = ClientLiveness(config.fault_tolerance_config.host_heartbeat_timeout_s, io.last_heard)
        """Notices a host that died without a Goodbye (SIGKILL) or fell silent (tcp://): `_drop_dead_clients`."""
        self.executor = Executor(config, hf_config_json=hf_config_json)
        self._running = True
        self.mm_cache = CoreProcessorCache(config.multimodal_config)
        """The core's half of the multimodal processor cache: the lru store, each host's shm ring (asyncllm/mm/)."""
        available = self.executor.start()
        self.mm_cache.piece_merge = self.executor.mm_piece_merge
        self.mm_cache.piece_audio_window = self.executor.mm_piece_audio_window
        self.tasks = served_tasks(self.executor.served_architectures, config.runner, config.convert)
        self.num_gpu_blocks = config.num_gpu_blocks_override or available
        self.config = config = served_config(config, self.num_gpu_blocks, auto_fit,  # vLLM's -1
                                                   self.executor.kv_budget_field)
        num_offload_blocks = self.executor.num_offload_blocks
        num_swap_blocks = swap_blocks(config, self.executor.num_cpu_blocks - num_offload_blocks)
        self.num_cpu_blocks = num_swap_blocks + num_offload_blocks
        self.executor.init_cache(self.num_gpu_blocks, self.num_cpu_blocks)
        self.scheduler = Scheduler(config, self.num_gpu_blocks, config.max_model_len,
                                   num_cpu_blocks=num_swap_blocks, state_checkpoints=self.executor.state_checkpoints,
                                   num_offload_blocks=num_offload_blocks, kv_budget_field=self.executor.kv_budget_field)
        self.scheduler.pinned_loras = self.lora_ids.pinned.keys()  # pinned adapters hold their slots (core_lora.py)
        spec = config.scheduler_config.speculative
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model, self.executor.vocab_size, config.structured_output_compile_timeout_s,
            config.tokenizer_revision, max_drafts=spec.num_speculative_tokens if spec else 0,
            trust_remote_code=config.trust_remote_code, any_whitespace=not config.structured_output_disable_any_whitespace,
            tokenizer_mode=config.tokenizer_mode)
        # restarted workers get the same config JSON (no config.json read, no transformers import); after an
        # update_weights it is still the served architecture's, which the running workers keep using too
        self.restarter = WorkerRestarter(self.executor.config, self.num_gpu_blocks, self.num_cpu_blocks,
                                         functools.partial(Executor, hf_config_json=hf_config_json))
        self.weights = WeightUpdater(self)
        """Live weight updates (`UpdateWeights`, docs/weight-updates.md) and the weights version."""
        self.sleep = SleepController(self)
        """Sleep mode (`Sleep` / `WakeUp`, docs/sleep-mode.md): while it holds steps, requests only queue."""
        self.samples = SampleGroups(self)
        """An n > 1 request's samples refused together (asyncllm/engine/sample_groups.py)."""
        self._next_health_check = 0.0
        overlapped = config.async_scheduling and config.scheduler_config.speculative_config is None
        if config.async_scheduling and not overlapped:
            logger.info("speculative decoding: every step runs synchronously (async_scheduling does not apply)")
        self.overlap = OverlappedSteps(self) if overlapped else None
        """async_scheduling: the steps scheduled ahead of their outputs (asyncllm/engine/overlap.py); not with
        speculative decoding, whose next drafts need the step's accepted tokens."""

    # ------------------------------------------------------------ busy loop
    def run(self) -> None:
        while self._running:
            self.run_once(wait=True)

    def run_once(self, wait: bool = False) -> None:
        """One turn of the busy loop (`wait`: for a message, when nothing runs); tests call it alone to put host
        messages between chosen steps (tests/engine/test_core_schedules.py)."""
        in_flight = self.overlap is not None and self.overlap.in_flight
        runnable = self.scheduler.has_unfinished_requests() and not self.sleep.holds_steps
        changed = self._drain_inbox(block=wait and not (in_flight or runnable))  # idle: wait for a message
        if not self._running:
            return
        changed |= self._drop_dead_clients()  # one clock comparison between checks
        expired = self._finish_expired()  # one comparison when none is due
        if self.structured.pending:  # requests waiting for their grammar (polled at least every 50 ms)
            expired += self.samples.admit_compiled()
        if self.scheduler.has_unfinished_requests() and not self.sleep.holds_steps:
            if self.overlap is not None:
                self.overlap.step(expired, changed)
            else:
                sync_step(self, expired, changed)
        elif in_flight:  # everything left was aborted or timed out while a step ran
            self.overlap.drain(expired)
        else:
            if changed or expired:
                self.send_outputs(expired)
            self._check_idle_workers()

    def _finish_expired(self) -> list[tuple[bytes, protocol.RequestOutputDelta]]:
        """End the requests whose timeout passed (`Scheduler.finish_expired_requests`), grammar matchers too."""
        expired = self.scheduler.finish_expired_requests()
        if expired and self.structured.matchers:
            self.structured.drop(delta.request_id for _, delta in expired)
        return expired

    def forget_failed(self, failed: dict[str, str]) -> None:
        """Drop the multimodal items of requests the workers failed from the processor cache: a malformed item
        (`asyncllm.mm.embeddings`) must not serve the host's next request of its hash, which then resends its data
        (`MultiModalCacheMiss`); and their grammar matchers (a new request may reuse the id)."""
        if failed and self.structured.matchers:
            self.structured.drop(failed)
        for request in map(self.scheduler.requests.get, failed):
            if request is not None and request.mm_items:
                self.mm_cache.forget(item.mm_hash for item in request.mm_items)

    def recover_workers(self, exc: errors.EngineDeadError) -> None:
        """Replace failed workers; every running request is recomputed (`EngineDeadError` past the budget)."""
        self.executor = self.restarter.recover(self.executor, self.scheduler, exc)
        try:
            pin_again(self)  # before they are put back to sleep: a pinned adapter waits in the CPU cache then
        except errors.EngineDeadError as again:
            self.recover_workers(again)
            return
        self.sleep.after_restart()  # they started awake

    def _check_idle_workers(self) -> None:
        """Find a worker that died while nothing ran (at most every `_IDLE_HEALTH_CHECK_S`)."""
        now = time.monotonic()
        if now < self._next_health_check:
            return
        self._next_health_check = now + _IDLE_HEALTH_CHECK_S
        try:
            self.executor.check_workers()
        except errors.EngineDeadError as exc:
            self.recover_workers(exc)

    def send_outputs(self, outputs: StepOutputs | list[tuple[bytes, protocol.RequestOutputDelta]]) -> None:
        """Each host gets its requests' outputs and the stats snapshot (every host, even with no output)."""
        if not isinstance(outputs, StepOutputs):
            outputs = StepOutputs(outputs)
        per_client: dict[bytes, list[protocol.RequestOutputDelta]] = defaultdict(list)
        for client_id, delta in outputs.deltas:
            per_client[client_id].append(delta)
        tokens = outputs.tokens
        stats = self.scheduler.get_stats()
        stats.weights_version = self.weights.weights_version
        stats.sleep_level, stats.awaiting_weights = self.sleep.sleep_level, self.sleep.awaiting_weights
        if self.structured.pending:  # requests waiting for their grammar wait too
            stats.num_requests_waiting += len(self.structured.pending)
        now, queued = time.time(), self.samples.queued
        for client_id in self.clients:
            token_req_ids, token_ids = tokens.get(client_id, ([], []))
            deltas, token_req_ids = host_outputs(client_id, per_client.get(client_id, []), token_req_ids)
            stats.host_samples_queued = queued.get(client_id, 0)  # its own (encoded now, by `send`)
            self.io.send(client_id, protocol.Outputs(deltas, stats, now,
                                                     stats_reporter=client_id == self.stats_reporter,
                                                     token_req_ids=token_req_ids, token_ids=token_ids))

    # ------------------------------------------------------------ host messages
    def _drain_inbox(self, block: bool) -> bool:
        """Handle every queued host message; wait for one first when idle."""
        changed = False
        try:
            item = self.io.inbox.get(timeout=_IDLE_POLL_S) if block else self.io.inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            changed |= self._handle(*item)
            try:
                item = self.io.inbox.get_nowait()
            except queue.Empty:
                return changed

    def _handle(self, client_id: bytes, message: protocol.HostMessage) -> bool:
        if isinstance(message, (protocol.AddRequest, protocol.AbortRequests, protocol.ResetPrefixCache,
                                protocol.UpdateWeights, protocol.AwaitWeights, protocol.Sleep, protocol.WakeUp,
                                protocol.AddLoRA, protocol.RemoveLoRA, protocol.PinLoRA, protocol.Heartbeat)) \
                and client_id not in self.clients:
            logger.error("dropped a %s from a host that never said Hello", type(message).__name__)
            answer = unknown_host_answer(message)  # its caller must not wait (a host taken for dead, say)
            if answer is not None:
                self.io.send(client_id, answer)
            return False
        if isinstance(message, protocol.AddRequest):
            self._add_request(client_id, message)
        elif isinstance(message, protocol.AbortRequests):  # a host can name, so abort, its own requests only
            self.abort(client_id, request_keys(client_id, message.request_ids))
        elif isinstance(message, protocol.Hello):
            mismatch = protocol.wire_protocol_mismatch(message.wire_protocol, protocol.wire_protocol())
            if mismatch is not None:  # told, never registered: its AddRequests would be misread (protocol.py)
                logger.error("refused host pid %d: %s", message.pid, mismatch)
                self.io.send(client_id, protocol.EngineFailed("EngineDeadError", mismatch))
                return False
            if message.probe:  # `connect()` asks what the core serves: not a host (nothing would remove it)
                self.io.send(client_id, self._ready())
                return False
            self.clients.add(client_id)
            self.liveness.watch(client_id, message.pid, message.process_identity, message.heartbeat_interval_s)
            if self.stats_reporter is None:
                self.stats_reporter = self.liveness.reporter([client_id])
            ready = self._ready()
            ready.mm_shm_ring_mapped = self.mm_cache.attach(client_id, message.mm_shm_ring)
            self.io.send(client_id, ready)
        elif isinstance(message, protocol.ResetPrefixCache):
            self.scheduler.reset_prefix_cache()
            logger.info("prefix cache reset (asked by a host)")
        elif isinstance(message, protocol.UpdateWeights):
            self.weights.update(client_id, message)
        elif isinstance(message, protocol.AwaitWeights):
            self.weights.await_pushed(message.weights_version)
        elif isinstance(message, (protocol.Sleep, protocol.WakeUp)):
            self.sleep.handle(client_id, message)
        elif isinstance(message, protocol.AddLoRA):
            self.io.send(client_id, self.lora_ids.add(client_id, message, self.config.enable_lora))
        elif isinstance(message, protocol.RemoveLoRA):
            reply = self.lora_ids.remove(client_id, message)
            unpin_removed(self)  # a pinned id: unpinned on the workers before the caller goes on
            self.io.send(client_id, reply)
        elif isinstance(message, protocol.PinLoRA):
            pin_lora(self, client_id, message)
        elif isinstance(message, protocol.Goodbye):
            self._remove_client(client_id)
            if message.shutdown:
                self._running = False
        return not isinstance(message, protocol.Heartbeat)  # heard by the I/O thread already (`CoreIO.last_heard`)

    def abort(self, client_id: bytes, keys: list[str]) -> None:
        """End `client_id`'s requests of these keys: queued, running, waiting for a grammar or still to come."""
        aborted = self.scheduler.abort_requests(keys)
        if aborted and self.structured.matchers:
            self.structured.drop(r.request_id for r in aborted)
        if self.structured.pending:
            self.structured.abort(keys, client_id)
        self.samples.forget(keys)

    def running_lora_ids(self) -> set[int]:
        """The core adapter ids of the requests queued, running or parked for a grammar: `HostLoRAIds` keeps them."""
        ids = {request.lora_int_id for request in self.scheduler.requests.values()}
        ids.update(pending.request.lora_int_id for pending in self.structured.pending.values())
        return ids

    def _remove_client(self, client_id: bytes) -> None:
        """A host left (`Goodbye`) or died: abort its requests, unmap its ring, hand its metrics export on."""
        self.structured.drop(r.request_id for r in self.scheduler.abort_client(client_id))
        self.structured.abort_client(client_id)
        self.samples.forget_client(client_id)
        self.clients.discard(client_id)
        self.liveness.forget(client_id)
        self.mm_cache.detach(client_id)
        self.lora_ids.forget_host(client_id)
        unpin_removed(self)
        if self.stats_reporter == client_id:
            self.stats_reporter = self.liveness.reporter(self.clients)

    def _drop_dead_clients(self) -> bool:
        """Remove the hosts that died without a Goodbye or fell silent (asyncllm/engine/client_liveness.py)."""
        dead = self.liveness.dead_clients()
        for client_id, what in dead.items():
            logger.warning("a host %s: its %d requests are aborted", what,
                           sum(r.client_id == client_id for r in self.scheduler.requests.values()))
            self._remove_client(client_id)
        return bool(dead)

    def _add_request(self, client_id: bytes, message: protocol.AddRequest) -> None:
        request_id = message.request_id  # the host's: the core keys the request by `request_key` (ids are per host)
        key = request_key(client_id, request_id)
        try:
            self.samples.check(key)
            # the host checked too; other peers may not have
            check_add_request(message, self.executor.vocab_size, self.config.enable_prompt_embeds,
                              self.config.max_logprobs, self.tasks)
            message.request_id = key
            if message.mm_items:
                self.mm_cache.fill(client_id, message)
            # after the fill (the host's mirror of the processor cache counts it), as the scheduler's checks; a parked
            # structured request counts (its matcher would replace the running one's of the same id)
            if key in self.scheduler.requests or key in self.structured.pending:
                raise errors.InvalidRequestError("request_id", f"{request_id!r} is already used by an unfinished "
                                                               "request")
            # the id is free: a matcher left by an earlier request of it (ended before a step noticed) is not this one's
            self.structured.drop([key])
            host_lora_id = message.lora.lora_int_id if message.lora is not None else 0
            message.lora = self.lora_ids.core_lora(client_id, message.lora)  # each host's adapter ids are its own
            self.samples.queue(Request.from_add_request(message, client_id))  # parked for a grammar, or queued
            self.lora_ids.record(client_id, host_lora_id, message.lora)  # once accepted: a refused request pins no id
        except (errors.InvalidRequestError, errors.EngineOverloadedError) as exc:
            refused = self.samples.refuse(client_id, key, message.num_samples, exc)
            self.io.send(client_id, protocol.Outputs(host_outputs(client_id, refused, [])[0], None, time.time()))

    def _ready(self) -> protocol.Ready:
        c = self.config
        return protocol.Ready(self.num_gpu_blocks, c.block_size, c.max_model_len, os.getpid(), self.model_name,
                              wire_protocol=protocol.wire_protocol(), config=c.to_dict(wire=True))

    def stop(self) -> None:
        """End `run()` after the current step (a standalone core's signal handler calls this)."""
        self._running = False

    def shutdown(self) -> None:
        if self.overlap is not None:
            logger.debug("async_scheduling: %d steps, %d of them scheduled synchronously",
                        self.scheduler.num_steps_total, self.overlap.num_sync_steps)
        self.mm_cache.close()
        self.structured.shutdown()
        self.executor.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="asyncllm.engine.core")
    parser.add_argument("--address", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--hf-config-json", default=None, help="the checkpoint's config, as the host read it")
    parser.add_argument("--auto-max-model-len", action="store_true", help="max_model_len -1: fit to the KV cache")
    parser.add_argument("--model-name", default="", help="the model as the host names it (`Ready.model`)")
    args = parser.parse_args(argv)
    exit_when_parent_dies()
    report_crashes()
    ignore_group_signals()  # the host owns the shutdown order: Ctrl-C must not kill what it drains
    configure_child_logging("core")
    config = EngineConfig.from_dict(msgspec.json.decode(args.config_json))
    io = CoreIO(args.address)
    core = None
    try:
        core = EngineCore(config, io, args.hf_config_json, args.auto_max_model_len, args.model_name)
    except BaseException as exc:  # noqa: BLE001 - reported to the host, then exit
        if not isinstance(exc, errors.ConfigError):  # a bad config is the host's one line, not a traceback here
            logger.exception("engine core failed to start")
        fail_startup(io, exc)
        io.close()
        sys.exit(1)
    try:
        core.run()
    except BaseException as exc:  # noqa: BLE001 - tell the hosts, then exit
        logger.exception("engine core died")
        for client_id in core.clients:
            io.send(client_id, protocol.EngineFailed("EngineDeadError", f"engine core died: {exc!r} (traceback on stderr)"))
        time.sleep(0.1)
        raise
    finally:
        core.shutdown()
        io.close()
    core.structured.exit_if_compiling()  # a runaway grammar compile must not hold up the core's exit


if __name__ == "__main__":
    main()
