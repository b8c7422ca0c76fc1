"""`AsyncEngine`: the engine as the host application's event loop sees it."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Mapping

import anyio
import msgspec

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.admission import HostAdmission
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.data_parallel import replica_devices
from asyncllm.engine.launch import CoreProcess
from asyncllm.engine.pooling_model import PoolingModel
from asyncllm.engine.processor import Delivery, Processor, Submit
from asyncllm.engine.replica import LaunchSpec, Replica, ReplicaSet, start_replica, start_replicas, stop_replicas
from asyncllm.engine.stream import RequestOptions, RequestStream, check_prompt
from asyncllm.engine.supervisor import CoreSupervisor
from asyncllm.engine.sleep import check_level, check_tags
from asyncllm.engine.engine_weights import EngineWeights, every_replica
from asyncllm.engine.weight_update import new_checkpoint_config
from asyncllm.engine.validation import MAX_REQUEST_ID_CHARS, check_params_text, check_text
from asyncllm.metrics.observer import RequestObserver
from asyncllm.metrics.tracing import capture_context
from asyncllm.errors import AsyncLLMError, EngineDeadError, InvalidRequestError, NotBuiltError
from asyncllm.lora import LoRARequest
from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingParams, ScoringOutput
from asyncllm.beam_search import BeamSearchOutput, BeamSearchParams
from asyncllm.outputs import CompletionOutput, EngineStats, RequestOutput
from asyncllm.sampling import RequestOutputKind, SamplingParams
from asyncllm.speech import SpeechToText, speech_to_text_of, transcribe, transcribe_segments
from asyncllm.speech_segments import Segment

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncEngine"]


class AsyncEngine:
    """An LLM engine embedded in the host's asyncio event loop.

    Constructing it is cheap and starts nothing; ``async with engine``,
    ``await engine.start()`` or the first request starts the engine core and
    its workers. Every `EngineConfig` field is accepted as a keyword.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model`: a local folder or hub id; None serves the bundled tiny model (no download)."""
        if model is None:
            from asyncllm.bundled import bundled_model_path

            model = bundled_model_path()
        self._init(EngineConfig.create(model, **kwargs))

    @classmethod
    def connect(cls, address: str | None = None, *, key: str | None = None, **kwargs: Any) -> "AsyncEngine":
        """An engine attached to a running core (``asyncllm engine MODEL --address ipc:///...``;
        no address: the default one of ``asyncllm engine``).

        Cheap like the constructor: the first request (or `start`) asks the core
        which model it serves and loads the tokenizer. `kwargs` are the host-side
        fields (disable_log_stats, prometheus_registry, ...); `aclose` detaches
        and leaves the core running for the other hosts. A ``tcp://`` address
        needs the core's shared secret: `key`, or ASYNCLLM_ENGINE_KEY (docs/security.md).
        """
        from asyncllm.auth import resolve_key
        from asyncllm.engine.connect import check_address, default_address

        address = check_address(default_address() if address is None else address, key)
        engine = cls(address, **kwargs)  # the address stands in for the model until start
        if engine.config.data_parallel_size > 1:
            raise NotBuiltError("data_parallel_size", engine.config.data_parallel_size,
                                "data parallelism over a shared engine core (AsyncEngine.connect, `asyncllm engine`)")
        engine._connect_address = address
        engine._engine_key = resolve_key(address, key)
        return engine

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        engine = cls.__new__(cls)
        engine._init(config)
        return engine

    def _init(self, config: EngineConfig) -> None:
        self.config = config
        self._connect_address: str | None = None
        """Set by `connect`: attach to this core instead of starting one."""
        self._engine_key: str | None = None
        """The shared secret of a tcp:// `_connect_address` (never logged, never in the config)."""
        self._weights = EngineWeights()
        """Weight updates on every replica, and the last one for a restarted core."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None
        self._observer = RequestObserver(config.model, config.prometheus_registry)
        """Replica 0's observer (the only one with data_parallel_size 1)."""
        self.metrics_registry = self._observer.registry
        """The prometheus_client CollectorRegistry holding this engine's `asyncllm:` series."""
        self._replicas = ReplicaSet([self._new_replica(i) for i in range(config.data_parallel_size)])
        """One per data-parallel replica: its core, processor thread, observer, supervisor (asyncllm/engine/replica.py)."""
        self._started = False
        self._closed = False
        self._draining = False
        self._in_flight: weakref.WeakSet[RequestCollector] = weakref.WeakSet()
        """Collectors of submitted requests (for `aclose(drain=True)`); a dropped stream drops out."""
        self._default_sampling: dict[str, Any] | None = None
        """SamplingParams fields of requests without SamplingParams (the model's generation config), set by start."""
        self.pooling_model: PoolingModel | None = None
        """What the model serves (generation, embeddings, classification) and a classifier's labels, set by start
        (asyncllm/engine/pooling_model.py)."""
        self.speech_to_text: SpeechToText | None = None
        """A speech-to-text model's audio rate, window and task tokens (Whisper: asyncllm/speech.py), set by start;
        None for the others."""

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _new_replica(self, index: int) -> Replica:
        config = self.config
        observer = self._observer if index == 0 else RequestObserver(config.model, self.metrics_registry)
        if config.data_parallel_size > 1:
            observer.stats.engine_index = index  # Prometheus labels its engine-wide series engine="<index>"
        admission = HostAdmission(config.max_num_queued_requests, config.max_num_queued_tokens)
        name = "engine core" if config.data_parallel_size == 1 else f"engine core {index}"
        supervisor = CoreSupervisor(config.max_core_restarts, lambda: self._restart_replica(index), name)
        return Replica(index, observer, admission, supervisor)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def _processor(self) -> Processor | None:
        """Replica 0's processor thread (the engine's only one with data_parallel_size 1)."""
        return self._replicas[0].processor

    @property
    def _core(self) -> CoreProcess | None:
        """Replica 0's engine-core process (None when attached to a shared core)."""
        return self._replicas[0].core

    async def start(self) -> None:
        """Start the engine core(s) and their workers; returns once they serve."""
        if self._closed:
            raise EngineDeadError("this AsyncEngine was closed; create a new one")
        if self._started:
            return  # (a replica's core restart does not hold up requests to the others)
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self._started:
                await self._start()

    def _launch_spec(self) -> LaunchSpec:
        return LaunchSpec(self._deliver_threadsafe, self._connect_address, self._engine_key,
                          replica_devices(self.config))

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        prepared = await start_replicas(self._replicas.replicas, self.config, self._launch_spec())
        self.config = prepared.config
        self.pooling_model = prepared.pooling_model
        self._default_sampling = prepared.default_sampling
        self.tokenizer = prepared.tokenizer
        self.speech_to_text = speech_to_text_of(prepared.mm, prepared.generation_config, prepared.vocab_size)
        self.eos_token_ids: list[int] = list(prepared.eos_token_ids)
        """The tokenizer's and generation_config's EOS ids (known once started)."""
        self._started = True

    async def aclose(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the engine core(s) and their workers; free every process, socket and shared-memory segment.

        ``drain=False`` aborts what is in flight (open streams end with
        finish_reason "abort"). ``drain=True`` first refuses new requests
        (`EngineDeadError`) and waits until every submitted request finished,
        at most `timeout` seconds (None: no limit); the rest is then aborted.
        """
        if drain and not self._closed and self._started:
            self._draining = True
            await self._wait_drained(timeout)
        self._closed = True
        with anyio.CancelScope(shield=True):
            for replica in self._replicas:  # a half-done core restart must finish before its processes can be stopped
                await replica.supervisor.wait()
        if self._started:
            self._started = False
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stop_replicas, self._replicas.replicas)
            for replica in self._replicas:
                replica.processor = replica.core = None
                replica.observer.on_closed()

    async def _wait_drained(self, timeout: float | None) -> None:
        with anyio.move_on_after(timeout):
            while any(not collector.finished for collector in list(self._in_flight)):
                if not self._replicas.any_alive:
                    return  # nothing more will finish
                await asyncio.sleep(0.01)

    async def _restart_replica(self, index: int) -> None:
        """A replica's supervisor's restart: stop its dead processor thread and core, start new ones."""
        replica = self._replicas[index]
        processor = replica.processor
        if self._closed or processor is None:
            return
        await anyio.to_thread.run_sync(replica.stop)
        replica.processor = replica.core = None
        owned = self._connect_address is None  # a shared core's weights are its own: nothing to restore
        config = self._weights.restart_config(self.config) if owned else self.config
        try:
            await start_replica(replica, config, self._launch_spec())
        except BaseException:
            replica.processor = processor  # still dead: stats() and new requests say so
            raise
        if owned:  # sent now, before any request can reach the new core
            await self._weights.replay(replica)

    # ------------------------------------------------------------ requests
    def stream(self, prompt: Any, params: SamplingParams | None = None, *, priority: int = 0,
               request_id: str | None = None, timeout: float | None = None,
               cache_salt: str | None = None, lora_request: LoRARequest | None = None,
               data_parallel_rank: int | None = None) -> RequestStream:
        """Stream `StreamDelta`s of one completion; leaving the loop aborts it.

        `lora_request` runs it with a LoRA adapter (enable_lora; docs/lora.md); `data_parallel_rank` on that
        replica (data_parallel_size > 1; default: the least loaded)."""
        options = RequestOptions(priority, request_id, timeout, cache_salt, lora_request=lora_request,
                                 data_parallel_rank=data_parallel_rank)
        return RequestStream(self, prompt, _checked_params(params), options, chat=False)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, priority: int = 0,
             request_id: str | None = None, timeout: float | None = None,
             cache_salt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
             lora_request: LoRARequest | None = None, data_parallel_rank: int | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> RequestStream:
        """Stream a reply to chat `messages`, formatted by the tokenizer's chat template.

        `chat_template_kwargs` are variables for the template, as in
        transformers' ``apply_chat_template`` (``{"enable_thinking": False}``
        for Qwen3; ``{"add_generation_prompt": False}`` to continue the last message).
        `tools` are OpenAI function tools for the template; the reply's text
        holds the calls in the model's format (`asyncllm.tool_calls` parses them).
        `chat_template` (Jinja) replaces the tokenizer's template for this request; `mm_processor_kwargs` (vLLM's)
        the image processor's settings for its images (over the engine's; docs/multimodal.md).
        """
        options = RequestOptions(priority, request_id, timeout, cache_salt, chat_template_kwargs, tools, chat_template,
                                 lora_request, data_parallel_rank=data_parallel_rank,
                                 mm_processor_kwargs=mm_processor_kwargs)
        return RequestStream(self, messages, _checked_params(params), options, chat=True)

    async def generate(self, prompt: Any, params: SamplingParams | None = None, **options: Any) -> RequestOutput:
        """Run one request to the end and return it whole, every sample in `.outputs` (options as for `stream`).

        `params.output_kind` does not apply: samples are collected whole on the
        host (FINAL_ONLY), so the caller's task wakes once per sample.
        """
        if _checked_params(params) is None:
            await self.start()
            params = self.default_sampling_params()
        if params.output_kind != RequestOutputKind.FINAL_ONLY:
            params = msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        stream = self.stream(prompt, params, **options)
        outputs: dict[int, CompletionOutput] = {}
        async with stream:
            async for delta in stream:
                outputs[delta.index] = CompletionOutput(delta.index, delta.text, delta.token_ids, delta.finish_reason,
                                                        delta.stop_reason, delta.logprobs)
        collector = stream.collector
        assert collector is not None and len(outputs) == collector.num_samples, (len(outputs), collector)
        return RequestOutput(collector.request_id, prompt if isinstance(prompt, str) else None,
                             collector.prompt_token_ids, [outputs[i] for i in sorted(outputs)], collector.metrics,
                             collector.num_cached_tokens, prompt_logprobs=collector.prompt_logprobs)

    async def embed(self, prompt: Any, pooling_params: PoolingParams | None = None, *, priority: int = 0,
                    request_id: str | None = None, timeout: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None,
                    truncate_prompt_tokens: int | None = None, data_parallel_rank: int | None = None) -> EmbeddingOutput:
        """The embedding of a prompt (text or token ids): its last token's final hidden state (or the model's
        MEAN / CLS pooling, ``pooler_config``), normalized unless `pooling_params` says otherwise
        (docs/embeddings.md). It is scheduled like any request (one prefill and one dropped token), so
        embeddings and generations share batches."""
        pooling = PoolingParams() if pooling_params is None else pooling_params
        options = RequestOptions(priority, request_id, timeout, cache_salt, lora_request=lora_request, pooling=pooling,
                                 data_parallel_rank=data_parallel_rank)
        collector = await self._pool(prompt, options, truncate_prompt_tokens)
        return EmbeddingOutput(collector.request_id, collector.prompt_token_ids, collector.embedding,
                               collector.metrics, collector.num_cached_tokens)

    async def classify(self, prompt: Any, *, priority: int = 0, request_id: str | None = None,
                       timeout: float | None = None, cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None,
                       truncate_prompt_tokens: int | None = None,
                       data_parallel_rank: int | None = None) -> ClassificationOutput:
        """A ``*ForSequenceClassification`` model's verdict on a prompt (text or token ids): its score head's
        logits over the last token, the probabilities (softmax; sigmoid for one label) and the top label's
        name (docs/pooling.md). Scheduled as `embed` is; any other model refuses it."""
        from asyncllm.engine.scoring import classify

        options = RequestOptions(priority, request_id, timeout, cache_salt, lora_request=lora_request,
                                 data_parallel_rank=data_parallel_rank)
        return await classify(self, prompt, options, truncate_prompt_tokens)

    async def score(self, text_1: str | list[str], text_2: str | list[str], *, priority: int = 0,
                    timeout: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None,
                    truncate_prompt_tokens: int | None = None) -> list[ScoringOutput]:
        """vLLM's ``LLM.score``: how well each text of `text_2` matches `text_1` (one text for all, 1:N; or
        one per text, N:N), one `ScoringOutput` per pair in `text_2`'s order. A cross-encoder (a classifier
        with one label) reads each pair as one prompt (sigmoid of its logit); any other model scores the
        cosine similarity of the two embeddings (docs/pooling.md)."""
        from asyncllm.engine.scoring import score

        options = RequestOptions(priority, None, timeout, cache_salt, lora_request=lora_request)
        return await score(self, text_1, text_2, options, truncate_prompt_tokens)

    async def _pool(self, prompt: Any, options: RequestOptions, truncate_prompt_tokens: int | None) -> RequestCollector:
        """Run a pooling request (`options.pooling` set) to its end; its collector holds the pooled vector."""
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY,
                                truncate_prompt_tokens=truncate_prompt_tokens)
        stream = RequestStream(self, prompt, params, options, chat=False)
        async with stream:
            async for _ in stream:
                pass
        collector = stream.collector
        assert collector is not None and collector.embedding is not None, collector
        return collector

    def transcribe(self, audio: Any, *, task: str = "transcribe", language: str | None = None,
                   prompt: str | None = None, params: SamplingParams | None = None) -> AsyncIterator[str]:
        """Speech to text with a Whisper model: the text of ``audio`` (a ``(waveform, rate)`` pair, a waveform or an
        encoded file) as it comes, ``task`` "translate" into English; ``language`` the spoken one (ISO-639-1, default
        English), ``prompt`` context before it. Audio longer than the model hears at once (30 s) runs as pieces cut
        at quiet moments, all at once, their texts in order (docs/multimodal.md#whisper); greedy unless ``params``."""
        return transcribe(self, audio, task=task, language=language, prompt=prompt, params=params)

    async def transcribe_segments(self, audio: Any, *, task: str = "transcribe", language: str | None = None,
                                  prompt: str | None = None, params: SamplingParams | None = None) -> list[Segment]:
        """`transcribe` with timestamps: the audio's segments (``start``/``end`` seconds in the whole audio,
        ``text``), Whisper's timestamp tokens predicted under its rules (docs/multimodal.md#whisper)."""
        return await transcribe_segments(self, audio, task=task, language=language, prompt=prompt, params=params)

    async def generate_many(self, prompts: Any, params: Any = None, *, progress: bool = False,
                            max_concurrency: int | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """Run a batch job: one `RequestOutput` per prompt, in input order.

        `params` is one `SamplingParams` for all or a list with one per prompt,
        and so is `lora_request` (a `LoRARequest`, or None for the base model);
        `progress` shows a tqdm bar; at most `max_concurrency` requests are in
        flight (default: 2 x max_num_seqs, enough to keep every batch slot fed).
        The first error cancels the rest and is raised.
        """
        from asyncllm.engine.batch import generate_many

        return await generate_many(self, prompts, params, progress=progress, max_concurrency=max_concurrency,
                                   lora_request=lora_request)

    async def beam_search(self, prompt: Any, params: BeamSearchParams, **options: Any) -> BeamSearchOutput:
        """Beam search (vLLM's ``LLM.beam_search``): the `params.beam_width` most likely continuations, best first
        (asyncllm/beam_search.py). `options` (priority, lora_request, ...) apply to every step's requests."""
        from asyncllm.beam_search import beam_search

        return await beam_search(self, prompt, params, **options)

    def default_sampling_params(self) -> SamplingParams:
        """What a request without `SamplingParams` runs with (vLLM's ``get_default_sampling_params``): the model's
        generation_config.json sampling fields and ``override_generation_config`` over SamplingParams' defaults
        (``generation_config="vllm"``: those alone). Known once the engine started (it reads the file then)."""
        return SamplingParams(**self.default_sampling_fields())

    def default_sampling_fields(self) -> dict[str, Any]:
        """The `SamplingParams` fields that generation_config and override_generation_config set (a copy; the
        OpenAI server uses them for fields a request leaves unset). Known once the engine started."""
        if self._default_sampling is None:
            raise AsyncLLMError("the default sampling parameters are read when the engine starts: await start() first")
        return dict(self._default_sampling)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Check a LoRA adapter now (folder, config, every tensor's shape against the model) rather than at
        its first request; `InvalidRequestError` says what is wrong. Its weights are read by the workers
        when a request first uses it (docs/lora.md)."""
        if lora_request is None:
            raise InvalidRequestError("lora_request", "must be an asyncllm.LoRARequest, got None")
        RequestOptions(lora_request=lora_request).validate()
        await self.start()
        for processor in self._replicas.live_processors():  # each replica's host side has its own checker
            await anyio.to_thread.run_sync(processor.check_lora, lora_request)

    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's ``reset_prefix_cache``) of every replica, e.g. after new weights or
        between benchmark runs: requests this engine submits afterwards hit nothing computed before; running
        requests keep their KV blocks. Returns True (it cannot fail while the engine lives; `EngineDeadError`
        otherwise)."""
        await self.start()
        for processor in self._replicas.live_processors():
            processor.reset_prefix_cache()
        return True

    async def update_weights(self, model_path: str, *, revision: str | None = None) -> int:
        """Reload every weight of the served model, in place, from a checkpoint folder or hub id of the same
        architecture and shapes (SGLang's ``update_weights_from_disk``; for RL and fine-tuning loops). It runs in
        the engine core after the requests this engine submitted before; running requests go on, recomputed with
        the new weights, and the prefix cache is forgotten. Returns the new weights version (also in
        `stats().weights_version`); with data_parallel_size > 1 every replica updates first. A checkpoint that
        does not fit is an `InvalidRequestError` naming ``model_path`` (the old weights keep serving); a model
        that cannot be updated (quantized) a `NotBuiltError`. See docs/weight-updates.md."""
        if not isinstance(model_path, str) or not model_path:
            raise InvalidRequestError("model_path", f"a checkpoint folder or hub id (a non-empty str), got {model_path!r}")
        if revision is not None and not isinstance(revision, str):
            raise InvalidRequestError("revision", f"a hub revision (str) or None, got {revision!r}")
        await self.start()
        config_json = await anyio.to_thread.run_sync(new_checkpoint_config, model_path, revision,
                                                     self.config.download_dir)
        return await self._weights.update(self._replicas, protocol.UpdateWeights("", model_path, revision, config_json))

    async def update_weights_from_tensors(
            self, named_tensors: "Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]") -> int:
        """Write the given weights into the served model, in place, without a checkpoint on disk (SGLang's
        ``update_weights_from_tensor``; an RL trainer's tensors, e.g. ``model.state_dict()``, or a bucket of
        them): (checkpoint name, tensor) pairs, any subset of the model's weights, CPU or GPU, cast to the served
        dtype. The tensors are copied once into shared memory, which every worker rank reads its shard from; a
        core on another machine cannot (`InvalidRequestError`). Otherwise as `update_weights`: all or nothing (a
        name the model lacks or a wrong shape is an `InvalidRequestError` naming ``named_tensors``, and nothing is
        written), after the requests this engine submitted before, running requests recomputed, the prefix cache
        forgotten; returns the new weights version. See docs/weight-updates.md."""
        from asyncllm.engine.weight_tensors import pack_tensors

        await self.start()
        packed = await anyio.to_thread.run_sync(pack_tensors, named_tensors)
        message = protocol.UpdateWeights("", "", segment=packed.segment.name, tensors=packed.tensors)
        return await self._weights.update(self._replicas, message, when_answered=packed.close)

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, for an RL trainer that shares the GPUs (docs/sleep-mode.md): free the GPU memory of
        the weights (level 1: kept in CPU memory; level 2: discarded, `update_weights` loads new ones after
        `wake_up`) and of the KV cache. It runs in the engine core after the requests this engine submitted
        before; running requests are recomputed after the wake-up, new ones queue until then. Needs
        ``enable_sleep_mode=True`` (a `ConfigError` naming it otherwise); with data_parallel_size > 1 every
        replica sleeps."""
        level = check_level(level)
        await self._sleep_mode(protocol.Sleep("", level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: every part, or those in ``tags`` ("weights", "kv_cache"), e.g. the weights
        first, then `update_weights`, then the KV cache, so the peak stays low (docs/sleep-mode.md)."""
        await self._sleep_mode(protocol.WakeUp("", check_tags(tags)))

    async def is_sleeping(self) -> bool:
        """Whether any part of the engine's memory sleeps (every host attached to the core sees it: `stats()`'s
        ``is_sleeping``, which the core sends with its outputs)."""
        await self.start()
        return self.stats().is_sleeping

    async def _sleep_mode(self, message: protocol.Sleep | protocol.WakeUp) -> None:
        await self.start()
        await every_replica([processor.sleep_mode(msgspec.structs.replace(message))
                              for processor in self._replicas.live_processors()])

    def stats(self) -> EngineStats:
        """The latest snapshot of the engine's gauges and counters (no I/O; cheap enough per request). With
        data_parallel_size > 1 the replicas' numbers added up, each replica's own in `replicas`."""
        return self._replicas.stats()

    # ------------------------------------------------------------ internals used by RequestStream
    async def _submit(self, prompt: Any, params: SamplingParams | None, options: RequestOptions,
                      chat: bool) -> RequestCollector:
        check_prompt(prompt, chat)
        if params is None:
            await self.start()
            params = self.default_sampling_params()
        params.validate()
        options.validate()
        _check_strings(params, options)
        if self._draining:
            raise EngineDeadError("the engine is closing (aclose(drain=True)); it takes no new requests")
        await self.start()
        if self._closed:
            raise EngineDeadError("the engine was closed")
        replica = await self._replicas.pick(options.request_id, options.data_parallel_rank)
        processor = replica.processor
        assert processor is not None
        replica.admission.admit(replica.observer.stats.scheduler, prompt, chat, params.n)  # refuse before tokenizing
        collector = RequestCollector(options.request_id or uuid.uuid4().hex, time.time(), params.n, params.output_kind)
        self._replicas.placed(replica, collector, params.n)
        self._in_flight.add(collector)
        processor.submit(Submit(collector, prompt, params, options, chat, trace_context=capture_context()))
        return collector

    def _abort(self, request_id: str) -> None:
        self._replicas.abort(request_id)

    def _deliver_threadsafe(self, batch: Delivery, stats: protocol.SchedulerStats | None) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_delivery, batch, stats)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    def _on_delivery(self, batch: Delivery, stats: protocol.SchedulerStats | None) -> None:
        for collector, item in batch:
            if isinstance(item, BaseException):
                collector.put_error(item)
            else:
                collector.put(item)
        if self._closed:
            return
        for replica in self._replicas:  # a dead core failed its own replica's requests; its supervisor restarts it
            replica.check_dead()


def _checked_params(params: SamplingParams | None) -> SamplingParams | None:
    """`params` if it is a SamplingParams or None (the engine's defaults, resolved once it started)."""
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be a SamplingParams, got {type(params).__name__}")
    return params


def _check_strings(params: SamplingParams, options: RequestOptions) -> None:
    """Strings that cross the wire must be valid UTF-8 (a lone surrogate would fail the processor's encoder)."""
    check_params_text(params)
    if options.request_id is not None:
        check_text("request_id", options.request_id)
        if len(options.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters")
    if options.cache_salt is not None:
        check_text("cache_salt", options.cache_salt)
