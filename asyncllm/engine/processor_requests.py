"""`ProcessorRequests`: how the processor thread (asyncllm/engine/processor.py) adds a request to the core, a mixin:
its pooling, adapter (a new one checked off the thread first: asyncllm/engine/processor_lora.py), sampling and
vocabulary checks, its prompt as token ids (asyncllm/engine/prompt_tokens.py),
one core request per sample (n > 1) and the `AddRequest`s sent; a request that fails any of it fails alone."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from asyncllm import errors, protocol
from asyncllm.engine.collector import ACCEPTED, RequestCollector, StreamPacer
from asyncllm.engine.detokenizer import new_detokenizer
from asyncllm.engine.logprobs import PromptLogprobsBuffer
from asyncllm.engine.pooling_model import PoolingModel
from asyncllm.engine.processor_lora import ProcessorLoRA
from asyncllm.engine.processor_outputs import Deliver, TrackedRequest
from asyncllm.engine.prompt_embeds import embeds_salt
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.sample_groups import sample_ids
from asyncllm.engine.stream import RequestOptions
from asyncllm.engine.validation import (
    check_allowed_tokens,
    check_logprobs_limit,
    check_params_vocab,
    check_untokenized,
)
from asyncllm.lora import LoRARequest
from asyncllm.lora_checker import AdapterChecker
from asyncllm.metrics.observer import RequestObserver
from asyncllm.mm.inputs import MultiModalPrompt
from asyncllm.sampling import SamplingParams
from asyncllm.structured.start_after import with_start_after_ids
from asyncllm.tokenizer import bad_words_token_ids

__all__ = ["ProcessorRequests", "Submit", "sample_request_ids"]


@dataclass
class Submit:
    """A request the loop hands the processor thread (`Processor.submit`)."""

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
    lora_check: concurrent.futures.Future[LoRARequest] | None = None
    """The check of its adapter, new here, off the processor thread (asyncllm/engine/processor_lora.py)."""
    max_tokens_param: int | None = None
    """vLLM's ``max_tokens_param``, set once its prompt is read: the caller's max_tokens, or unset, what vLLM fills in
    (the served max_model_len less the prompt's tokens), before the served length may cut ``params``
    (`prompt_tokens.length_capped`): what ``request_params_max_tokens`` and its span record (None: ``params``')."""


class ProcessorRequests(ProcessorLoRA):
    """Mixin of `Processor`: a `Submit` checked, tokenized and sent to the core as one request per sample (its
    adapter's part, and the engine's LoRA calls: `ProcessorLoRA`)."""

    _tracked: dict[str, TrackedRequest]
    _samples: dict[str, list[str]]
    _submissions: Iterator[int]
    _encoder: Any
    _deliver: Deliver
    _observer: RequestObserver
    _prompts: PromptTokenizer
    _tokenizer: Any
    _eos_token_ids: list[int]
    _vocab_size: int
    _max_logprobs: int
    _hidden_size: int | None
    _lora: AdapterChecker | None
    _pooling_model: PoolingModel | None
    _stream_interval: int

    def _add_request(self, dealer: zmq.Socket, job: Submit) -> None:
        self._send_request(dealer, job)
        self._forget_idle_loras(dealer)

    def _send_request(self, dealer: zmq.Socket, job: Submit) -> None:
        collector = job.collector
        if collector.request_id in self._samples or collector.request_id in self._parked:
            self._reject(job, collector, errors.InvalidRequestError(
                "request_id", f"{collector.request_id!r} is already in flight"))
            return
        if self._park(job):  # its adapter is new here: checked off this thread first (`ProcessorLoRA`)
            return
        core_ids = sample_request_ids(collector.request_id, job.params.n, next(self._submissions))
        try:
            if self._pooling_model is not None:
                self._pooling_model.check(job.options.pooling)
                if job.options.pooling is not None:  # the model's pooling type and default normalize
                    pooling = self._pooling_model.apply(job.options.pooling)
                    job.options = dataclasses.replace(job.options, pooling=pooling)
            lora = self._checked_lora(job)
            if job.options.pooling is not None:
                job.options.pooling.validate(self._hidden_size)
            if self._tokenizer is None:
                check_untokenized(job.prompt, job.chat, job.params, job.options.text_pair)
            if job.params.bad_words:
                ids = bad_words_token_ids(self._tokenizer, job.params.bad_words, job.params.bad_words_token_ids)
                job.params = msgspec.structs.replace(job.params, bad_words_token_ids=ids)
            check_params_vocab(job.params, self._vocab_size)
            check_logprobs_limit(job.params, self._max_logprobs, self._vocab_size)
            check_allowed_tokens(job.params, self._eos_token_ids)
            asked = job.params.max_tokens  # the caller's: `token_ids` may cut job.params to the served length's room
            token_ids = self._prompts.token_ids(job)
            if job.options.fit_max_tokens:  # the server's unset max_tokens: vLLM's get_max_tokens, the cut value
                asked = job.params.max_tokens
            job.max_tokens_param = self._prompts.max_model_len - len(token_ids) if asked is None else asked
            job.params = with_start_after_ids(job.params, token_ids, self._tokenizer, self._vocab_size)
            if job.params.structured is not None:  # its JSON schema as text: msgpack carries no int beyond 64 bits
                job.params = msgspec.structs.replace(job.params, structured=job.params.structured.for_core())
        except Exception as exc:  # noqa: BLE001 - a request that cannot be tokenized fails alone, never the thread
            field, why = "messages" if job.chat else "prompt", f"could not be tokenized ({type(exc).__name__}: {exc})"
            self._reject(job, collector, exc if isinstance(exc, errors.InvalidRequestError)
                         else errors.InvalidRequestError(field, why))
            return
        collector.prompt_token_ids = token_ids
        options = job.options
        frames = []
        for index, core_id in enumerate(core_ids):  # n > 1: one core request per sample (see docs/sampling.md)
            params = job.params if len(core_ids) == 1 else job.params.for_sample(index)
            buffer = None if params.prompt_logprobs is None else PromptLogprobsBuffer(len(token_ids))
            try:
                detokenizer = new_detokenizer(self._tokenizer, token_ids, params, prime=job.embeds is None)
            except Exception as exc:  # noqa: BLE001 - options this tokenizer cannot stream fail the request alone
                self._reject(job, collector, errors.InvalidRequestError(
                    "request", f"its output cannot be detokenized ({type(exc).__name__}: {exc})"))
                return
            tracked = TrackedRequest(collector, detokenizer, index, buffer,
                                     cumulative_logprob=None if params.logprobs is None else 0.0,
                                     lora_int_id=0 if lora is None else lora.lora_int_id)
            if self._stream_interval > 1:
                tracked.pacer = StreamPacer(self._stream_interval)
            salt = options.cache_salt if job.embeds is None else embeds_salt(options.cache_salt, job.embeds)
            message = protocol.AddRequest(core_id, token_ids, params, self._eos_token_ids,
                                          collector.metrics.arrival_time, options.priority, salt,
                                          options.timeout, lora=lora, pooling=options.pooling,
                                          prompt_embeds=job.embeds, admission_group=options.admission_group,
                                          num_samples=0 if index else len(core_ids))  # sample 0 admits them all
            if job.mm_prompt is not None:
                message.mm_items = job.mm_prompt.items
                tracked.mm_resend, tracked.mm_uuids = (message, job.mm_prompt), job.mm_prompt.uuids
            try:
                frames.append((core_id, tracked, self._encoder.encode(message)))
            except Exception as exc:  # noqa: BLE001 - a value the wire cannot carry fails this request, not the thread
                self._reject(job, collector, errors.InvalidRequestError(
                    "request", f"cannot be sent to the engine core ({exc})"))
                return
        self._samples[collector.request_id] = list(core_ids)
        for core_id, tracked, frame in frames:
            self._tracked[core_id] = tracked
            dealer.send(frame)
        self._observer.on_added(job)
        if collector.accepted is not None:  # a server waits for it before its status line (`accepted_streams`)
            self._deliver([(collector, ACCEPTED)], None)

    def _reject(self, job: Submit, collector: RequestCollector, error: errors.InvalidRequestError) -> None:
        """The request fails alone with `error` (counted as rejected); the thread and the other requests go on."""
        self._observer.on_rejected(job, error, time.time())
        self._deliver([(collector, error)], None)


def sample_request_ids(request_id: str, n: int, submission: int) -> list[str]:
    """Core request ids of a request's samples: ``<id>#<submission>`` when n == 1, else ``<id>#<submission>-<i>``.
    `submission` numbers the host's submissions: an id used again right after its request was aborted names a new
    core request, so the old one's outputs still in flight are dropped, never given to the new one."""
    return sample_ids(f"{request_id}#{submission}", n)  # the core finds sample 0's siblings by them

