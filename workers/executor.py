"""The executor: starts one worker process per rank (tensor x pipeline parallel) and drives them.

The engine core calls it from its busy loop (one thread; not thread-safe). Commands go down once, through the
shared-memory broadcast ring; replies come back on one zmq PULL socket that every worker PUSHes to. Every wait polls
that socket in short slices and checks the worker processes in between, so a rank that dies or reports a
`WorkerError` turns into `EngineDeadError` (or the worker's `ConfigError`) within about `_POLL_S`, never a hang.

A step's deadline is `worker_step_timeout_s` (None: no deadline, for a first step that compiles for minutes): a rank
that hangs past it fails the step like a dead one. The engine core then restarts the workers (workers/restart.py).

`execute_model` runs one step and waits for it. With async_scheduling the core uses its halves instead: `submit`
step N+1 while step N still runs, then `collect` step N (docs/scheduling.md, "Overlapped scheduling").

After a failure the executor is dead: every later call raises the same `EngineDeadError`; `shutdown()` frees all.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import msgspec
import zmq

from asyncllm import envs, protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import AsyncLLMError, EngineDeadError
from asyncllm.procutil import (at_orphan_exit, describe_exit, first_exited, private_ipc_dir, remove_dir, spawn_module,
                               stop_process)
from asyncllm.workers.shm_broadcast import BroadcastWriter
from asyncllm.workers.trace_summary import wait_for_exit

__all__ = ["Executor"]

_POLL_S = 0.1
"""Longest wait on the result socket between two checks that every worker is alive."""
_LAST_WORDS_S = 0.2
"""After a worker died: how long to wait for the WorkerError it may have sent first."""
_SHUTDOWN_GRACE_S = 5.0
"""How long workers get to leave on ShutdownWorker before they are stopped (one writing its step trace: until it
wrote it, `TRACE_WRITE_WAIT_S` more at most, `wait_for_exit`)."""

_Reply = TypeVar("_Reply", protocol.WorkerReady, protocol.CacheReady, protocol.WeightsUpdated,
                 protocol.SleepModeDone)


class Executor:
    """Owns the worker processes, the broadcast ring and the result socket.

    ``runner`` names the model runner class the workers build (``module:Class`` or ``path/to/file.py:Class``); it
    is a seam for tests, None means asyncllm's `ModelRunner`.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: str | None = None,
        ring_slots: int = 8,
        ring_slot_bytes: int = 1 << 20,
        hf_config_json: str | None = None,
    ) -> None:
        assert config.max_model_len is not None, "the host resolves max_model_len before starting the executor"
        self.config = config
        self._runner = runner
        self._hf_config_json = hf_config_json
        """The checkpoint's config as the host read it: the workers build their model from it."""
        self._ring_slots = ring_slots
        self._ring_slot_bytes = ring_slot_bytes
        self._world_size: int = config.parallel_config.world_size  # tensor x pipeline parallel ranks
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(protocol.WorkerMessage)
        self._first_stage_reports = False
        """Whether a pipeline's first stage's rank 0 sends a `protocol.FirstStageReport` every step (known after
        `start()`)."""
        self._reports: dict[int, protocol.FirstStageReport] = {}
        """Those reports by step id, until their step is collected."""
        self._early: deque[protocol.ModelRunnerOutput] = deque()
        """Step outputs that arrived while `collect()` waited for an older step's report."""
        self._procs: list[subprocess.Popen] = []
        self._ipc_dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._results: zmq.Socket | None = None
        self._ring: BroadcastWriter | None = None
        self._forget_names: Callable[[], None] = lambda: None
        self._failure: AsyncLLMError | None = None
        self._closed = False
        self._pending: deque[tuple[int, float]] = deque()
        """(step_id, submitted at) of the steps submitted and not collected, oldest first."""
        self._last_reply_at = 0.0
        self.num_cpu_blocks = 0
        """CPU blocks every rank can hold (the min over ranks), known after `start()`: the swap space's, then the
        CPU prefix-cache tier's."""
        self.num_offload_blocks = 0
        """Of those, the CPU prefix-cache tier's (kv_offloading_size)."""
        self.vocab_size = 0
        """The model's vocabulary size as the workers loaded it (0: unknown), known after `start()`."""
        self.state_checkpoints = 0
        """Checkpoint slots of a hybrid model's states (prefix caching; 0: none), known after `start()`."""
        self.mm_piece_merge = 0
        """`asyncllm.protocol.WorkerReady.mm_piece_merge` (any rank's), known after `start()`."""
        self.mm_piece_audio_window = 0
        """`asyncllm.protocol.WorkerReady.mm_piece_audio_window` (any rank's), known after `start()`."""
        self.served_architectures: list[str] | None = None
        """`asyncllm.protocol.WorkerReady.architectures` (rank 0's), known after `start()`."""
        self.kv_budget_field = ""
        """`asyncllm.protocol.WorkerReady.kv_budget_field` (rank 0's), known after `start()`."""

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    # ------------------------------------------------------------ the contract
    def start(self) -> int:
        """Spawn the workers, wait until each loaded its shard; return the min KV blocks over ranks."""
        assert not self._procs and not self._closed, "start() runs once"
        timeout_s = envs.ENGINE_STARTUP_TIMEOUT_S.get()
        try:
            self._open_channels()
            self._spawn_workers()
            deadline = time.monotonic() + timeout_s
            if self._world_size > 1:  # the port rank 0's torch.distributed store got as it bound: to every rank
                opened = self._receive(deadline, "open the torch.distributed rendezvous")
                if not isinstance(opened, protocol.RendezvousOpened):
                    raise EngineDeadError(f"rank 0 sent {type(opened).__name__} before opening the rendezvous")
                self._broadcast(protocol.JoinRendezvous(opened.port), deadline)
            ready = self._gather(protocol.WorkerReady, deadline, "load the model")
            self._await_ring_readers(deadline)
            # Every worker is connected to both sockets now, and connected ipc:// sockets outlive their paths: with
            # the folder removed at once no crash of the core (SIGKILL, or stdin EOF's os._exit) can leave it behind,
            remove_dir(self._ipc_dir)
            self._forget_names()  # and the parent-death signal (procutil.at_orphan_exit) is armed again
        except BaseException:
            self.shutdown()
            raise
        self.num_offload_blocks = min(msg.num_offload_blocks for msg in ready)
        self.num_cpu_blocks = min(msg.num_cpu_blocks - msg.num_offload_blocks for msg in ready) + self.num_offload_blocks
        self.vocab_size = min(msg.vocab_size for msg in ready)
        self.state_checkpoints = min(msg.state_checkpoints for msg in ready)
        self.mm_piece_merge = max(msg.mm_piece_merge for msg in ready)  # a pipeline stage may not hold the tower
        self._first_stage_reports = any(msg.first_stage_reports for msg in ready)
        self.mm_piece_audio_window = max(msg.mm_piece_audio_window for msg in ready)
        self.served_architectures, self.kv_budget_field = ready[0].architectures, ready[0].kv_budget_field
        return min(msg.num_available_blocks for msg in ready)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Every rank allocates its paged KV cache of ``num_gpu_blocks`` blocks (and its CPU swap space)."""
        deadline = time.monotonic() + envs.ENGINE_STARTUP_TIMEOUT_S.get()
        self._broadcast(protocol.InitCache(num_gpu_blocks, num_cpu_blocks), deadline)
        self._gather(protocol.CacheReady, deadline, "allocate the KV cache")

    def update_weights(self, command: protocol.UpdateWeights) -> list[protocol.WeightsUpdated]:
        """Every rank checks, then copies the new weights in place (workers/weight_update.py); their answers in
        rank order. Call with no step in flight. A rank that fails while copying fails the executor."""
        assert not self._pending, "update_weights() with steps still in flight: collect() them first"
        deadline = time.monotonic() + envs.ENGINE_STARTUP_TIMEOUT_S.get()  # as long as loading the model may take
        self._broadcast(command, deadline)
        return self._gather(protocol.WeightsUpdated, deadline, "load the new weights")

    def sleep_mode(self, command: protocol.Sleep | protocol.WakeUp) -> list[protocol.SleepModeDone]:
        """Every rank frees or takes back its memory (workers/sleep.py); their answers in rank order. Call with no
        step in flight. A rank that fails (out of memory at wake-up) fails the executor."""
        assert not self._pending, "sleep_mode() with steps still in flight: collect() them first"
        deadline = time.monotonic() + envs.ENGINE_STARTUP_TIMEOUT_S.get()  # a wake-up may recapture CUDA graphs
        self._broadcast(command, deadline)
        return self._gather(protocol.SleepModeDone, deadline, "sleep or wake up")

    def pin_lora(self, command: protocol.PinLoRA) -> list[protocol.LoRAPinned]:
        """Every rank pins or unpins a LoRA adapter (workers/lora_runner.py); their answers in rank order."""
        self._broadcast(command, deadline := time.monotonic() + envs.ENGINE_STARTUP_TIMEOUT_S.get())  # reads files
        return self._gather(protocol.LoRAPinned, deadline, "pin a LoRA adapter")

    def execute_model(self, sched_out: protocol.SchedulerOutput) -> protocol.ModelRunnerOutput:
        """Run one step on every rank; return the output rank's (`EngineDeadError` past the watchdog)."""
        assert not self._pending, "execute_model() with steps still in flight: collect() them first"
        self.submit(sched_out)
        return self.collect()

    def submit(self, sched_out: protocol.SchedulerOutput) -> None:
        """Send one step to every rank without waiting for it (async_scheduling: at most two in flight).

        Workers run steps in submission order; `collect()` returns their outputs in that order.
        """
        timeout = self.config.worker_step_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        self._broadcast(sched_out, deadline)
        self._pending.append((sched_out.step_id, time.monotonic()))

    def collect(self) -> protocol.ModelRunnerOutput:
        """The output rank's output of the oldest submitted step (`EngineDeadError` past the watchdog): rank 0's,
        or with pipeline stages the last stage's first rank's (workers/pipeline.py).

        A step's watchdog counts from when it could start: its submission, or
        the previous step's reply if that came later (the workers were busy).
        """
        assert self._pending, "collect() with no step in flight"
        step_id, submitted_at = self._pending[0]
        timeout = self.config.worker_step_timeout_s
        deadline = None if timeout is None else max(submitted_at, self._last_reply_at) + timeout
        limit = f"worker_step_timeout_s={timeout}"
        message = self._early.popleft() if self._early else self._receive(deadline, f"run step {step_id}", limit)
        assert isinstance(message, protocol.ModelRunnerOutput), f"expected step output, got {message!r}"
        assert message.step_id == step_id, f"output of step {message.step_id} for step {step_id}"
        if self._first_stage_reports:  # what the first stage alone knows of this step
            report = self._first_stage_report(step_id, deadline, limit)
            message.mm_encoder_cache_queries += report.queries
            message.mm_encoder_cache_hits += report.hits
            message.failed_requests = {**message.failed_requests, **report.failed_requests}
        self._pending.popleft()
        self._last_reply_at = time.monotonic()
        return message

    def _first_stage_report(self, step_id: int, deadline: float | None, limit: str) -> protocol.FirstStageReport:
        """Step ``step_id``'s `protocol.FirstStageReport`, waited for (the sockets do not order one rank's report
        before another's output): later steps' outputs that come first wait in ``_early``."""
        while step_id not in self._reports:
            message = self._receive(deadline, f"report step {step_id}", limit, reports=True)
            if message is not None:
                assert isinstance(message, protocol.ModelRunnerOutput), f"expected step output, got {message!r}"
                self._early.append(message)
        return self._reports.pop(step_id)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps submitted and not collected yet."""
        return len(self._pending)

    def check_workers(self) -> None:
        """`EngineDeadError` if the executor failed or a worker exited (the core calls it while idle)."""
        self._raise_if_failed()
        self._check_workers()

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force), free the ring and the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_workers()
        if self._results is not None:
            self._results.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._ring is not None:
            self._ring.close()
        if self._ipc_dir is not None:
            remove_dir(self._ipc_dir)
        self._forget_names()

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------ startup
    def _open_channels(self) -> None:
        self._ipc_dir = private_ipc_dir()  # 0700: only this user can connect
        self._ctx = zmq.Context()
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind(f"ipc://{self._ipc_dir}/results")
        self._ring = BroadcastWriter(
            self._world_size, f"ipc://{self._ipc_dir}/broadcast", self._ring_slots, self._ring_slot_bytes
        )
        ring, ipc_dir = self._ring, self._ipc_dir  # named until every worker is ready: a host gone meanwhile ends us
        self._forget_names = at_orphan_exit(lambda: (ring.unlink(), remove_dir(ipc_dir)))  # with no `shutdown`

    def _spawn_workers(self) -> None:
        assert self._ring is not None and self._ipc_dir is not None
        common = [
            "--world-size", str(self._world_size),
            "--config-json", msgspec.json.encode(self.config.to_dict(wire=True)).decode(),
            "--ring-json", msgspec.json.encode(self._ring.handle).decode(),
            "--result-address", f"ipc://{self._ipc_dir}/results",
        ]
        if self._runner is not None:
            common += ["--runner", self._runner]
        if self._hf_config_json is not None:
            common += ["--hf-config-json", self._hf_config_json]
        for rank in range(self._world_size):
            self._procs.append(spawn_module("asyncllm.workers.worker", ["--rank", str(rank), *common],
                                            {envs.CORE_PID_NAME: str(os.getpid())}))  # (its trace's marker)

    def _await_ring_readers(self, deadline: float) -> None:
        """Every worker attached to the ring (which then unlinks its name: nothing can leak)."""
        assert self._ring is not None
        while True:
            try:
                self._ring.wait_for_readers(timeout=_POLL_S)
                return
            except TimeoutError:
                self._check_workers()
                if time.monotonic() >= deadline:
                    self._fail(EngineDeadError("workers did not attach to the broadcast ring in time"))

    # ------------------------------------------------------------ messaging
    def _broadcast(self, command: protocol.WorkerCommand, deadline: float | None) -> None:
        """Put one command on the ring, checking the workers while it is full (or not yet joined)."""
        self._raise_if_failed()
        if self._closed:
            raise EngineDeadError("the executor was shut down")
        assert self._ring is not None, "start() first"
        payload = self._encoder.encode(command)
        while True:
            try:
                self._ring.enqueue(payload, timeout=_POLL_S)
                return
            except TimeoutError:
                self._check_workers()
                if deadline is not None and time.monotonic() >= deadline:
                    self._fail(EngineDeadError(f"workers did not take {type(command).__name__} in time"))

    def _gather(self, kind: type[_Reply], deadline: float, what: str) -> list[_Reply]:
        """One `kind` message from every rank, in rank order."""
        got: dict[int, _Reply] = {}
        while len(got) < self._world_size:
            message = self._receive(deadline, what)
            assert isinstance(message, kind), f"expected {kind.__name__}, got {message!r}"
            got[message.rank] = message
        return [got[rank] for rank in range(self._world_size)]

    def _receive(self, deadline: float | None, what: str,
                 limit: str = f"the startup timeout ({envs.ENGINE_STARTUP_TIMEOUT_S.name})",
                 reports: bool = False) -> protocol.WorkerMessage | None:
        """The next worker message, a `protocol.FirstStageReport` kept (None for it when ``reports``); a
        WorkerError, a dead worker or the deadline raise instead."""
        self._raise_if_failed()
        assert self._results is not None
        while True:
            if self._results.poll(int(_POLL_S * 1000), zmq.POLLIN):
                message = self._decoder.decode(self._results.recv())
                if isinstance(message, protocol.WorkerError):  # a peer killed fails its partners first: name it
                    peers = self._world_size > 1 and not message.config_error  # every rank sends a config's own
                    dead = first_exited(self._procs, _LAST_WORDS_S, message.rank, killed=True) if peers else None
                    self._fail(protocol.worker_failure(message) if dead is None else self._death(*dead))
                if isinstance(message, protocol.FirstStageReport):  # kept for its step's output
                    self._reports[message.step_id] = message
                    if reports:
                        return None
                    continue
                return message
            self._check_workers()
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(EngineDeadError(f"workers did not {what} within {limit}"))

    # ------------------------------------------------------------ failures
    def _check_workers(self) -> None:
        """Raise if a worker process has exited, preferring the WorkerError it sent first."""
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is None:
                continue
            last_words = self._last_worker_error()
            if last_words is not None and last_words.rank == rank:  # its own, not a partner's broken collective
                self._fail(protocol.worker_failure(last_words))
            self._fail(self._death(rank, code))

    def _death(self, rank: int, code: int) -> EngineDeadError:
        return EngineDeadError(f"worker rank {rank} (pid {self._procs[rank].pid}) {describe_exit(code)}")

    def _last_worker_error(self) -> protocol.WorkerError | None:
        assert self._results is not None
        deadline = time.monotonic() + _LAST_WORDS_S
        while self._results.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            message = self._decoder.decode(self._results.recv())
            if isinstance(message, protocol.WorkerError):
                return message
        return None

    def _fail(self, error: AsyncLLMError) -> None:
        """Remember the failure (every later call re-raises it) and raise it; the steps in flight are lost."""
        self._failure = error
        self._pending.clear()
        raise error

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(f"the executor already failed: {self._failure}")

    def _stop_workers(self) -> None:
        """ShutdownWorker and a grace period; after a failure, go straight to the stop (live ranks may be stuck in a
        collective with a dead peer)."""
        polite = self._failure is None
        alive = [proc for proc in self._procs if polite and proc.poll() is None]
        if alive and self._ring is not None:
            try:
                self._ring.enqueue(self._encoder.encode(protocol.ShutdownWorker()), timeout=0.5)
            except TimeoutError:
                pass  # a reader is gone or stuck: the stop below handles it
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for proc in alive:  # and on past the grace while it writes its step trace (workers/step_trace.py)
            wait_for_exit(proc, deadline - time.monotonic(), proc.pid)
        for proc in self._procs:
            if not polite:  # a hung or stopped rank ignores stdin EOF and SIGTERM: nothing of it is worth waiting for
                proc.kill()
            stop_process(proc, timeout=2.0)  # reaps it and closes its stdin pipe
