"""`ProcessorOutputs`: how the processor thread (asyncllm/engine/processor.py) turns the core's messages into
deliveries for the loop, a mixin: each request's new tokens detokenized incrementally, stop strings matched (the
request aborted in the core), logprobs decoded, a sample's end counted, a processor-cache miss answered with the
items' data, the core's errors rebuilt as typed ones, every request ended at once (a dead core, a close)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import numpy as np
import zmq

from asyncllm import errors, protocol
from asyncllm.engine.collector import Accepted, RequestCollector, StreamPacer
from asyncllm.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly
from asyncllm.engine.logprobs import LogprobsDecoder, PromptLogprobsBuffer, text_context
from asyncllm.engine.lora_ids import PendingLoRACalls
from asyncllm.engine.sleep import PendingSleepCalls
from asyncllm.engine.weight_update import PendingWeightUpdates
from asyncllm.metrics.observer import RequestObserver
from asyncllm.mm.cache import CACHE_MISS_ERROR
from asyncllm.mm.host import resend_with_data
from asyncllm.mm.inputs import MultiModalPrompt, uuid_error
from asyncllm.mm.processor import MultiModalProcessor
from asyncllm.outputs import StreamDelta

__all__ = ["Deliver", "Delivery", "ProcessorOutputs", "TrackedRequest", "error_from"]

Delivery = list[tuple[RequestCollector, "StreamDelta | BaseException | Accepted"]]
Deliver = Callable[[Delivery, "protocol.SchedulerStats | None"], None]


@dataclass
class TrackedRequest:
    """One core request: the whole request when n == 1, else sample `index` of it."""

    collector: RequestCollector
    detokenizer: IncrementalDetokenizer | TokenIdsOnly
    index: int = 0
    prompt_logprobs: PromptLogprobsBuffer | None = None
    """Filled by prefill chunks; handed over with the first token."""
    mm_resend: tuple[protocol.AddRequest, MultiModalPrompt] | None = None
    """A request with images: what to resend if the core misses a processor-cache key."""
    mm_uuids: list[tuple[str, str] | None] | None = None
    """A request with images: `MultiModalPrompt.uuids`, which name its workers' errors of uuid-keyed items."""
    pacer: StreamPacer | None = None
    """``stream_interval`` > 1: groups its deltas."""
    cumulative_logprob: float | None = None
    """With logprobs (0.0 from the start): the sum of the sample's token logprobs delivered so far (vLLM's)."""
    is_prefilling: bool = True
    """No token of this sample out yet (vLLM's RequestState.is_prefilling): its first counts the prompt's tokens."""
    num_delivered: int = 0
    """How many of the detokenizer's `token_ids` went out: those up to its `num_final` (a stop string may yet drop
    the others)."""
    held_logprobs: list[Any] | None = None
    """With logprobs: the entries of the ids consumed but not delivered yet, in order."""
    lora_int_id: int = 0
    """Its adapter's id (0: none): an id in flight stays checked (`AdapterChecker.forget_idle`)."""


