"""`Replica`: one engine core and the host side that talks to it.

An `AsyncEngine` holds `data_parallel_size` replicas (one unless data
parallelism is on). Each has its own processor thread (DEALER socket,
tokenizer, detokenizers), its own `RequestObserver` (so each processor thread
is the only writer of its counters, and Prometheus sums them), its own
queue estimate (for admission and the balancer) and core supervisor: a dead core fails and
restarts only its replica's requests (docs/parallelism.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.config_model import AUTO_MAX_MODEL_LEN
from asyncllm.engine.admission import HostAdmission
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.data_parallel import combined_stats, load_score, replica_env, served_max_model_len
from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.protocol import SchedulerStats
from asyncllm.engine.launch import CoreProcess, launch_core
from asyncllm.engine.launched import Launched, stop_launched
from asyncllm.engine.off_loop import finish_in_thread, in_thread, start_daemon
from asyncllm.engine.prepare import Prepared, prepare
from asyncllm.engine.processor import Processor
from asyncllm.engine.stats_log import StatsLogger
from asyncllm.engine.supervisor import CoreSupervisor
from asyncllm.metrics import multiprocess
from asyncllm.metrics.observer import RequestObserver
from asyncllm.procutil import forked
from asyncllm.outputs import EngineStats

__all__ = ["LaunchSpec", "Replica", "ReplicaSet", "pick_replica", "start_replica", "start_replicas", "stop_all",
           "stop_forgotten", "stop_replicas", "weakly", "abandon"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    """Replica `index`: its processor thread and (unless attached to a shared core) its core process."""

    index: int
    observer: RequestObserver
    admission: HostAdmission
    supervisor: CoreSupervisor
    processor: Processor | None = None
    core: CoreProcess | None = None
    max_model_len: int = 0
    """What its core serves (its `Ready`'s; ``auto``: fitted to its KV cache), known once it started."""
    _seen_dead: Processor | None = None
    """The dead processor whose core's gauges were zeroed already (`check_dead`)."""
    launching: Launched | None = None
    """What its start or core restart in progress launched so far (`start_replica`)."""

    @property
    def alive(self) -> bool:
        return self.processor is not None and self.processor.dead is None

    def score(self) -> int:
        """Its load for the balancer (`data_parallel.load_score`)."""
        stats = self.queue_stats()
        return load_score(stats, self.admission.num_waiting(stats))

    def queue_stats(self) -> SchedulerStats:
        """The core's latest snapshot as the loop was given it (`admission.Delivered`), for the queue estimate."""
        latest = self.admission.latest
        return self.observer.stats.scheduler if latest is None else latest.scheduler

    def snapshot(self) -> EngineStats:
        return self.observer.stats.snapshot(engine_alive=self.alive)

    def check_dead(self) -> None:
        """On the loop after a delivery: a dead core's gauges are zeroed once (its stale running and waiting
        counts must not steer the balancer or show in stats), and its supervisor is told."""
        processor = self.processor
        if processor is None or processor.dead is None:
            return
        if self._seen_dead is not processor:
            self._seen_dead = processor
            self.observer.stats.mark_closed()
            self.admission.take(self.observer.stats.scheduler)  # its zeros: the next core's count starts from 0
        self.supervisor.on_core_dead(processor.dead)

    def stop(self) -> None:
        """Say goodbye (shutting an owned core down), stop the thread and the core (blocking: off the loop)."""
        processor, core = self.processor, self.core
        if processor is not None:
            stop_launched(processor, core)

    def drop_orphaned(self, started: bool) -> None:
        """A takeover, after the loop of its start or restart in progress closed with it pending (asyncllm/engine/
        launched.py): stop what that launched, in a thread; an engine not `started` yet also drops what its start
        gave the replica already (a restart leaves the dead processor in place: its supervisor tries again)."""
        self.supervisor.drop_orphaned()
        launching, self.launching = self.launching, None
        launched = [launching.drop()] if launching is not None else []
        if not started:
            launched.append((self.processor, self.core))
            self.processor = self.core = None
        for processor, core in launched:
            if processor is not None or core is not None:
                start_daemon(stop_launched, processor, core, name="asyncllm-stop-orphaned")


class ReplicaSet:
    """The engine's replicas, in index order: which one takes a request, where its abort goes, what serves."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self._placed: weakref.WeakValueDictionary[str, RequestCollector] = weakref.WeakValueDictionary()
        """data_parallel_size > 1: request id -> its collector, whose `replica` says where aborts go."""

    def __iter__(self):
        return iter(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    @property
    def any_alive(self) -> bool:
        return any(replica.alive for replica in self.replicas)

    @property
    def may_serve(self) -> bool:
        """A replica serves, or its core is being restarted (its requests wait for it): what a drain waits on."""
        return any(replica.alive or replica.supervisor.restarting for replica in self.replicas)

    async def pick(self, request_id: str | None, rank: int | None = None) -> Replica:
        """The replica for a new request: replica ``rank`` if given, else the least loaded live one (a request id
        still in flight: its replica, which refuses the duplicate). Waits for a core restart when no replica is
        alive (or replica ``rank`` is not) but one restarts. A request id in flight on another replica than ``rank``
        is an `InvalidRequestError` (its replica refuses the duplicate otherwise)."""
        previous = self._placed.get(request_id) if request_id is not None else None
        if previous is not None and not previous.finished and rank is not None and rank != previous.replica:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight (on replica "
                                                    f"{previous.replica}; data_parallel_rank={rank} asked)")
        if rank is not None:
            return await self._pinned(rank)
        await self.wait_restart()  # the core is being restarted: this request goes to the new one
        previous = self._placed.get(request_id) if request_id is not None else None
        if previous is not None and not previous.finished and self.replicas[previous.replica].alive:
            return self.replicas[previous.replica]
        replica = pick_replica(self.replicas)
        if replica is None:
            raise self.dead_error()
        return replica

    async def _pinned(self, rank: int) -> Replica:
        if rank >= len(self.replicas):
            raise InvalidRequestError("data_parallel_rank", f"a replica index below data_parallel_size="
                                                            f"{len(self.replicas)}, got {rank}")
        replica = self.replicas[rank]
        replica.check_dead()
        if not replica.alive and replica.supervisor.restarting:
            await replica.supervisor.wait()
        if not replica.alive:
            raise self.dead_error() if not self.any_alive else EngineDeadError(f"replica {rank} is dead")
        return replica

    def placed(self, replica: Replica, collector: RequestCollector) -> None:
        """`collector`'s request goes to `replica` (counted there by its `admission`): remember where (for its
        abort)."""
        collector.replica = replica.index
        if len(self.replicas) > 1:
            self._placed[collector.request_id] = collector

    def abort(self, request_id: str) -> None:
        """To the request's replica (to every replica if it is not known: an unknown id is ignored there)."""
        collector = self._placed.get(request_id) if len(self.replicas) > 1 else None
        for replica in self.replicas if collector is None else [self.replicas[collector.replica]]:
            if replica.processor is not None:
                replica.processor.abort(request_id)

    async def wait_restart(self) -> None:
        """When no replica is alive but a core restarts: until its restart is done (bounded by the core's
        startup timeout; it never raises, the replicas' state tells). A core whose death the loop was not delivered
        yet (a control call failed by it first) has its supervisor told here, so its restart is waited for."""
        for replica in self.replicas:
            replica.check_dead()
        if not self.any_alive:
            for replica in self.replicas:
                if replica.supervisor.restarting:
                    await replica.supervisor.wait()

    async def serving_processors(self) -> list[Processor]:
        """`live_processors` once a core restart in progress is done (what control calls act on)."""
        await self.wait_restart()
        return self.live_processors()

    def live_processors(self) -> list[Processor]:
        """The processor threads of the replicas that serve; `EngineDeadError` when none does."""
        live = [replica.processor for replica in self.replicas if replica.alive]
        if not live:
            raise self.dead_error()
        return live  # type: ignore[return-value]

    def dead_error(self) -> EngineDeadError:
        processor = self.replicas[0].processor
        return EngineDeadError(f"the engine is dead: {processor.dead}" if processor else "the engine was closed")

    def stats(self) -> EngineStats:
        if len(self.replicas) == 1:
            return self.replicas[0].snapshot()
        return combined_stats([replica.snapshot() for replica in self.replicas])


