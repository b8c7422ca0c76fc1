"""The host's processor thread: everything CPU-bound stays off the event loop.

It owns the zmq DEALER connected to the engine core. Requests come in from the
loop through `submit`/`abort` (a queue plus an inproc doorbell); it tokenizes
them (chat templates included) and sends them to the core; it decodes the
core's outputs, detokenizes incrementally, matches stop strings (aborting the
request in the core), and hands one batch per core message to the loop.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any, TypeVar

import msgspec
import zmq

from asyncllm import errors, protocol
from asyncllm.engine.channel import ConnectionWatch, HostHeartbeat, open_dealer
from asyncllm.engine.client_liveness import process_identity
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.launch import CoreProcess
from asyncllm.engine.logprobs import LogprobsDecoder
from asyncllm.engine.pooling_model import PoolingModel
from asyncllm.engine.processor_outputs import (
    Deliver,
    Delivery,
    ProcessorOutputs,
    TrackedRequest,
    error_from,
)
from asyncllm.engine.processor_requests import (
    ProcessorRequests,
    Submit,
    sample_request_ids,
)
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.lora_ids import PendingLoRACalls
from asyncllm.engine.sleep import PendingSleepCalls
from asyncllm.engine.stats_log import StatsLogger
from asyncllm.engine.weight_update import PendingWeightUpdates
from asyncllm.lora_checker import AdapterChecker
from asyncllm.metrics.observer import RequestObserver
from asyncllm.mm.processor import MultiModalProcessor
from asyncllm.sampling import MAX_LOGPROBS

logger = logging.getLogger("asyncllm.engine")

__all__ = ["Deliver", "Delivery", "Processor", "Submit", "sample_request_ids"]

T = TypeVar("T")

_POLL_MS = 100
_GOODBYE_LINGER_MS = 1000
"""A failed thread's Goodbye (`_leave`): how long closing its socket waits to hand it over."""
_EXIT_STATUS_WAIT_S = 0.5
"""After the connection to an owned core dropped: how long to wait for the process's exit status."""