class ProcessorOutputs:
    """Mixin of `Processor`: the core's messages, each request's output as a `StreamDelta` or its error."""

    _tracked: dict[str, TrackedRequest]
    _samples: dict[str, list[str]]
    _ending: list[RequestCollector]
    _mm: MultiModalProcessor | None
    _encoder: Any
    _decoder: Any
    _deliver: Deliver
    _observer: RequestObserver
    _logprobs_decoder: LogprobsDecoder
    _weight_updates: PendingWeightUpdates
    _sleep_calls: PendingSleepCalls
    _lora_calls: PendingLoRACalls
    dead: BaseException | None

    if TYPE_CHECKING:
        def _end_parked(self, error: BaseException | None) -> Delivery: ...

    def _untrack(self, request_id: str) -> list[tuple[str, TrackedRequest]]:
        """Forget every unfinished sample of a request; their (core id, state)."""
        untracked = []
        for core_id in self._samples.pop(request_id, ()):
            tracked = self._tracked.pop(core_id, None)
            if tracked is not None:
                untracked.append((core_id, tracked))
        return untracked

    def _fail_all(self, error: BaseException | None) -> None:
        """End every tracked (and parked: `ProcessorLoRA`) request: with `error`, or as aborted when None."""
        if error is not None and self.dead is None:  # the first word is the best: EngineFailed before the exit code
            self.dead = error
        self._weight_updates.fail_all(error or errors.EngineDeadError("the engine was closed"))
        self._sleep_calls.fail_all(error or errors.EngineDeadError("the engine was closed"))
        self._lora_calls.fail_all(error or errors.EngineDeadError("the engine was closed"))
        batch: Delivery = []
        now = time.time()
        for tracked in self._tracked.values():
            item = error if error is not None else StreamDelta(tracked.index, "", [], "abort",
                                                               cumulative_logprob=tracked.cumulative_logprob)
            if tracked.pacer is not None and error is None:  # with the tokens stream_interval held back
                item = tracked.pacer.offer(item)
            batch.append((tracked.collector, item))
            if error is not None:  # once per sample: the observer counts samples, ends a span once
                self._observer.on_error(tracked.collector, error, now)
            else:
                self._observer.on_aborted(tracked.collector, now)
        if error is not None:
            batch.extend((collector, error) for collector in self._ending)
        batch.extend(self._end_parked(error))  # requests waiting for their adapter's check (`ProcessorLoRA`)
        self._ending.clear()
        self._tracked.clear()
        self._samples.clear()
        if batch or error is not None:
            self._deliver(batch, None)

    def _on_core_message(self, dealer: zmq.Socket, payload: bytes) -> None:
        message = self._decoder.decode(payload)
        if isinstance(message, protocol.EngineFailed):
            self._fail_all(error_from(message))
            return
        if isinstance(message, protocol.WeightsUpdated):
            self._weight_updates.resolve(message)
            return
        if isinstance(message, protocol.SleepModeDone):
            self._sleep_calls.resolve(message)
            return
        if isinstance(message, (protocol.LoRAAdded, protocol.LoRARemoved, protocol.LoRAPinned)):
            self._lora_calls.resolve(message)
            return
        if not isinstance(message, protocol.Outputs):
            return
        now = time.time()
        batch: Delivery = []
        aborts: list[str] = []
        tokens_before = self._observer.on_step_start()
        for out in message.outputs:
            self._on_delta(dealer, out, now, batch, aborts)
        for req_id, token in zip(message.token_req_ids, message.token_ids):
            self._on_delta(dealer, protocol.RequestOutputDelta(req_id, [token]), now, batch, aborts)
        self._observer.on_step_end(tokens_before)  # vLLM's iteration_tokens_total: one observation per step
        if aborts:
            dealer.send(self._encoder.encode(protocol.AbortRequests(aborts)))
        if message.stats is not None:
            self._observer.on_scheduler_stats(message.stats, message.stats_reporter)
        if batch or message.stats is not None:
            self._deliver(batch, message.stats)
        self._ending.clear()

    def _on_delta(self, dealer: zmq.Socket, out: protocol.RequestOutputDelta, now: float, batch: Delivery,
                  aborts: list[str]) -> None:
        """One request's output: into `batch` for the loop (and its id into `aborts` when a stop string ended it or
        its resend after a processor-cache miss failed)."""
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        if tracked.mm_resend is not None:
            resend, tracked.mm_resend = tracked.mm_resend, None  # any answer means the core has the items
            if out.error_type == CACHE_MISS_ERROR and self._mm is not None:
                try:
                    dealer.send(self._encoder.encode(resend_with_data(self._mm, *resend)))  # all data: no second miss
                    return
                except Exception as exc:  # noqa: BLE001 - an image that cannot be read again fails its request alone
                    failed = exc if isinstance(exc, errors.InvalidRequestError) else errors.InvalidRequestError(
                        "prompt", f"its media could not be sent again ({type(exc).__name__}: {exc})")
                    out = msgspec.structs.replace(out, error=str(failed), error_type=type(failed).__name__)
                    aborts.append(out.request_id)  # the core keeps an n > 1 sample 0's miss until it is aborted
        is_prefilling, tracked.is_prefilling = tracked.is_prefilling, tracked.is_prefilling and not out.new_token_ids
        item = self._process_output(tracked, out, now, aborts)
        if item is None:
            return  # prompt logprobs of a prefill chunk: they go out with the first token
        self._observer.on_output(tracked.collector, out, item, now, is_prefilling)
        if isinstance(item, StreamDelta) and tracked.pacer is not None:
            item = tracked.pacer.offer(item)
            if item is None:
                return
        batch.append((tracked.collector, item))

    def _process_output(self, tracked: TrackedRequest, out: protocol.RequestOutputDelta, now: float,
                        aborts: list[str]) -> StreamDelta | BaseException | None:
        collector = tracked.collector
        if out.error is not None:
            self._ending.append(collector)
            aborts.extend(core_id for core_id, _ in self._untrack(collector.request_id) if core_id != out.request_id)
            return _request_error(out.error_type, out.error, tracked.mm_uuids)
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
        # the tokens before this delta's, which its logprobs' text needs (taken before the update appends)
        preceding = text_context(detokenizer.token_ids) if out.logprobs is not None else ()
        # the core finishes "stop" on an EOS or stop_token_ids token only (stop strings are found here)
        update = detokenizer.update(out.new_token_ids, finished, stop_terminated=out.finish_reason == "stop")
        token_ids = detokenizer.token_ids[tracked.num_delivered:detokenizer.num_final]
        tracked.num_delivered += len(token_ids)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if update.stop_string is not None:
            finish_reason, stop_reason = "stop", update.stop_string
            if not finished:
                aborts.append(out.request_id)
        delta = StreamDelta(tracked.index, update.text, token_ids, finish_reason, stop_reason)
        if out.logprobs is not None or tracked.held_logprobs:  # held rows go out with their tokens (an empty delta's)
            entries = tracked.held_logprobs or []
            if out.logprobs is not None:
                entries = entries + self._logprobs_decoder.decode(out.logprobs, detokenizer.decodes, preceding)
            delta.logprobs, tracked.held_logprobs = entries[: len(token_ids)], entries[len(token_ids):]
            tracked.cumulative_logprob = (tracked.cumulative_logprob or 0.0) + sum(
                entry[token].logprob for token, entry in zip(token_ids, delta.logprobs))
        delta.cumulative_logprob = tracked.cumulative_logprob
        if tracked.prompt_logprobs is not None:
            delta.prompt_logprobs = collector.prompt_logprobs = tracked.prompt_logprobs.entries
            tracked.prompt_logprobs = None
        if finish_reason is not None:
            del self._tracked[out.request_id]
            self._ending.append(collector)
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


def _request_error(error_type: str, text: str, mm_uuids: list[tuple[str, str] | None] | None = None) -> BaseException:
    """Rebuild the typed error the core reported for one request (one of a uuid-keyed item named by `uuid_error`)."""
    if error_type == "EngineOverloadedError":
        return errors.EngineOverloadedError(text)
    if error_type == "EngineDeadError":  # a core that does not know this host (core.py `_handle`)
        return errors.EngineDeadError(text)
    field, _, detail = text.partition(": ")
    return errors.InvalidRequestError(*uuid_error(field, detail, mm_uuids or []))


def error_from(message: protocol.EngineFailed) -> BaseException:
    """The error an `EngineFailed` reports: its config error, else the engine is dead."""
    config_error = protocol.config_error_from_parts(message.config_error, error_type=message.error_type)
    return config_error if config_error is not None else errors.EngineDeadError(message.message)