@dataclass(frozen=True)
class LaunchSpec:
    """What starting any replica needs from its engine."""

    deliver: Callable[..., None]
    """The engine's delivery (`AsyncEngine._deliver_threadsafe`): a processor's `Deliver` once given its replica's
    `HostAdmission`."""
    connect_address: str | None = None
    """Attach to this shared core (`AsyncEngine.connect`) instead of launching one."""
    engine_key: str | None = None
    devices: list[list[str]] | None = None
    """Each replica's CUDA devices (`data_parallel.replica_devices`); None: CPU, or one replica."""
    host_fields: dict[str, Any] = field(default_factory=dict)  # given to `AsyncEngine.connect`: on the core's config


def pick_replica(replicas: list[Replica]) -> Replica | None:
    """The live replica with the lowest load score, the lowest index on a tie; None when none is alive. A replica
    that awaits weights (restarted after a push, or woken after a level-2 sleep) or sleeps (another was restarted
    awake meanwhile) runs nothing yet: it is picked only when every live replica does."""
    best: Replica | None = None
    best_key = (True, 0)
    for replica in replicas:
        if replica.alive:
            scheduler = replica.observer.stats.scheduler
            key = (scheduler.awaiting_weights or scheduler.sleep_level > 0, replica.score())
            if best is None or key < best_key:
                best, best_key = replica, key
    return best