class Processor(ProcessorRequests, ProcessorOutputs):
    """Runs the processor thread; `start()` returns a future of the core's Ready. A request's way to the core is
    `ProcessorRequests`' (asyncllm/engine/processor_requests.py; parked first while a new adapter is checked:
    asyncllm/engine/processor_lora.py), its outputs' way back `ProcessorOutputs`'
    (asyncllm/engine/processor_outputs.py)."""

    def __init__(self, *, address: str, tokenizer: Any, eos_token_ids: list[int], vocab_size: int,
                 deliver: Deliver, core: CoreProcess | None, stats_logger: StatsLogger | None,
                 startup_timeout_s: float, observer: RequestObserver | None = None,
                 engine_key: str | None = None, mm: MultiModalProcessor | None = None,
                 lora: AdapterChecker | None = None, hidden_size: int | None = None,
                 pooling_model: PoolingModel | None = None, stream_interval: int = 1,
                 embeds_width: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> None:
        self._address = address
        self._stream_interval = stream_interval
        """Tokens per delivered delta (`SchedulerConfig.stream_interval`): first and last tokens go at once."""
        self._pooling_model = pooling_model
        """Which requests the model takes (asyncllm/engine/pooling_model.py); None: any request runs."""
        self._hidden_size = hidden_size
        """The model's embedding width, for `PoolingParams.dimensions`."""
        self._max_logprobs = max_logprobs
        """The engine's ``max_logprobs`` (-1: the vocabulary's size)."""
        self._lora = lora
        """Checks requests' adapters (None: the engine serves none)."""
        self._mm = mm
        """Image processing, for multimodal models only."""
        self._prompts = PromptTokenizer(tokenizer, vocab_size, mm, pooling_model, embeds_width)
        """Each request's prompt as token ids (asyncllm/engine/prompt_tokens.py)."""
        self._engine_key = engine_key
        """The shared secret of a tcp:// address (CURVE); None for ipc://."""
        self._watch: ConnectionWatch | None = None
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._vocab_size = vocab_size
        self._deliver = deliver
        self._core = core
        self._stats_logger = stats_logger
        self._observer = observer if observer is not None else RequestObserver("")
        self._startup_timeout_s = startup_timeout_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, TrackedRequest] = {}
        """Core request id -> its state (`sample_request_ids`: ``<id>#<k>``, an n > 1 request's ``<id>#<k>-<i>``)."""
        self._samples: dict[str, list[str]] = {}
        """Request id -> the core request ids of its unfinished samples."""
        self._parked: dict[str, Submit] = {}
        """Request id -> a request waiting for its adapter's check (asyncllm/engine/processor_lora.py)."""
        self._ending: list[RequestCollector] = []
        """Requests the core message being handled ended (untracked, their last item not delivered yet): should the
        thread fail before it delivers them, `_fail_all` fails them too."""
        self._adding: Submit | None = None
        """The request `_add_request` is handling: should the thread fail in it, `_fail_queued_requests` fails it."""
        self._submissions = itertools.count()
        """Numbers each request's core ids apart from an earlier request of the same id (`sample_request_ids`)."""
        self._logprobs_decoder = LogprobsDecoder(tokenizer)
        self._weight_updates = PendingWeightUpdates()
        """`UpdateWeights` sent and not answered yet (asyncllm/engine/weight_update.py)."""
        self._sleep_calls = PendingSleepCalls()
        """`Sleep` / `WakeUp` sent and not answered yet (asyncllm/engine/sleep.py)."""
        self._lora_calls = PendingLoRACalls()
        """`AddLoRA` sent and not answered yet (asyncllm/engine/lora_ids.py)."""
        self._ctx = zmq.Context()
        self._doorbell_address = f"inproc://asyncllm-doorbell-{uuid.uuid4().hex}"
        self._doorbell_pull = self._ctx.socket(zmq.PULL)
        self._doorbell_pull.bind(self._doorbell_address)
        self._doorbell = self._ctx.socket(zmq.PUSH)
        self._doorbell.connect(self._doorbell_address)
        self._doorbell_lock = threading.Lock()
        self._accepting = True
        """False once the ending thread drained the jobs (`_fail_queued_requests`): a Submit is refused then."""
        self._accepting_lock = threading.Lock()
        """Held by `_post`'s check and put and by the drain, so a Submit is either drained (failed) or refused."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(protocol.CoreMessage)
        self.ready: concurrent.futures.Future[protocol.Ready] = concurrent.futures.Future()
        self.dead: BaseException | None = None
        self.said_goodbye = False
        """Goodbye was sent (`close`): an owned core shuts its workers down and exits on its own."""
        self._thread = threading.Thread(target=self._run, name="asyncllm-processor", daemon=True)

    # ------------------------------------------------------------ loop side
    def start(self) -> concurrent.futures.Future:
        self._thread.start()
        return self.ready

    def submit(self, job: Submit) -> None:
        self._post(job)

    def abort(self, request_id: str, collector: RequestCollector | None = None) -> None:
        """Abort `request_id`; given its `collector`, only while that request holds the id (a duplicate's abort,
        refused here as in flight already, leaves the request it duplicated running)."""
        self._post(("abort", request_id, collector))

    def serve_max_model_len(self, max_model_len: int) -> None:
        """Serve `max_model_len` (data parallelism: the least the replicas' cores fitted, `served_max_model_len`),
        never past the core's own (its Ready's): prompts are checked against it, and a longer core still ends every
        sequence there, by length, as vLLM's one max_model_len. Applies to the requests submitted after it."""
        self._post(("max_model_len", max_model_len))

    def reset_prefix_cache(self) -> None:
        """Send `ResetPrefixCache` after every request submitted before (the jobs keep their order)."""
        self._post(("reset_prefix_cache",))

    def update_weights(self, message: protocol.UpdateWeights) -> concurrent.futures.Future[int]:
        """Send `UpdateWeights` (its update_id is set here) after every request submitted before; the future of
        the new weights version."""
        message.update_id, future = self._weight_updates.new()
        return self._send_call(self._weight_updates, message, future)

    def await_weights(self, weights_version: int) -> None:
        """Send `AwaitWeights` (before any request: call it as the core restarts)."""
        self._post(("send", protocol.AwaitWeights(weights_version)))

    def sleep_mode(self, message: protocol.Sleep | protocol.WakeUp) -> concurrent.futures.Future[int]:
        """Send `Sleep` or `WakeUp` (its call_id is set here) after every request submitted before; the future
        of the core's sleep level after it."""
        message.call_id, future = self._sleep_calls.new()
        return self._send_call(self._sleep_calls, message, future)

    def _send_call(self, calls: Any, message: Any,
                   future: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
        """Post a control call registered in `calls`; a thread that never began fails it (an ended one closed
        `calls`, so `new` failed it already)."""
        self._post(("send", message))
        if not self._thread.is_alive():
            calls.fail_all(self.dead or errors.EngineDeadError("the engine is not running"))
        return future

    def close(self, shutdown_core: bool) -> None:
        """Say goodbye to the core and stop the thread (blocking: call off the loop)."""
        if self._thread.is_alive():
            self._post(("close", shutdown_core))
            self._thread.join(timeout=10)
        with self._doorbell_lock:
            self._doorbell.close(linger=0)
        self._ctx.term()

    def _post(self, job: Any) -> None:
        with self._accepting_lock:
            if isinstance(job, Submit) and (self.dead is not None or not self._accepting):  # never read: refused
                raise errors.EngineDeadError(f"the engine is dead: {self.dead}" if self.dead is not None
                                             else "the engine was closed")
            self._jobs.put(job)
        with self._doorbell_lock:
            if self._doorbell.closed:
                return
            try:
                self._doorbell.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # no room: rings wait for the thread, or it ended (an abort then has nothing to abort)
                pass

    # ------------------------------------------------------------ thread side
    def _run(self) -> None:
        dealer = open_dealer(self._ctx, self._address, self._engine_key)
        self._watch = watch = ConnectionWatch(dealer)
        heartbeat = HostHeartbeat(self._address, self._encoder, lambda: self.dead is None)
        try:
            ring = self._mm.open_cache() if self._mm is not None else ""  # the shm processor cache's segment
            dealer.send(self._encoder.encode(protocol.Hello(pid=os.getpid(), mm_shm_ring=ring,
                                                            wire_protocol=protocol.wire_protocol(),
                                                            process_identity=process_identity(),
                                                            heartbeat_interval_s=heartbeat.interval_s)))
            if self._await_ready(dealer):
                self._serve(dealer, heartbeat)
        except BaseException as exc:  # noqa: BLE001 - never die silently: fail every stream
            logger.exception("asyncllm processor thread failed")
            self._settle_ready(exc)
            self._leave(dealer)
            self._fail_all(errors.EngineDeadError(f"processor thread failed: {exc}"))
        finally:
            self._fail_queued_requests()
            for calls in (self._weight_updates, self._sleep_calls, self._lora_calls):  # later calls fail at once
                calls.close(self.dead or errors.EngineDeadError("the engine was closed"))
            if self._mm is not None:
                self._mm.close_cache()
            watch.close()
            dealer.close()  # linger 0, unless `_leave` let its Goodbye out
            self._doorbell_pull.close(linger=0)

    def _leave(self, dealer: zmq.Socket) -> None:
        """The thread failed: detach from the core (`Goodbye`, shutdown=False), which aborts this host's requests
        there; a shared core would otherwise run them to their end and keep this host attached while its process
        lives (its liveness check watches the process, not the thread). Lingers a moment so the Goodbye goes out."""
        try:
            dealer.send(self._encoder.encode(protocol.Goodbye(shutdown=False)), zmq.NOBLOCK)
            dealer.setsockopt(zmq.LINGER, _GOODBYE_LINGER_MS)
        except zmq.ZMQError:  # no connection to queue it on: nothing of this host is there to abort
            pass

    def _fail_queued_requests(self) -> None:
        """Requests posted that the ending thread will never serve (the one it failed while adding included): they
        fail rather than wait forever, with the error the others got."""
        error = self.dead or errors.EngineDeadError("the engine was closed")
        with self._accepting_lock:  # a `_post` between its check and its put finishes first: its job is drained
            self._accepting = False
            jobs = [] if self._adding is None else [self._adding]
            while not self._jobs.empty():
                jobs.append(self._jobs.get_nowait())
        for job in jobs:
            if isinstance(job, Submit):
                self._deliver([(job.collector, error)], None)

    def _await_ready(self, dealer: zmq.Socket) -> bool:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if dealer.poll(_POLL_MS):
                message = self._decoder.decode(dealer.recv())
                if isinstance(message, protocol.Ready):
                    mismatch = protocol.wire_protocol_mismatch(protocol.wire_protocol(), message.wire_protocol)
                    if mismatch is not None:  # a core from before the check: it took this host's Hello
                        dealer.send(self._encoder.encode(protocol.Goodbye(shutdown=False)))  # no ghost host left
                        self._settle_ready(errors.EngineDeadError(mismatch))
                        return False
                    if self._mm is not None:
                        self._mm.cache_mapped(message.mm_shm_ring_mapped)
                    self._prompts.ready(message.max_model_len)
                    self._settle_ready(message)
                    return True
                if isinstance(message, protocol.EngineFailed):
                    self._settle_ready(error_from(message))
                    return False
            death = self._core.death(" while starting") if self._core is not None else None
            if death is not None:
                self._settle_ready(death)
                return False
            lost = self._lost_connection(dealer, " while starting")
            if lost is not None:
                self._settle_ready(lost)
                return False
            if self._close_requested():  # no Goodbye: an owned core still starting is stopped by its stdin's EOF
                self._settle_ready(errors.EngineDeadError("engine closed while starting"))
                return False
        self._settle_ready(errors.EngineDeadError(f"engine core not ready after {self._startup_timeout_s:.0f} s"))
        return False

    def _settle_ready(self, outcome: protocol.Ready | BaseException) -> None:
        """Set `ready` unless it is done already: a cancelled start (``asyncio.wait_for(engine.start(), T)``)
        cancelled it from the loop, at any moment."""
        try:
            if isinstance(outcome, BaseException):
                self.ready.set_exception(outcome)
            else:
                self.ready.set_result(outcome)
        except concurrent.futures.InvalidStateError:
            pass

    def _close_requested(self) -> bool:
        try:
            job = self._jobs.get_nowait()
        except queue.Empty:
            return False
        self._jobs.put(job)
        return isinstance(job, tuple) and job[0] == "close"

    def _serve(self, dealer: zmq.Socket, heartbeat: HostHeartbeat) -> None:
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._doorbell_pull, zmq.POLLIN)
        assert self._watch is not None
        poller.register(self._watch.socket, zmq.POLLIN)
        while True:
            events = dict(poller.poll(_POLL_MS))
            if self._doorbell_pull in events:
                while self._doorbell_pull.poll(0):
                    self._doorbell_pull.recv()
                if not self._handle_jobs(dealer, heartbeat):
                    return
            if dealer in events:
                self._read_core(dealer, heartbeat)
            if self._core_died():
                return
            if self._watch.socket in events:
                lost = self._lost_connection(dealer)
                if lost is not None:
                    self._fail_all(lost)
                    return
            heartbeat.maybe_send(dealer)
            if self._stats_logger is not None:
                self._stats_logger.maybe_log()

    def _read_core(self, dealer: zmq.Socket, heartbeat: HostHeartbeat) -> None:
        """Handle every core message received so far (zmq's own thread queues them meanwhile, unbounded)."""
        while dealer.poll(0):
            self._on_core_message(dealer, dealer.recv())
            heartbeat.maybe_send(dealer)  # a host slower than the core stays in this loop: it still beats

    def _handle_jobs(self, dealer: zmq.Socket, heartbeat: HostHeartbeat | None = None) -> bool:
        """The jobs posted so far, in order; with `heartbeat` (the thread's loop), the core's outputs are read after
        each request added too, so a burst of slow ones (long prompts, images) does not hold back running streams."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return True
            if isinstance(job, Submit):
                self._adding = job
                self._add_request(dealer, job)
                self._adding = None
                if heartbeat is not None:
                    self._read_core(dealer, heartbeat)
            elif job[0] == "abort":
                if not self._holds_id(job[1], job[2]):
                    continue  # another request of this id (the duplicate was refused): not this abort's
                self._unpark(job[1])
                untracked = self._untrack(job[1])
                if untracked:
                    dealer.send(self._encoder.encode(protocol.AbortRequests([core_id for core_id, _ in untracked])))
                    now = time.time()
                    for _, tracked in untracked:
                        self._observer.on_aborted(tracked.collector, now)
            elif job[0] == "lora_checked":  # a parked request's adapter was checked
                self._resume(dealer, job[1])
            elif job[0] == "max_model_len":
                self._prompts.serve(job[1])
            elif job[0] == "reset_prefix_cache":
                dealer.send(self._encoder.encode(protocol.ResetPrefixCache()))
            elif job[0] == "send":  # a message that needs no bookkeeping here (UpdateWeights, Sleep, WakeUp)
                dealer.send(self._encoder.encode(job[1]))
            elif job[0] == "close":
                dealer.send(self._encoder.encode(protocol.Goodbye(shutdown=job[1])))
                self.said_goodbye = True
                self._fail_all(None)
                return False

    def _holds_id(self, request_id: str, collector: RequestCollector | None) -> bool:
        """Whether the request in flight here as `request_id` (parked or tracked) is `collector`'s (None: any)."""
        if collector is None:
            return True
        parked = self._parked.get(request_id)
        if parked is not None:
            return parked.collector is collector
        for core_id in self._samples.get(request_id, ()):
            tracked = self._tracked.get(core_id)
            if tracked is not None:
                return tracked.collector is collector
        return False

    def _lost_connection(self, dealer: zmq.Socket, when: str = "") -> BaseException | None:
        """The error that ends the engine if the connection to the core broke (the core's last word first; `when`:
        " while starting")."""
        assert self._watch is not None
        reason = self._watch.lost()
        if reason is None:
            return None
        while dealer.poll(0):  # an EngineFailed sent just before the core went away says more
            message = self._decoder.decode(dealer.recv())
            if isinstance(message, protocol.EngineFailed):
                return error_from(message)
        if self._core is not None:  # the kernel closes a dead core's socket a moment before its exit status is known
            return self._core.death(when, wait_s=_EXIT_STATUS_WAIT_S) or errors.EngineDeadError(
                f"{reason}{when}; the core process (pid {self._core.pid}) had not exited {_EXIT_STATUS_WAIT_S} s later "
                f"(engine address {self._address})")
        return errors.EngineDeadError(f"{reason}{when} (engine address {self._address})")

    def _core_died(self) -> bool:
        death = self._core.death() if self._core is not None else None
        if death is None:
            return False
        self._fail_all(death)
        return True
