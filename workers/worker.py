"""Worker process main: one per rank (tensor x pipeline parallel), started by the `Executor`.

Run as ``python -m asyncllm.workers.worker --rank R --world-size N ...`` (a
fresh interpreter, never a fork, so CUDA state is never inherited). A worker
is its own process, even at tensor_parallel_size 1, so that a CUDA fault or an
OOM kills the worker and not the engine core.

Life of a worker: join the torch.distributed group (`Worker.rendezvous_store`), load the model, report
`WorkerReady` with the KV blocks it can hold, then loop: read a
`WorkerCommand` from the shared-memory ring, run it, reply on zmq (only rank 0, or
with pipeline stages the last stage's first rank, returns `ModelRunnerOutput`; every
rank acknowledges `InitCache`). On CUDA a
step's output is sent once the next step is launched, when that one is
already waiting (`StepPipeline`, workers/step_pipeline.py; with
``ASYNCLLM_WORKER_TRACE_STEPS`` set, `TracedPipeline` runs a range of the
steps under torch.profiler, workers/step_trace.py). Any
exception is reported as `WorkerError` and the worker exits with code 1; it
exits with code 0 on `ShutdownWorker`, and at once when the core dies.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from asyncllm import envs, protocol
from asyncllm.child_logging import configure_child_logging
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.checkpoint import hf_config_from_json
from asyncllm.pipeline_parallel import output_rank
from asyncllm.procutil import exit_when_parent_dies, ignore_group_signals, report_crashes
from asyncllm.workers.shm_broadcast import BroadcastReader, RingHandle
from asyncllm.workers.step_pipeline import StepPipeline

__all__ = ["Worker", "main", "run_worker", "resolve_device", "load_runner_class", "error_message"]

logger = logging.getLogger("asyncllm.workers.worker")

_RESULT_LINGER_MS = 5000
"""How long a closing worker keeps trying to deliver its last message (e.g. a WorkerError)."""
_DIST_TIMEOUT = timedelta(minutes=10)
"""torch.distributed rendezvous and collective timeout (ranks may load the model at different speeds)."""
_LOOPBACK = "127.0.0.1"
"""Where rank 0 serves the torch.distributed store (every rank runs on this machine)."""


def resolve_device(device: str, rank: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
                   ) -> torch.device:
    """config.device -> this rank's torch device ("auto" = cuda when available; rank r uses cuda:r). Too few
    devices for the ranks is a `ConfigError` naming the field as set (the host checks first: data_parallel.py)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device", device, "'cpu' or 'auto': no CUDA device is visible to the worker")
    count = torch.cuda.device_count()
    if rank >= count:
        field, value = (("pipeline_parallel_size", pipeline_parallel_size) if pipeline_parallel_size > 1
                        else ("tensor_parallel_size", tensor_parallel_size))
        raise ConfigError(field, value, f"tensor_parallel_size x pipeline_parallel_size = "
                          f"{tensor_parallel_size * pipeline_parallel_size} ranks, one per CUDA device, but "
                          f"{count} are visible")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def mm_piece_fields(model: Any) -> tuple[int, int]:
    """`WorkerReady`'s ``mm_piece_merge`` and ``mm_piece_audio_window``: a Qwen-Omni model's (``use_audio_in_video``
    pieces), read from the whole model a pipeline stage (`StageModel`) wraps; (0, 0) for any other model."""
    model = getattr(model, "causal_lm", model)
    merge = int(getattr(model, "merge", 0)) if hasattr(model, "mm_audio_in_video") else 0
    return merge, int(getattr(model, "mm_piece_audio_window", 0))