async def start_replica(replica: Replica, config: EngineConfig, spec: LaunchSpec,
                        closed: Callable[[], bool] | None = None) -> Prepared:
    """Prepare the host side (model folder, tokenizer), launch or attach to the core, start the processor thread;
    returns once the core serves, `Replica.max_model_len` holding the core's (``auto``: fitted to its KV cache;
    `data_parallel.served_max_model_len` puts the replicas' least into the config). On failure nothing of it is
    left running. `closed` (a supervisor's restart): a shared core being restarted is waited for, up to the
    startup timeout or until `closed()` (`prepare_attached`). What it launched is in `Replica.launching` meanwhile."""
    launched = replica.launching = Launched()
    try:
        return await _start_replica(replica, config, spec, closed, launched)
    finally:
        if replica.launching is launched:  # (else a takeover dropped it)
            replica.launching = None


async def _start_replica(replica: Replica, config: EngineConfig, spec: LaunchSpec, closed: Callable[[], bool] | None,
                         launched: Launched) -> Prepared:
    timeout_s = envs.ENGINE_STARTUP_TIMEOUT_S.get()
    core: CoreProcess | None = None
    if spec.connect_address is not None:
        from asyncllm.engine.connect import prepare_attached

        prepared = await in_thread(prepare_attached, config, spec.connect_address, timeout_s, spec.engine_key,
                                   closed, spec.host_fields)
    else:
        prepared = await in_thread(prepare, config, closed is not None)  # a restart's config: prepared before
        core = await in_thread(launched.core, launch_core, prepared.config, prepared.hf_config_json,
                               replica_env(spec.devices, replica.index), config.max_model_len == AUTO_MAX_MODEL_LEN,
                               replica.observer.stats.model_name,  # its label: the core names it to attached hosts
                               abandoned=functools.partial(stop_launched, None))  # never told Goodbye: cut at once
    replica.observer.stats.owns_core = core is not None  # before its first snapshot: its counters end with it
    replica.observer.stats.set_cache_config(prepared.config.cache_config)  # cache_config_info; no snapshot yet
    processor = _processor(replica, prepared, core, spec, timeout_s)
    launched.processor(processor)
    try:
        ready = await asyncio.wrap_future(processor.start())
    except BaseException:
        await finish_in_thread(stop_launched, processor, core)
        raise
    if core is None:  # attached: labelled as the core's launcher named the model (its Ready), not with its folder
        replica.observer.set_model_name(ready.model or prepared.config.model)
    replica.observer.max_model_len = ready.max_model_len  # an unset max_tokens' request_params_max_tokens
    replica.observer.stats.core_ready(ready.num_gpu_blocks)  # before its first snapshot: stats() names its cache
    replica.processor, replica.core, replica.max_model_len = processor, core, ready.max_model_len
    return prepared


