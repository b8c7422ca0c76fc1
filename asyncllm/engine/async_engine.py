"""`AsyncEngine`: the engine as the host application's event loop sees it.

Here its construction, lifecycle (start, aclose, a replica's restart) and the request internals (`_submit`, the
processor threads' deliveries); its request methods are `EngineRequests` (asyncllm/engine/engine_requests.py), its
weight, LoRA, prefix-cache and sleep controls `EngineControl` (asyncllm/engine/engine_control.py), the event loop it
serves `EngineLoop` (asyncllm/engine/engine_loop.py)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
import weakref
from typing import Any

import anyio

from asyncllm import envs, protocol
from asyncllm.config import EngineConfig, check_host_side
from asyncllm.config_model import AUTO_MAX_MODEL_LEN
from asyncllm.engine.admission import Delivered, HostAdmission
from asyncllm.engine.collector import ACCEPTED, RequestCollector
from asyncllm.engine.data_parallel import replica_devices, served_max_model_len
from asyncllm.engine.drain import EngineDrain
from asyncllm.engine.engine_control import EngineControl
from asyncllm.engine.engine_loop import EngineLoop
from asyncllm.engine.engine_pins import EnginePins
from asyncllm.engine.engine_requests import EngineRequests
from asyncllm.engine.engine_state import EngineState
from asyncllm.engine.engine_weights import EngineWeights
from asyncllm.engine.launch import CoreProcess
from asyncllm.engine.pooling_model import PoolingModel
from asyncllm.engine.prepare import Prepared
from asyncllm.engine.processor import Delivery, Processor, Submit
from asyncllm.engine.off_loop import finish_in_thread, import_before_the_loop
from asyncllm.engine.replica import (
    LaunchSpec, Replica, ReplicaSet, start_replica, start_replicas, stop_all, stop_forgotten, weakly,
)
from asyncllm.engine.stream import RequestOptions, check_prompt
from asyncllm.engine.supervisor import CoreSupervisor
from asyncllm.engine.validation import check_request_strings
from asyncllm.metrics.observer import RequestObserver
from asyncllm.errors import EngineDeadError, EventLoopError
from asyncllm.outputs import EngineStats
from asyncllm.procutil import forked
from asyncllm.sampling import SamplingParams
from asyncllm.speech import SpeechToText, speech_to_text_of

__all__ = ["AsyncEngine"]


class AsyncEngine(EngineRequests, EngineControl, EngineState, EngineLoop):
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
        for its config (then `engine.config`) and loads the tokenizer. `kwargs` are host-side
        fields only (`config.HOST_SIDE_FIELDS`: stream_interval, prometheus_registry, ...; else
        the core's values), a core-side one is a ConfigError naming it; `aclose` detaches and
        leaves the core running for the other hosts. A ``tcp://`` address needs the core's
        shared secret: `key`, or ASYNCLLM_ENGINE_KEY (docs/security.md).
        """
        from asyncllm.auth import resolve_key
        from asyncllm.engine.connect import check_address, default_address

        address = check_address(default_address() if address is None else address, key)
        check_host_side(kwargs)
        engine = cls.__new__(cls)
        engine._init(EngineConfig.create(address, **kwargs), address)  # the address stands in for the model
        engine._host_fields = kwargs
        engine._engine_key = resolve_key(address, key)
        return engine

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        engine = cls.__new__(cls)
        engine._init(config)
        return engine

    def _init(self, config: EngineConfig, connect_address: str | None = None) -> None:
        self.config = config
        self._fits_max_model_len = config.max_model_len == AUTO_MAX_MODEL_LEN
        """max_model_len -1: `config` gets the core's fitted value, and a restarted core fits it again."""
        self._connect_address = connect_address
        """Set by `connect`: attach to this core instead of starting one."""
        self._host_fields: dict[str, Any] = {}  # set by `connect`: its host-side fields, on the core's config
        self._engine_key: str | None = None
        """The shared secret of a tcp:// `_connect_address` (never logged, never in the config)."""
        self._weights = EngineWeights()
        """Weight updates on every replica, and the last one for a restarted core."""
        self._pins = EnginePins()  # the pinned LoRA adapters, on every replica (and a restarted core)
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the engine started in: the processor threads deliver outputs there (`_check_loop`)."""
        self._owner_pid: int | None = None  # the process it started in: a forked child cannot use it
        self._start_lock: asyncio.Lock | None = None
        self._start_lock_loop: asyncio.AbstractEventLoop | None = None
        """The loop `_start_lock` belongs to (`_loop_start_lock`)."""
        self._starting: asyncio.Task[Prepared] | None = None
        """The replicas' start in progress, which `aclose` cancels."""
        self._observer = RequestObserver(config.model, config.prometheus_registry, named=connect_address is None)
        """Replica 0's observer (the only one with data_parallel_size 1)."""
        self.metrics_registry = self._observer.registry
        """The prometheus_client CollectorRegistry holding this engine's `asyncllm:` series."""
        self._replicas = ReplicaSet([self._new_replica(i) for i in range(config.data_parallel_size)])
        """One per data-parallel replica: its core, processor thread, observer, supervisor (asyncllm/engine/replica.py)."""
        self._started = False
        self._closed = False
        self._drain = EngineDrain()  # aclose(drain=True)'s requests in flight, from their calls' entry
        self._stopping: asyncio.Task[None] | None = None  # `_close`'s stop of the core(s), which any aclose awaits
        self._stop_ran = False  # `_stopping` ran to its end (a cancel let into it after it began waits for that)
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
        import_before_the_loop()


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
            observer.stats.engine_index = index  # Prometheus labels its series engine="<index>" (else "0")
        admission = HostAdmission(config.max_num_queued_requests, config.max_num_queued_tokens,
                                  Delivered(observer.stats.scheduler))
        name = "engine core" if config.data_parallel_size == 1 else f"engine core {index}"
        restart = weakly(self._restart_replica)  # a running core's supervisor must not keep us alive
        # None once we are collected: nothing to restart (our finalizer stops the replicas)
        supervisor = CoreSupervisor(config.max_core_restarts, lambda: restart(index) or asyncio.sleep(0), name)
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
        """Start the engine core(s) and their workers; returns once they serve. The engine then belongs to this
        event loop (`_check_loop`)."""
        self._check_loop()
        if self._closed:
            raise EngineDeadError("this AsyncEngine was closed; create a new one")
        if self._started:
            return  # (a replica's core restart does not hold up requests to the others)
        lock = self._loop_start_lock()
        async with lock:
            if self._closed:  # closed while this call waited for another's start
                raise EngineDeadError("this AsyncEngine was closed while starting; create a new one")
            if not self._started:
                await self._start()

    def _launch_spec(self) -> LaunchSpec:
        return LaunchSpec(weakly(self._deliver_threadsafe), self._connect_address, self._engine_key,
                          replica_devices(self.config), self._host_fields)

    async def _start(self) -> None:
        if self._starting is not None:  # another loop's start, begun before this loop's lock was taken
            raise EventLoopError("this AsyncEngine is starting in another event loop: start it from one loop")
        loop = self._loop = asyncio.get_running_loop()  # a start from another open loop meanwhile is refused
        self._owner_pid = os.getpid()
        envs.check_at_start()  # a mistyped ASYNCLLM_* name would be ignored silently, a bad value fail late
        try:
            prepared = await self._start_replicas()
        except BaseException:
            if self._loop is loop:  # (else another loop took the engine over)
                self._loop = self._owner_pid = None  # nothing runs: the engine belongs to no loop (nor process)
            raise
        if self._closed:  # aclose() came meanwhile (it waits for this start): nothing may be left running
            await stop_all(self._replicas.replicas)
            raise EngineDeadError("the engine was closed while starting (aclose() during start())")
        self.config = prepared.config
        for replica in self._replicas.replicas:  # an attached host's limits are its core's
            replica.admission.follow(self.config.max_num_queued_requests, self.config.max_num_queued_tokens)
        self.pooling_model = prepared.pooling_model
        self._default_sampling = prepared.default_sampling
        self.tokenizer = prepared.tokenizer
        self.vocab_size: int = prepared.vocab_size
        """The model's vocabulary size: it generates ids in [0, vocab_size), some maybe past the tokenizer's."""
        self.speech_to_text = speech_to_text_of(prepared.mm, prepared.generation_config, prepared.vocab_size)
        self.suppressed_tokens = prepared.suppressed_tokens  # generation_config's, for beam search (the host ranks)
        self.eos_token_ids: list[int] = list(prepared.eos_token_ids)
        """The tokenizer's and generation_config's EOS ids (known once started)."""
        self._started = True
        self._forgotten = weakref.finalize(self, stop_forgotten, self._replicas.replicas, self._owner_pid)
        self._forgotten.atexit = False  # at exit the processes end with this one (their parent-death lifeline)

    async def _start_replicas(self) -> Prepared:
        """`start_replicas` as a task of its own, so that `aclose` can cancel it (a shutdown during a download or a
        model load need not wait for it) without cancelling the caller of `start`, who gets `EngineDeadError`. A
        cancelled start cancels it too and waits while it stops what it started."""
        starting = asyncio.ensure_future(start_replicas(self._replicas.replicas, self.config, self._launch_spec()))
        self._starting = starting
        try:
            await asyncio.wait([starting])
        except asyncio.CancelledError:
            starting.cancel()
            await asyncio.wait([starting])
            raise
        finally:
            if self._starting is starting:  # (else another loop took the engine over, dropping it)
                self._starting = None
        if starting.cancelled():
            why = "aclose() during start()" if self._closed else "its start task was cancelled"
            raise EngineDeadError(f"the engine was closed while starting ({why})")
        return starting.result()

    async def aclose(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the engine core(s) and their workers; free every process, socket and shared-memory segment.

        ``drain=False`` aborts what is in flight (open streams end with
        finish_reason "abort"). ``drain=True`` first refuses new requests
        (`EngineDeadError`) and waits until every request in flight finished (from its call's entry; a beam
        search's next steps are taken: engine/drain.py), at most `timeout` seconds (None: no limit); the rest is
        then aborted.
        """
        if forked(self._owner_pid):  # a forked child's: its parent's engine, serving on there, is only dropped
            self._closed = True
            if self._started:
                self._forgotten()  # (`stop_forgotten` in a child: `abandon`)
            return
        self._check_loop()
        if drain and not self._closed and self._started:
            try:
                await self._drain.wait(lambda: any(not c.finished for c in list(self._in_flight)),
                                       lambda: self._replicas.may_serve, timeout)
            except asyncio.CancelledError:  # the host's shutdown deadline: abort what is left and stop, as on timeout
                await self._close()
                raise
        await self._close()

    async def _close(self) -> None:
        self._closed = True
        if self._starting is not None:
            self._starting.cancel()  # a start in progress stops what it started now (a download's thread runs on)
        async with self._loop_start_lock():  # a start in progress ends first: it sees `_closed` and stops its replicas
            pass
        with anyio.CancelScope(shield=True):
            for replica in self._replicas:  # a core restart in progress stops what it launched, as a start does
                await replica.supervisor.cancel()
        stopping = self._stopping
        if self._started or (stopping is not None and stopping.cancelled() and not self._stop_ran):
            self._started = False  # (a stop cancelled before it began: by `asyncio.run`'s end, say)
            self._stopping = stopping = asyncio.ensure_future(self._stop())
        elif stopping is None or stopping.done() or stopping.get_loop().is_closed():
            return  # never started, or stopped already (never stop twice)
        await self._stopped(stopping)  # this aclose's stop, or another's: return once it ended

    async def _stopped(self, stopping: asyncio.Task[None]) -> None:
        """Wait for the stop of the core(s) to its end however often this aclose is cancelled (a cancel let into the
        stop's task before its first step would stop nothing, the core left running for good), then raise the
        cancel. The finalizer (`stop_forgotten`) is detached only by a stop that ran (`_stop_ran`)."""
        cancelled = False
        while not stopping.done():
            try:
                await asyncio.wait([stopping])  # (never cancels `stopping`)
            except asyncio.CancelledError:
                cancelled = True
        if self._stop_ran:
            self._forgotten.detach()
        if cancelled or stopping.cancelled():
            raise asyncio.CancelledError
        stopping.result()

    async def _stop(self) -> None:
        """`stop_all`: once it began it runs to its end, a cancel raised only then, so a stop cancelled after it
        began is a stop (`_stop_ran`); one cancelled before its first step never gets here."""
        try:
            await stop_all(self._replicas.replicas, retire=True)
        finally:
            self._stop_ran = True

    async def _restart_replica(self, index: int) -> None:
        """A replica's supervisor's restart: stop its dead processor thread and core, start new ones."""
        replica = self._replicas[index]
        processor = replica.processor
        if self._closed or processor is None:
            return
        await finish_in_thread(replica.stop)
        replica.core = None  # the dead processor stays until a new one serves: stats() and new requests say dead
        replica.max_model_len = 0  # its next core's fit (a dead one's no longer holds the others down)
        owned = self._connect_address is None  # a shared core's weights are its own: nothing to restore
        config = self._weights.restart_config(self.config) if owned else self.config
        if self._fits_max_model_len:  # fitted again: LongRoPE's factors follow the model's maximum
            config = config.replace(max_model_len=AUTO_MAX_MODEL_LEN)  # (owned only: connect refuses max_model_len)
        prepared = await start_replica(replica, config, self._launch_spec(), closed=lambda: self._closed)
        config = self.config if owned else prepared.config  # a shared core's: its memory, timeouts, ... may be new
        self.config = served_max_model_len(self._replicas.replicas, config)  # the restarted core's fit counts
        replica.admission.follow(self.config.max_num_queued_requests, self.config.max_num_queued_tokens)
        await self._replay_on_restart(replica, owned, processor)  # weights, adapters: before any request reaches it

    # ------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        """The latest snapshot of the engine's gauges and counters (no I/O; cheap enough per request). With
        data_parallel_size > 1 the replicas' numbers added up, each replica's own in `replicas`."""
        stats = self._replicas.stats()
        stats.engine_alive = stats.engine_alive and not forked(self._owner_pid)  # a forked child cannot use it
        return stats

    def set_served_model_name(self, name: str) -> None:
        """Label the Prometheus series (``model_name``) and request spans `name`, the name a server serves the model
        as, instead of the model as configured: vLLM labels them with its first ``--served-model-name``."""
        for replica in self._replicas:
            replica.observer.serve_as(name)

    # ------------------------------------------------------------ internals used by RequestStream
    async def _submit(self, prompt: Any, params: SamplingParams | None, options: RequestOptions,
                      chat: bool, trace_context: Any, accepted: asyncio.Event | None = None) -> RequestCollector:
        with self._drain.request():  # in flight for a drain from here (refused once it began: `EngineDrain`)
            return await self._submit_accepted(prompt, params, options, chat, trace_context, accepted)

    async def _submit_accepted(self, prompt: Any, params: SamplingParams | None, options: RequestOptions,
                               chat: bool, trace_context: Any, accepted: asyncio.Event | None) -> RequestCollector:
        check_prompt(prompt, chat, getattr(options.pooling, "task", None))  # (a bad `pooling` is refused below)
        if params is None:
            await self.start()
            params = self.default_sampling_params()
        params.validate()
        options.validate()
        prompt, options = options.salted(prompt)
        check_request_strings(params, options.request_id, options.cache_salt)
        await self.start()
        if self._closed:
            raise EngineDeadError("the engine was closed")
        arrival = time.time()  # a wait for a restarting core counts in its latencies; a lazy start does not
        replica = await self._replicas.pick(options.request_id, options.data_parallel_rank)
        processor = replica.processor
        assert processor is not None
        admitted = replica.admission.admit(replica.queue_stats(), prompt, chat, params.n,
                                           options.admission_group)  # counts, refuses
        collector = RequestCollector(options.request_id or uuid.uuid4().hex, arrival, params.n, params.output_kind,
                                     logprobs=params.logprobs is not None, admitted=admitted, accepted=accepted)
        admitted.track(collector)  # ended (aborted, say) before the core queued it: un-counted (admission.py)
        self._replicas.placed(replica, collector)
        self._in_flight.add(collector)
        processor.submit(Submit(collector, prompt, params, options, chat, trace_context=trace_context))
        return collector

    def _abort(self, request_id: str, collector: RequestCollector | None = None) -> None:
        """The core's abort of `request_id`; given its `collector`, of that request only (thread-safe): a duplicate
        of an id in flight, left before its refusal came, must not abort the request it duplicates."""
        processor = None if collector is None else self._replicas[collector.replica].processor
        if processor is None:
            self._replicas.abort(request_id)
        else:
            processor.abort(request_id, collector)

    def _deliver_threadsafe(self, admission: HostAdmission | None, batch: Delivery,
                            stats: protocol.SchedulerStats | None) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_delivery, admission, batch, stats)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    def _on_delivery(self, admission: HostAdmission | None, batch: Delivery,
                     stats: protocol.SchedulerStats | None) -> None:
        if stats is not None and admission is not None:  # first: the snapshot counts this message's failed requests
            admission.take(stats)
        for collector, item in batch:
            if isinstance(item, BaseException):
                collector.put_error(item)
            elif item is ACCEPTED:
                collector.accept()
            else:
                collector.put(item)
        if self._closed:
            return
        for replica in self._replicas:  # a dead core failed its own replica's requests; its supervisor restarts it
            replica.check_dead()
