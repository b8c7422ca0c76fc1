"""The host's processor thread: everything CPU-bound stays off the event loop.

It owns the zmq DEALER connected to the engine core. Requests come in from the
loop through `submit`/`abort` (a queue plus an inproc doorbell); it tokenizes
them (chat templates included) and sends them to the core; it decodes the
core's outputs, detokenizes incrementally, matches stop strings (aborting the
request in the core), and hands one batch per core message to the loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np
import zmq

from asyncllm import errors, protocol
from asyncllm.engine.channel import ConnectionWatch, open_dealer
from asyncllm.engine.collector import RequestCollector, StreamPacer
from asyncllm.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly, new_detokenizer
from asyncllm.engine.launch import CoreProcess
from asyncllm.engine.logprobs import LogprobsDecoder, PromptLogprobsBuffer
from asyncllm.engine.pooling_model import PoolingModel
from asyncllm.engine.prompt_embeds import embeds_salt
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.stats_log import StatsLogger
from asyncllm.engine.stream import RequestOptions
from asyncllm.engine.sleep import PendingSleepCalls
from asyncllm.engine.weight_update import PendingWeightUpdates
from asyncllm.engine.validation import (
    check_allowed_tokens,
    check_logprobs_limit,
    check_params_vocab,
    check_untokenized,
)
from asyncllm.lora import AdapterChecker, LoRARequest
from asyncllm.structured.start_after import with_start_after_ids
from asyncllm.metrics.observer import RequestObserver
from asyncllm.outputs import StreamDelta
from asyncllm.sampling import MAX_LOGPROBS, SamplingParams
from asyncllm.mm.cache import CACHE_MISS_ERROR
from asyncllm.mm.host import resend_with_data
from asyncllm.mm.inputs import MultiModalPrompt
from asyncllm.mm.processor import MultiModalProcessor
from asyncllm.tokenizer import bad_words_token_ids

logger = logging.getLogger("asyncllm.engine")

Delivery = list[tuple[RequestCollector, "StreamDelta | BaseException"]]
Deliver = Callable[[Delivery, "protocol.SchedulerStats | None"], None]

_POLL_MS = 100


@dataclass
class Submit:
    collector: RequestCollector
    prompt: Any
    """str, list[int] of token ids, or chat messages when `chat`."""
    params: SamplingParams
    options: RequestOptions
    chat: bool = False
    trace_context: Any = None
    """The caller's OpenTelemetry context, captured on its task (None without OTel)."""
    mm_prompt: MultiModalPrompt | None = None
    """Set by tokenization for a prompt with images (asyncllm/mm/)."""
    embeds: protocol.PromptEmbeds | None = None
    """Set by tokenization for a prompt given as embeddings (asyncllm/engine/prompt_embeds.py)."""


@dataclass
class _Tracked:
    """One core request: the whole request when n == 1, else sample `index` of it."""

    collector: RequestCollector
    detokenizer: IncrementalDetokenizer | TokenIdsOnly
    index: int = 0
    prompt_logprobs: PromptLogprobsBuffer | None = None
    """Filled by prefill chunks; handed over with the first token."""
    mm_resend: tuple[protocol.AddRequest, MultiModalPrompt] | None = None
    """A request with images: what to resend if the core misses a processor-cache key."""
    pacer: StreamPacer | None = None
    """``stream_interval`` > 1: groups its deltas."""