def load_runner_class(spec: str | None, pipeline_parallel_size: int = 1) -> type:
    """The model runner class: asyncllm's `ModelRunner` (`PipelineModelRunner` with pipeline stages), or
    ``module:Class`` / ``file.py:Class``.

    The override is a seam for tests, which drive the worker plumbing with a
    fake runner instead of a model.
    """
    if spec is None and pipeline_parallel_size > 1:
        from asyncllm.workers.pipeline import PipelineModelRunner

        return PipelineModelRunner
    if spec is None:
        from asyncllm.workers.model_runner import ModelRunner

        return ModelRunner
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(f"_asyncllm_runner_{os.getpid()}", where)
        assert module_spec is not None and module_spec.loader is not None, f"cannot load {where}"
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def init_distributed(device: torch.device, rank: int, world_size: int, store: dist.Store) -> None:
    """Join the tensor-parallel group (gloo on CPU, NCCL on CUDA) on `store` before the model is built."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_DIST_TIMEOUT)


def _pipelined(runner: Any) -> bool:
    """ASYNCLLM_WORKER_PIPELINE: 'auto' pipelines on CUDA, where a launch returns before the GPU is done."""
    mode = envs.WORKER_PIPELINE.get()
    device = getattr(runner, "device", None)
    return mode == "on" or (mode == "auto" and device is not None and device.type == "cuda")


def error_message(rank: int, exc: BaseException) -> protocol.WorkerError:
    """A `WorkerError` that keeps the exception's type (and a ConfigError's field)."""
    parts = protocol.config_error_parts(exc)
    return protocol.WorkerError(rank, str(exc) or type(exc).__name__, type(exc).__name__, parts)


def _drop(output: protocol.ModelRunnerOutput) -> None:
    """The step outputs of a rank that reports nothing of them."""


class Worker:
    """One rank: its ring reader, its runner and its socket back to the executor."""

    def __init__(self, args: argparse.Namespace, results: zmq.Socket) -> None:
        self.args = args
        self.rank: int = args.rank
        self.world_size: int = args.world_size
        self.results = results
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(protocol.WorkerCommand)
        self.reader: BroadcastReader | None = None
        self.runner: Any = None
        self.config: EngineConfig | None = None
        self.pipelined = False
        """Launch each step before sending the last one's output (`StepPipeline`, ASYNCLLM_WORKER_PIPELINE)."""
        self.sleeper: Any = None
        """What of this rank's memory sleeps (workers/sleep.py; made at the first `Sleep`)."""

    def setup(self) -> None:
        """Attach to the ring, pick the device, join the TP group, build the runner."""
        args = self.args
        config = self.config = EngineConfig.from_dict(msgspec.json.decode(args.config_json))
        self.reader = BroadcastReader(msgspec.json.decode(args.ring_json, type=RingHandle), self.rank)
        device = resolve_device(config.device, self.rank, config.tensor_parallel_size,
                                config.pipeline_parallel_size)
        threads = cpu_threads(self.world_size * config.data_parallel_size) if device.type == "cpu" else None
        if threads is not None:
            torch.set_num_threads(threads)
        init_distributed(device, self.rank, self.world_size, self.rendezvous_store())
        runner_cls = load_runner_class(args.runner, config.pipeline_parallel_size)
        self.runner = runner_cls(config, self.rank, self.world_size, device)
        if args.hf_config_json is not None and hasattr(self.runner, "hf_config"):
            self.runner.hf_config = hf_config_from_json(args.hf_config_json)  # not read again (and no config class)
        self.pipelined = _pipelined(self.runner) and config.pipeline_parallel_size == 1  # stages never defer

    def rendezvous_store(self) -> dist.Store:
        """The store the ranks meet on. One rank: its own `HashStore`, no port. More: rank 0 serves a `TCPStore` on
        the port the kernel gives it as it binds (a port picked first and bound later may be taken in between:
        EADDRINUSE under load) and says which (`RendezvousOpened`); the executor passes it on to every rank, rank 0
        included (`JoinRendezvous`, the first command on the ring)."""
        if self.world_size == 1:
            return dist.HashStore()
        assert self.reader is not None, "attach to the ring first"
        served = None
        if self.rank == 0:
            served = dist.TCPStore(_LOOPBACK, 0, self.world_size, is_master=True, timeout=_DIST_TIMEOUT,
                                   wait_for_workers=False)  # the others learn its port only after this returns
            self.send(protocol.RendezvousOpened(served.port))
        command = self.decoder.decode(self.reader.dequeue(timeout=_DIST_TIMEOUT.total_seconds()))
        if not isinstance(command, protocol.JoinRendezvous):
            raise RuntimeError(f"expected JoinRendezvous before any other command, got {type(command).__name__}")
        if served is not None:
            return served
        return dist.TCPStore(_LOOPBACK, command.port, self.world_size, is_master=False, timeout=_DIST_TIMEOUT)

    def start(self) -> None:
        """Load the model, size the KV cache, and say so to the executor."""
        self.runner.load_model()
        num_blocks = int(self.runner.determine_num_available_blocks())
        swap = self.config is not None and self.config.preemption_mode == "swap"
        num_cpu_blocks = int(self.runner.determine_num_cpu_blocks()) if swap else 0
        offload = self.config is not None and self.config.kv_offloading_size > 0
        num_offload_blocks = int(self.runner.determine_num_offload_blocks()) if offload else 0
        hf_config = getattr(self.runner, "hf_config", None)
        vocab_size = int(getattr(hf_config, "vocab_size", 0) or 0)  # 0: a test runner
        architectures = getattr(hf_config, "architectures", None)
        architectures = None if architectures is None else list(architectures)
        checkpoints = int(getattr(getattr(self.runner, "model", None), "checkpoint_slots", 0))  # hybrids' (docs)
        piece_merge, piece_audio_window = mm_piece_fields(getattr(self.runner, "model", None))
        self.send(protocol.WorkerReady(self.rank, num_blocks, num_cpu_blocks + num_offload_blocks, vocab_size,
                                       checkpoints, num_offload_blocks, piece_merge, self._reports_first_stage(),
                                       piece_audio_window, architectures,
                                       str(getattr(self.runner, "kv_budget_field", ""))))

    def run(self) -> None:
        """The command loop; returns on `ShutdownWorker`."""
        assert self.reader is not None and self.config is not None, "setup() first"
        reader = self.reader
        sends = self.rank == output_rank(self.config.tensor_parallel_size, self.config.pipeline_parallel_size)
        reports = self._reports_first_stage()
        send = self.send if sends else self._send_report if reports else _drop
        traced = envs.WORKER_TRACE_STEPS.get()
        if traced is None:  # the plain pipeline: a trace costs the steps nothing unless asked for
            pipeline = StepPipeline(self.runner, send, self.pipelined)
        else:
            from asyncllm.workers.step_trace import TracedPipeline

            pipeline = TracedPipeline(self.runner, send, self.pipelined, self.rank, traced)
        while True:
            pipeline.wait(reader.has_message)
            command = self.decoder.decode(reader.dequeue())
            if isinstance(command, protocol.SchedulerOutput):
                pipeline.step(command)
                continue
            pipeline.flush()
            if isinstance(command, protocol.InitCache):
                self.runner.init_cache(command.num_gpu_blocks)
                if command.num_cpu_blocks:
                    self.runner.init_swap_space(command.num_cpu_blocks)
                self.send(protocol.CacheReady(self.rank))
            elif isinstance(command, protocol.UpdateWeights):  # after the flush: no step of the old weights in flight
                from asyncllm.workers.weight_update import update_weights  # here: the tests' fake runners need no loader

                self.send(update_weights(self.runner, command, self.rank))
            elif isinstance(command, (protocol.Sleep, protocol.WakeUp)):  # after the flush: no step reads the memory
                from asyncllm.workers.sleep import RunnerSleep

                self.sleeper = self.sleeper or RunnerSleep(self.runner)
                self.send(self.sleeper.handle(command, self.rank))
            elif isinstance(command, protocol.PinLoRA):  # after the flush: no step reads the slots meanwhile
                from asyncllm.workers.lora_runner import pin_lora

                self.send(pin_lora(self.runner, command, self.rank))
            else:
                assert isinstance(command, protocol.ShutdownWorker), command
                pipeline.close()
                if self.pipelined and pipeline.num_steps:
                    logger.info("pipelined steps: %d of %d launched while the previous one was in flight",
                                pipeline.num_overlapped, pipeline.num_steps)
                return

    def send(self, message: protocol.WorkerMessage) -> None:
        self.results.send(self.encoder.encode(message))

    def _reports_first_stage(self) -> bool:
        """Whether this rank is a pipeline's first stage's rank 0 of an image-text model: the one rank that encodes
        its images (`protocol.FirstStageReport`)."""
        assert self.config is not None
        return (self.rank == 0 and self.config.pipeline_parallel_size > 1
                and getattr(self.runner, "mm_runner", None) is not None)

    def _send_report(self, output: protocol.ModelRunnerOutput) -> None:
        """A rank other than the output rank (0; with pipeline stages the last stage's first) finishes every step
        but sends nothing of it: a pipeline's first stage's rank 0 of an image-text model its `FirstStageReport`
        (its encoder-cache counts and the requests whose items it found malformed; without stages the output rank
        has both)."""
        self.send(protocol.FirstStageReport(output.step_id, output.mm_encoder_cache_queries,
                                            output.mm_encoder_cache_hits, output.failed_requests))

    def close(self) -> None:
        """Leave the TP group and detach from the ring (whatever setup got to)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.reader is not None:
            self.reader.close()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="asyncllm.workers.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--config-json", required=True, help="EngineConfig.to_dict(wire=True) as JSON")
    parser.add_argument("--hf-config-json", default=None, help="the checkpoint's config as the host read it")
    parser.add_argument("--ring-json", required=True, help="the broadcast ring's RingHandle as JSON")
    parser.add_argument("--result-address", required=True, help="zmq address of the executor's PULL socket")
    parser.add_argument("--runner", default=None, help="runner class as module:Class or file.py:Class (tests only)")
    return parser.parse_args(argv)


def cpu_threads(ranks_on_host: int) -> int | None:
    """Torch threads of one CPU worker: its share of the cores it may run on (every replica's workers share them),
    or None when ``OMP_NUM_THREADS`` is a count (an int >= 1), which torch already took at import (another value it
    ignores: the share then)."""
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) >= 1:
        return None
    return max(1, usable_cores() // ranks_on_host)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's cpuset), which torch's own
    default thread count follows too, not every core of the machine (``os.cpu_count``, where there is no affinity)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def run_worker(args: argparse.Namespace) -> int:
    """Set up, serve commands, tear down; returns the exit code (1 after a reported error)."""
    ctx = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, _RESULT_LINGER_MS)
    results.connect(args.result_address)
    worker = Worker(args, results)
    code = 0
    try:
        worker.setup()
        worker.start()
        worker.run()
    except Exception as exc:  # noqa: BLE001 - reported to the executor, which raises it in the core
        if not isinstance(exc, ConfigError):  # a bad config is the host's one line (`asyncllm serve`: exit 2)
            logger.error("worker rank %d failed:\n%s", args.rank, traceback.format_exc())
        results.send(msgspec.msgpack.encode(error_message(args.rank, exc)))
        code = 1
    else:
        worker.close()  # a clean stop only: after a failure the group may be unusable, and exiting frees it all
    finally:
        results.close()
        ctx.term()  # waits up to the linger for the last message to leave
    return code


def main(argv: list[str] | None = None) -> None:
    exit_when_parent_dies()
    report_crashes()
    ignore_group_signals()  # Ctrl-C and SIGTERM reach the whole process group; the core owns the shutdown order
    args = _parse_args(argv)
    configure_child_logging(f"worker {args.rank}")
    code = run_worker(args)
    # Everything is closed by now. Skip interpreter finalization: the parent-watch
    # thread sits in a read of stdin, and finalizing under it aborts the process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
