"""data_parallel_size > 1: the pieces that need no engine (docs/parallelism.md).

Each replica is a whole engine core with its own tensor_parallel_size workers,
KV cache and scheduler. This module says which CUDA devices a replica's
workers see, which replica takes a request (vLLM's frontend rule: the least
``4 x waiting + running``, ties to the lowest index) and how the replicas'
stats add up to the engine's. None of it imports torch or touches CUDA.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import fields
from itertools import zip_longest
from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.outputs import EngineStats
from asyncllm.protocol import SchedulerStats

__all__ = ["WAITING_WEIGHT", "combined_stats", "load_score", "replica_devices", "replica_env", "served_max_model_len",
           "visible_cuda_devices"]

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

WAITING_WEIGHT = 4
"""vLLM's balancing score: a waiting request weighs as much as four running ones (it still needs a slot and its
whole prefill)."""


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this host may use, found without initialising CUDA: CUDA_VISIBLE_DEVICES when set, else
    the driver's list (`driver_gpu_count`)."""
    listed = os.environ.get(CUDA_VISIBLE_DEVICES)
    if listed is not None:
        return [device.strip() for device in listed.split(",") if device.strip()]
    return [str(i) for i in range(driver_gpu_count())]


def driver_gpu_count() -> int:
    """The NVIDIA GPUs this machine shows: ``/proc/driver/nvidia/gpus``, or the ``/dev/nvidiaN`` device nodes of a
    container (0 on a machine without the driver)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        try:
            return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
        except OSError:
            return 0


def replica_devices(config: EngineConfig) -> list[list[str]] | None:
    """The CUDA devices of each replica (replica i: devices i*w .. (i+1)*w-1 of the visible ones, w its ranks:
    tensor_parallel_size x pipeline_parallel_size), or None when the workers run on the CPU (device "cpu", or
    "auto" without a GPU) or there is one replica.

    Raises `ConfigError` when fewer than data_parallel_size x w devices are visible (with one replica too, before
    any worker is spawned: naming the field the user set, not a worker rank's count).
    """
    dp, world = config.data_parallel_size, config.parallel_config.world_size
    if dp * world == 1 or config.device == "cpu":
        return None
    visible = visible_cuda_devices()
    if config.device == "auto" and (not visible or (dp == 1 and not driver_gpu_count())):
        return None  # (one replica: CUDA_VISIBLE_DEVICES set on a machine without a GPU runs on the CPU)
    if len(visible) < dp * world:
        field = ("data_parallel_size" if dp > 1 else
                 "pipeline_parallel_size" if config.pipeline_parallel_size > 1 else "tensor_parallel_size")
        raise ConfigError(field, getattr(config, field), f"data_parallel_size x tensor_parallel_size x "
                          f"pipeline_parallel_size = {dp * world} CUDA devices, but {len(visible)} are visible "
                          f"({CUDA_VISIBLE_DEVICES}={os.environ.get(CUDA_VISIBLE_DEVICES, 'unset')}); lower "
                          f"{field}")
    return None if dp == 1 else [visible[i * world:(i + 1) * world] for i in range(dp)]


def replica_env(devices: list[list[str]] | None, index: int) -> dict[str, str] | None:
    """Environment of replica `index`'s core (its workers inherit it): its own devices only, so that each worker
    picks ``cuda:rank`` among them."""
    return None if devices is None else {CUDA_VISIBLE_DEVICES: ",".join(devices[index])}


def load_score(stats: SchedulerStats, num_waiting: int) -> int:
    """``4 x waiting + running`` (vLLM's DP load balancer): `stats` is the replica's core's latest snapshot,
    `num_waiting` the host's estimate of its waiting requests (`HostAdmission.num_waiting`: the snapshot's plus the
    requests sent to the core that its ``host_samples_queued`` does not count yet, less those that failed: refused,
    they never queued)."""
    return WAITING_WEIGHT * num_waiting + stats.num_requests_running


_NOT_SUMMED = frozenset({"engine_alive", "kv_cache_usage", "extra", "replicas", "weights_version", "is_sleeping",
                         "sleep_level", "awaiting_weights"})


def combined_stats(replicas: list[EngineStats]) -> EngineStats:
    """The engine's stats from its replicas': counters and gauges added up (dicts per key, lists per position),
    KV usage as used over total blocks, alive while any replica is; `replicas` keeps the per-replica snapshots."""
    total = EngineStats(engine_alive=any(s.engine_alive for s in replicas), replicas=list(replicas))
    for field in fields(EngineStats):
        if field.name in _NOT_SUMMED:
            continue
        values = [getattr(s, field.name) for s in replicas]
        if isinstance(values[0], dict):
            merged: dict = {}
            for value in values:
                for key, count in value.items():
                    merged[key] = merged.get(key, 0) + count
            setattr(total, field.name, merged)
        elif isinstance(values[0], list):
            setattr(total, field.name, [sum(column) for column in zip_longest(*values, fillvalue=0)])
        else:
            setattr(total, field.name, sum(values))
    total.kv_cache_usage = total.num_used_blocks / total.num_gpu_blocks if total.num_gpu_blocks else 0.0
    live = [s for s in replicas if s.engine_alive] or replicas  # a dead replica serves nothing: no older weights
    total.weights_version = min(s.weights_version for s in live)  # every live replica serves at least these weights
    total.is_sleeping = any(s.is_sleeping for s in replicas)  # sleep and wake_up fan out: they agree but briefly
    total.sleep_level = max(s.sleep_level for s in replicas)
    total.awaiting_weights = any(s.awaiting_weights for s in replicas)
    return total


def served_max_model_len(replicas: Sequence[Any], config: EngineConfig) -> EngineConfig:
    """`config` with the least max_model_len the replicas' cores serve (`replica.Replica`s), as vLLM's one
    max_model_len ``auto`` for all its data-parallel engines (each replica's core fits its own KV cache). Every
    started replica's processor serves it (`Processor.serve_max_model_len`): prompts are checked against it and
    every sequence ends there, on a core fitted longer too; a new least (a restarted core's fit) reaches them all.
    With one replica, or a set max_model_len, this is the core's own."""
    least = min((replica.max_model_len for replica in replicas if replica.max_model_len), default=config.max_model_len)
    for replica in replicas:
        if replica.processor is not None and replica.max_model_len:  # 0: no core serving yet, nothing to tell
            replica.processor.serve_max_model_len(least)
    return config.replace(max_model_len=least)