class Processor:
    """Runs the processor thread; `start()` returns a future of the core's Ready."""

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
        self._tracked: dict[str, _Tracked] = {}
        """Core request id -> its state; an n > 1 request has n core requests ``<id>-<i>``."""
        self._samples: dict[str, list[str]] = {}
        """Request id -> the core request ids of its unfinished samples."""
        self._logprobs_decoder = LogprobsDecoder(tokenizer)
        self._weight_updates = PendingWeightUpdates()
        """`UpdateWeights` sent and not answered yet (asyncllm/engine/weight_update.py)."""
        self._sleep_calls = PendingSleepCalls()
        """`Sleep` / `WakeUp` sent and not answered yet (asyncllm/engine/sleep.py)."""
        self._ctx = zmq.Context()
        self._doorbell_address = f"inproc://asyncllm-doorbell-{uuid.uuid4().hex}"
        self._doorbell_pull = self._ctx.socket(zmq.PULL)
        self._doorbell_pull.bind(self._doorbell_address)
        self._doorbell = self._ctx.socket(zmq.PUSH)
        self._doorbell.connect(self._doorbell_address)
        self._doorbell_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(protocol.CoreMessage)
        self.ready: concurrent.futures.Future[protocol.Ready] = concurrent.futures.Future()
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncllm-processor", daemon=True)

    # ------------------------------------------------------------ loop side
    def start(self) -> concurrent.futures.Future:
        self._thread.start()
        return self.ready

    def submit(self, job: Submit) -> None:
        self._post(job)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def reset_prefix_cache(self) -> None:
        """Send `ResetPrefixCache` after every request submitted before (the jobs keep their order)."""
        self._post(("reset_prefix_cache",))

    def update_weights(self, message: protocol.UpdateWeights) -> concurrent.futures.Future[int]:
        """Send `UpdateWeights` (its update_id is set here) after every request submitted before; the future of
        the new weights version."""
        message.update_id, future = self._weight_updates.new()
        self._post(("send", message))
        if not self._thread.is_alive():  # it ended (its last act failed the updates then pending) or never began
            self._weight_updates.fail_all(self.dead or errors.EngineDeadError("the engine is not running"))
        return future

    def await_weights(self, weights_version: int) -> None:
        """Send `AwaitWeights` (before any request: call it as the core restarts)."""
        self._post(("send", protocol.AwaitWeights(weights_version)))

    def sleep_mode(self, message: protocol.Sleep | protocol.WakeUp) -> concurrent.futures.Future[int]:
        """Send `Sleep` or `WakeUp` (its call_id is set here) after every request submitted before; the future
        of the core's sleep level after it."""
        message.call_id, future = self._sleep_calls.new()
        self._post(("send", message))
        if not self._thread.is_alive():
            self._sleep_calls.fail_all(self.dead or errors.EngineDeadError("the engine is not running"))
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
        self._jobs.put(job)
        with self._doorbell_lock:
            if not self._doorbell.closed:
                self._doorbell.send(b"", zmq.NOBLOCK)

    # ------------------------------------------------------------ thread side
    def _run(self) -> None:
        dealer = open_dealer(self._ctx, self._address, self._engine_key)
        self._watch = watch = ConnectionWatch(dealer)
        try:
            ring = self._mm.open_cache() if self._mm is not None else ""  # the shm processor cache's segment
            dealer.send(self._encoder.encode(protocol.Hello(pid=os.getpid(), mm_shm_ring=ring)))
            if self._await_ready(dealer):
                self._serve(dealer)
        except BaseException as exc:  # noqa: BLE001 - never die silently: fail every stream
            logger.exception("asyncllm processor thread failed")
            if not self.ready.done():
                self.ready.set_exception(exc)
            self._fail_all(errors.EngineDeadError(f"processor thread failed: {exc}"))
        finally:
            self._weight_updates.fail_all(self.dead or errors.EngineDeadError("the engine was closed"))
            self._sleep_calls.fail_all(self.dead or errors.EngineDeadError("the engine was closed"))
            if self._mm is not None:
                self._mm.close_cache()
            watch.close()
            dealer.close(linger=0)
            self._doorbell_pull.close(linger=0)

    def _await_ready(self, dealer: zmq.Socket) -> bool:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if dealer.poll(_POLL_MS):
                message = self._decoder.decode(dealer.recv())
                if isinstance(message, protocol.Ready):
                    if self._mm is not None:
                        self._mm.cache_mapped(message.mm_shm_ring_mapped)
                    self._prompts.ready(message.max_model_len)
                    self.ready.set_result(message)
                    return True
                if isinstance(message, protocol.EngineFailed):
                    self.ready.set_exception(_error_from(message))
                    return False
            if self._core is not None and self._core.exit_code() is not None:
                code = self._core.exit_code()
                self.ready.set_exception(errors.EngineDeadError(f"engine core exited with code {code} while starting (its log is above)"))
                return False
            lost = self._lost_connection(dealer)
            if lost is not None:
                self.ready.set_exception(lost)
                return False
            if self._close_requested():
                self.ready.set_exception(errors.EngineDeadError("engine closed while starting"))
                return False
        self.ready.set_exception(errors.EngineDeadError(f"engine core not ready after {self._startup_timeout_s:.0f} s"))
        return False

    def _close_requested(self) -> bool:
        try:
            job = self._jobs.get_nowait()
        except queue.Empty:
            return False
        self._jobs.put(job)
        return isinstance(job, tuple) and job[0] == "close"

    def _serve(self, dealer: zmq.Socket) -> None:
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
                if not self._handle_jobs(dealer):
                    return
            if dealer in events:
                while dealer.poll(0):
                    self._on_core_message(dealer, dealer.recv())
            if self._core_died():
                return
            if self._watch.socket in events:
                lost = self._lost_connection(dealer)
                if lost is not None:
                    self._fail_all(lost)
                    return
            if self._stats_logger is not None:
                self._stats_logger.maybe_log()

    def _handle_jobs(self, dealer: zmq.Socket) -> bool:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return True
            if isinstance(job, Submit):
                self._add_request(dealer, job)
            elif job[0] == "abort":
                untracked = self._untrack(job[1])
                if untracked:
                    dealer.send(self._encoder.encode(protocol.AbortRequests([core_id for core_id, _ in untracked])))
                    now = time.time()
                    for _, tracked in untracked:
                        self._observer.on_aborted(tracked.collector, now)
            elif job[0] == "reset_prefix_cache":
                dealer.send(self._encoder.encode(protocol.ResetPrefixCache()))
            elif job[0] == "send":  # a message that needs no bookkeeping here (UpdateWeights, Sleep, WakeUp)
                dealer.send(self._encoder.encode(job[1]))
            elif job[0] == "close":
                dealer.send(self._encoder.encode(protocol.Goodbye(shutdown=job[1])))
                self._fail_all(None)
                return False

    def _untrack(self, request_id: str) -> list[tuple[str, _Tracked]]:
        """Forget every unfinished sample of a request; their (core id, state)."""
        untracked = []
        for core_id in self._samples.pop(request_id, ()):
            tracked = self._tracked.pop(core_id, None)
            if tracked is not None:
                untracked.append((core_id, tracked))
        return untracked

    def _add_request(self, dealer: zmq.Socket, job: Submit) -> None:
        collector = job.collector
        core_ids = sample_request_ids(collector.request_id, job.params.n)
        if collector.request_id in self._samples or any(core_id in self._tracked for core_id in core_ids):
            error = errors.InvalidRequestError("request_id", f"{collector.request_id!r} is already in flight")
            self._observer.on_rejected(collector, job.params, job.chat, job.trace_context, error, time.time())
            self._deliver([(collector, error)], None)
            return
        try:
            if self._pooling_model is not None:
                self._pooling_model.check(job.options.pooling)
                if job.options.pooling is not None:  # the model's pooling type and default normalize
                    pooling = self._pooling_model.apply(job.options.pooling)
                    job.options = dataclasses.replace(job.options, pooling=pooling)
            lora = self.check_lora(job.options.lora_request)
            if job.options.pooling is not None:
                job.options.pooling.validate(self._hidden_size)
            if self._tokenizer is None:
                check_untokenized(job.prompt, job.chat, job.params, job.options.text_pair)
            if job.params.bad_words:
                ids = job.params.bad_words_token_ids + bad_words_token_ids(self._tokenizer, job.params.bad_words)
                job.params = msgspec.structs.replace(job.params, bad_words_token_ids=ids)
            check_params_vocab(job.params, self._vocab_size)
            check_logprobs_limit(job.params, self._max_logprobs, self._vocab_size)
            check_allowed_tokens(job.params, self._eos_token_ids)
            token_ids = self._prompts.token_ids(job)
            job.params = with_start_after_ids(job.params, token_ids, self._tokenizer, self._vocab_size)
        except Exception as exc:  # noqa: BLE001 - a request that cannot be tokenized fails alone, never the thread
            error = exc if isinstance(exc, errors.InvalidRequestError) else errors.InvalidRequestError(
                "messages" if job.chat else "prompt", f"could not be tokenized ({type(exc).__name__}: {exc})")
            self._observer.on_rejected(collector, job.params, job.chat, job.trace_context, error, time.time())
            self._deliver([(collector, error)], None)
            return
        collector.prompt_token_ids = token_ids
        options = job.options
        frames = []
        for index, core_id in enumerate(core_ids):  # n > 1: one core request per sample (see docs/sampling.md)
            params = job.params if len(core_ids) == 1 else job.params.for_sample(index)
            buffer = None if params.prompt_logprobs is None else PromptLogprobsBuffer(len(token_ids))
            detokenizer = new_detokenizer(self._tokenizer, token_ids, params)
            tracked = _Tracked(collector, detokenizer, index, buffer)
            if self._stream_interval > 1:
                tracked.pacer = StreamPacer(self._stream_interval)
            salt = options.cache_salt if job.embeds is None else embeds_salt(options.cache_salt, job.embeds)
            message = protocol.AddRequest(core_id, token_ids, params, self._eos_token_ids,
                                          collector.metrics.arrival_time, options.priority, salt,
                                          options.timeout, lora=lora, pooling=options.pooling,
                                          prompt_embeds=job.embeds)
            if job.mm_prompt is not None:
                message.mm_items = job.mm_prompt.items
                tracked.mm_resend = (message, job.mm_prompt)
            try:
                frames.append((core_id, tracked, self._encoder.encode(message)))
            except Exception as exc:  # noqa: BLE001 - a value the wire cannot carry fails this request, not the thread
                error = errors.InvalidRequestError("request", f"cannot be sent to the engine core ({exc})")
                self._observer.on_rejected(collector, job.params, job.chat, job.trace_context, error, time.time())
                self._deliver([(collector, error)], None)
                return
        self._samples[collector.request_id] = list(core_ids)
        for core_id, tracked, frame in frames:
            self._tracked[core_id] = tracked
            dealer.send(frame)
        self._observer.on_added(collector, job.params, job.chat, job.trace_context)

    def check_lora(self, request: LoRARequest | None) -> LoRARequest | None:
        """The request's adapter with a local folder, checked against the model (once per adapter id;
        thread-safe: `AsyncEngine.add_lora` calls it from another thread)."""
        if request is None:
            return None
        if self._lora is None:
            raise errors.InvalidRequestError("lora_request", "this engine serves no LoRA adapters: "
                                                             "start it with enable_lora=True")
        return self._lora.check(request)

    def _on_core_message(self, dealer: zmq.Socket, payload: bytes) -> None:
        message = self._decoder.decode(payload)
        if isinstance(message, protocol.EngineFailed):
            self._fail_all(_error_from(message))
            return
        if isinstance(message, protocol.WeightsUpdated):
            self._weight_updates.resolve(message)
            return
        if isinstance(message, protocol.SleepModeDone):
            self._sleep_calls.resolve(message)
            return
        if not isinstance(message, protocol.Outputs):
            return
        now = time.time()
        batch: Delivery = []
        aborts: list[str] = []
        for out in message.outputs:
            self._on_delta(dealer, out, now, batch, aborts)
        for req_id, token in zip(message.token_req_ids, message.token_ids):
            self._on_delta(dealer, protocol.RequestOutputDelta(req_id, [token]), now, batch, aborts)
        if aborts:
            dealer.send(self._encoder.encode(protocol.AbortRequests(aborts)))
        if message.stats is not None:
            self._observer.on_scheduler_stats(message.stats, message.stats_reporter)
        if batch or message.stats is not None:
            self._deliver(batch, message.stats)

    def _on_delta(self, dealer: zmq.Socket, out: protocol.RequestOutputDelta, now: float, batch: Delivery,
                  aborts: list[str]) -> None:
        """One request's output: into `batch` for the loop (and its id into `aborts` when a stop string ended it)."""
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        if tracked.mm_resend is not None:
            resend, tracked.mm_resend = tracked.mm_resend, None  # any answer means the core has the items
            if out.error_type == CACHE_MISS_ERROR and self._mm is not None:
                try:
                    dealer.send(self._encoder.encode(resend_with_data(self._mm, *resend)))  # all data: no second miss
                    return
                except errors.InvalidRequestError as exc:  # an image that cannot be read again fails its request
                    out = msgspec.structs.replace(out, error=str(exc), error_type=type(exc).__name__)
        item = self._process_output(tracked, out, now, aborts)
        if item is None:
            return  # prompt logprobs of a prefill chunk: they go out with the first token
        self._observer.on_output(tracked.collector, out, item, now)
        if isinstance(item, StreamDelta) and tracked.pacer is not None:
            item = tracked.pacer.offer(item)
            if item is None:
                return
        batch.append((tracked.collector, item))

    def _process_output(self, tracked: _Tracked, out: protocol.RequestOutputDelta, now: float,
                        aborts: list[str]) -> StreamDelta | BaseException | None:
        collector = tracked.collector
        if out.error is not None:
            aborts.extend(core_id for core_id, _ in self._untrack(collector.request_id) if core_id != out.request_id)
            return _request_error(out.error_type, out.error)
        if out.prompt_logprobs is not None and tracked.prompt_logprobs is not None:
            tracked.prompt_logprobs.add(out.prompt_logprobs, self._logprobs_decoder, tracked.detokenizer.decodes)
        if not out.new_token_ids and out.finish_reason is None:
            return None
        if out.embedding is not None:
            collector.embedding = np.frombuffer(out.embedding, dtype="<f4").tolist()
        metrics = collector.metrics
        if out.new_token_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
            collector.num_cached_tokens = out.num_cached_tokens
        metrics.num_generated_tokens += len(out.new_token_ids)
        finished = out.finish_reason is not None
        detokenizer = tracked.detokenizer
        num_before = len(detokenizer.token_ids)
        # the core finishes "stop" on an EOS or stop_token_ids token only (stop strings are found here)
        update = detokenizer.update(out.new_token_ids, finished, stop_terminated=out.finish_reason == "stop")
        token_ids = detokenizer.token_ids[num_before:]
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if update.stop_string is not None:
            finish_reason, stop_reason = "stop", update.stop_string
            if not finished:
                aborts.append(out.request_id)
        delta = StreamDelta(tracked.index, update.text, token_ids, finish_reason, stop_reason)
        if out.logprobs is not None:
            delta.logprobs = self._logprobs_decoder.decode(out.logprobs, detokenizer.decodes)[: len(token_ids)]
        if tracked.prompt_logprobs is not None:
            delta.prompt_logprobs = collector.prompt_logprobs = tracked.prompt_logprobs.entries
            tracked.prompt_logprobs = None
        if finish_reason is not None:
            del self._tracked[out.request_id]
            if self._sample_finished(collector.request_id, out.request_id):
                metrics.finished_time = now
        return delta

    def _sample_finished(self, request_id: str, core_id: str) -> bool:
        """Count one sample of a request as finished; True when it was the last one."""
        unfinished = self._samples.get(request_id)
        if unfinished is None:
            return True
        unfinished.remove(core_id)
        if unfinished:
            return False
        del self._samples[request_id]
        return True

    def _lost_connection(self, dealer: zmq.Socket) -> BaseException | None:
        """The error that ends the engine if the connection to the core broke (the core's last word first)."""
        assert self._watch is not None
        reason = self._watch.lost()
        if reason is None:
            return None
        while dealer.poll(0):  # an EngineFailed sent just before the core went away says more
            message = self._decoder.decode(dealer.recv())
            if isinstance(message, protocol.EngineFailed):
                return _error_from(message)
        return errors.EngineDeadError(f"{reason} (engine address {self._address})")

    def _core_died(self) -> bool:
        if self._core is None or self._core.exit_code() is None:
            return False
        self._fail_all(errors.EngineDeadError(f"engine core exited with code {self._core.exit_code()}"))
        return True

    def _fail_all(self, error: BaseException | None) -> None:
        """End every tracked request: with `error`, or as aborted when None."""
        if error is not None:
            self.dead = error
        self._weight_updates.fail_all(error or errors.EngineDeadError("the engine was closed"))
        self._sleep_calls.fail_all(error or errors.EngineDeadError("the engine was closed"))
        batch: Delivery = []
        now = time.time()
        for tracked in self._tracked.values():
            item = error if error is not None else StreamDelta(tracked.index, "", [], "abort")
            batch.append((tracked.collector, item))
            if error is not None:  # once per sample: the observer counts samples, ends a span once
                self._observer.on_error(tracked.collector, error, now)
            else:
                self._observer.on_aborted(tracked.collector, now)
        self._tracked.clear()
        self._samples.clear()
        if batch or error is not None:
            self._deliver(batch, None)


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """Core request ids of a request's samples: the id itself when n == 1, else ``<id>-<i>``."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def _request_error(error_type: str, text: str) -> BaseException:
    """Rebuild the typed error the core reported for one request."""
    if error_type == "EngineOverloadedError":
        return errors.EngineOverloadedError(text)
    field, _, detail = text.partition(": ")
    return errors.InvalidRequestError(field, detail)


def _error_from(message: protocol.EngineFailed) -> BaseException:
    config_error = protocol.config_error_from_parts(message.config_error)
    return config_error if config_error is not None else errors.EngineDeadError(message.message)


