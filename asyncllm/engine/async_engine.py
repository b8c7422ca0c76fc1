"""`AsyncEngine`: the engine as the host application's event loop sees it."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import anyio

from asyncllm import envs, protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.launch import CoreProcess, launch_core
from asyncllm.engine.prepare import prepare
from asyncllm.engine.processor import Delivery, Processor, Submit
from asyncllm.engine.stats_log import StatsLogger
from asyncllm.engine.stream import RequestOptions, RequestStream, check_prompt
from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.outputs import CompletionOutput, EngineStats, RequestOutput
from asyncllm.sampling import SamplingParams

__all__ = ["AsyncEngine"]


class AsyncEngine:
    """An LLM engine embedded in the host's asyncio event loop.

    Constructing it is cheap and starts nothing; ``async with engine``,
    ``await engine.start()`` or the first request starts the engine core and
    its workers. Every `EngineConfig` field is accepted as a keyword.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._init(EngineConfig.create(model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        engine = cls.__new__(cls)
        engine._init(config)
        return engine

    def _init(self, config: EngineConfig) -> None:
        self.config = config
        self._processor: Processor | None = None
        self._core: CoreProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None
        self._stats = protocol.SchedulerStats()
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def started(self) -> bool:
        return self._processor is not None

    async def start(self) -> None:
        """Start the engine core and its workers; returns once they serve."""
        if self._closed:
            raise EngineDeadError("this AsyncEngine was closed; create a new one")
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._processor is None:
                await self._start()

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        prepared = await anyio.to_thread.run_sync(prepare, self.config)
        self.config = prepared.config
        core = await anyio.to_thread.run_sync(launch_core, self.config)
        obs = self.config.observability_config
        processor = Processor(
            address=core.address, tokenizer=prepared.tokenizer, eos_token_ids=prepared.eos_token_ids,
            vocab_size=prepared.vocab_size, deliver=self._deliver_threadsafe, core=core,
            stats_logger=None if obs.disable_log_stats else StatsLogger(obs.log_stats_interval),
            startup_timeout_s=envs.ENGINE_STARTUP_TIMEOUT_S.get(),
        )
        try:
            await asyncio.wrap_future(processor.start())
        except BaseException:
            await anyio.to_thread.run_sync(_stop, processor, core)
            raise
        self.tokenizer = prepared.tokenizer
        self._core, self._processor = core, processor

    async def aclose(self) -> None:
        """Abort what is in flight, stop the core and workers, free everything."""
        self._closed = True
        processor, core = self._processor, self._core
        self._processor = self._core = None
        if processor is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_stop, processor, core)

    # ------------------------------------------------------------ requests
    def stream(self, prompt: Any, params: SamplingParams | None = None, *, priority: int = 0,
               request_id: str | None = None, timeout: float | None = None,
               cache_salt: str | None = None) -> RequestStream:
        """Stream `StreamDelta`s of one completion; leaving the loop aborts it."""
        options = RequestOptions(priority, request_id, timeout, cache_salt)
        return RequestStream(self, prompt, _params(params), options, chat=False)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, priority: int = 0,
             request_id: str | None = None, timeout: float | None = None,
             cache_salt: str | None = None) -> RequestStream:
        """Stream a reply to chat `messages`, formatted by the tokenizer's chat template."""
        options = RequestOptions(priority, request_id, timeout, cache_salt)
        return RequestStream(self, messages, _params(params), options, chat=True)

    async def generate(self, prompt: Any, params: SamplingParams | None = None, **options: Any) -> RequestOutput:
        """Run one completion to the end and return it whole (options as for `stream`)."""
        stream = self.stream(prompt, params, **options)
        text: list[str] = []
        token_ids: list[int] = []
        last = None
        async with stream:
            async for delta in stream:
                text.append(delta.text)
                token_ids.extend(delta.token_ids)
                last = delta
        collector = stream.collector
        assert collector is not None and last is not None
        completion = CompletionOutput(0, "".join(text), token_ids, last.finish_reason, last.stop_reason)
        return RequestOutput(collector.request_id, prompt if isinstance(prompt, str) else None,
                             collector.prompt_token_ids, [completion], collector.metrics,
                             collector.num_cached_tokens)

    def stats(self) -> EngineStats:
        """The latest snapshot of the engine's gauges and counters (no I/O)."""
        s = self._stats
        alive = self._processor is not None and self._processor.dead is None
        return EngineStats(
            num_requests_running=s.num_requests_running, num_requests_waiting=s.num_requests_waiting,
            kv_cache_usage=s.kv_cache_usage, num_gpu_blocks=s.num_gpu_blocks, num_used_blocks=s.num_used_blocks,
            num_preemptions_total=s.num_preemptions_total, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total, engine_alive=alive,
        )

    # ------------------------------------------------------------ internals used by RequestStream
    async def _submit(self, prompt: Any, params: SamplingParams, options: RequestOptions, chat: bool) -> RequestCollector:
        check_prompt(prompt, chat)
        params.validate()
        options.validate()
        await self.start()
        processor = self._processor
        if processor is None:
            raise EngineDeadError("the engine was closed")
        if processor.dead is not None:
            raise EngineDeadError(f"the engine is dead: {processor.dead}")
        collector = RequestCollector(options.request_id or uuid.uuid4().hex, time.time())
        processor.submit(Submit(collector, prompt, params, options, chat))
        return collector

    def _abort(self, request_id: str) -> None:
        processor = self._processor
        if processor is not None:
            processor.abort(request_id)

    def _deliver_threadsafe(self, batch: Delivery, stats: protocol.SchedulerStats | None) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_delivery, batch, stats)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    def _on_delivery(self, batch: Delivery, stats: protocol.SchedulerStats | None) -> None:
        if stats is not None:
            self._stats = stats
        for collector, item in batch:
            if isinstance(item, BaseException):
                collector.put_error(item)
            else:
                collector.put(item)


def _params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be a SamplingParams, got {type(params).__name__}")
    return params


def _stop(processor: Processor, core: CoreProcess | None) -> None:
    processor.close(shutdown_core=core is not None)
    if core is not None:
        core.stop()