def _processor(replica: Replica, prepared: Prepared, core: CoreProcess | None, spec: LaunchSpec,
               timeout_s: float) -> Processor:
    obs = prepared.config.observability_config
    prefix = f"Engine {replica.index:03d}: " if prepared.config.data_parallel_size > 1 else ""
    stats_logger = None if obs.disable_log_stats else StatsLogger(obs.log_stats_interval, replica.observer.stats,
                                                                  prefix)
    if prepared.mm is not None:
        prepared.mm.stats = replica.observer.stats
    return Processor(
        address=core.address if core is not None else spec.connect_address, tokenizer=prepared.tokenizer,
        eos_token_ids=prepared.eos_token_ids, vocab_size=prepared.vocab_size,
        deliver=functools.partial(spec.deliver, replica.admission), core=core,
        stats_logger=stats_logger, startup_timeout_s=timeout_s, observer=replica.observer,
        engine_key=spec.engine_key, mm=prepared.mm, lora=prepared.lora, hidden_size=prepared.hidden_size,
        pooling_model=prepared.pooling_model, stream_interval=prepared.config.stream_interval,
        embeds_width=prepared.embeds_width, max_logprobs=prepared.config.max_logprobs,
    )


async def start_replicas(replicas: list[Replica], config: EngineConfig, spec: LaunchSpec) -> Prepared:
    """Start every replica at once (cores load their models in parallel); if one fails, stop the others and raise
    its error. Returns replica 0's `Prepared` (the engine's tokenizer, defaults, ...)."""
    try:
        results = await asyncio.gather(*(start_replica(r, config, spec) for r in replicas), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
    except BaseException:  # a failed replica, or the start cancelled: none may be left running
        await stop_all(replicas)
        raise
    prepared = results[0]
    assert isinstance(prepared, Prepared)
    prepared.config = served_max_model_len(replicas, prepared.config)
    return prepared


async def stop_all(replicas: list[Replica], retire: bool = False) -> None:
    """Stop every replica (`stop_replicas`, to the end however often the caller is cancelled; `retire`: then their
    counters retired, `_stop_and_retire`); none is left holding its processor or core."""
    try:
        await finish_in_thread(_stop_and_retire if retire else stop_replicas, replicas)
    finally:  # a cancel too: raised once the stop ended
        for replica in replicas:
            replica.processor = replica.core = None


def stop_replicas(replicas: list[Replica]) -> None:
    """Stop every replica, in parallel threads (each waits up to seconds for its core to exit)."""
    if len(replicas) == 1:
        replicas[0].stop()
        return
    threads = []
    for replica in replicas:
        thread = threading.Thread(target=replica.stop, name=f"asyncllm-stop-replica-{replica.index}")
        try:
            thread.start()
        except RuntimeError:  # interpreter shutdown (`off_loop.start_daemon` ran this inline): no thread can start
            replica.stop()
            continue
        threads.append(thread)
    for thread in threads:
        thread.join()


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (the engine's bound method) as the processor threads and a core's supervisor hold it: weakly, so
    that an engine dropped without aclose() is collected (`stop_forgotten`). A call after that does nothing and
    returns None: what a thread delivers then is dropped (no stream of that engine is left to take it: a stream
    holds its engine)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call_while_alive(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call_while_alive


def abandon(replicas: list[Replica]) -> None:
    """A forked child's close of its parent's engine: drop the references, stopping no process, removing no folder
    and unlinking no shared memory (they are the parent's, which still serves with them)."""
    for replica in replicas:
        replica.processor = replica.core = None


def stop_forgotten(replicas: list[Replica], owner_pid: int) -> None:
    """The finalizer of a started engine collected without aclose(): stop its replicas in a thread of their own, never
    blocking the thread or event loop the collection happened in; in a forked child only `abandon` them."""
    if forked(owner_pid):
        abandon(replicas)
        return
    owned = any(replica.core is not None for replica in replicas)  # an attached replica has no core of its own
    logger.warning("an AsyncEngine was garbage-collected without aclose(): %s", "stopping its engine core(s)" if owned
                   else "detaching from its shared engine core (which serves on)")
    start_daemon(_stop_and_retire, replicas, name="asyncllm-stop-forgotten")


def _stop_and_retire(replicas: list[Replica]) -> None:
    """`stop_replicas`, then their counters retired into the Prometheus registry as `aclose` does (they never go
    down)."""
    try:
        stop_replicas(replicas)
    finally:
        for replica in replicas:
            replica.observer.on_closed()
        multiprocess.sync()
