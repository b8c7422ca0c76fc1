"""Sleep mode on one worker rank (docs/sleep-mode.md): give the GPU memory back, take it again.

Level 1 moves every tensor the model holds on the device (parameters, buffers, tensor attributes: a pre-quantized
layer's repacked weights and scales; workers/sleep_tensors.py) to CPU memory (pinned on CUDA, for fast copies back),
storage by storage, so aliases and views survive; level 2 replaces each parameter's data by an empty tensor (the
Parameter objects stay, with their loader attributes, so `update_weights` can copy into them after the wake-up) and
keeps the buffers (rotary tables: small, derived from the config). Level 2 is refused for pre-quantized checkpoints,
which `update_weights` cannot reload. Both free the KV cache tensors and the CUDA graphs, then return the cached
blocks to the driver (`torch.cuda.empty_cache`).

A wake-up allocates new tensors, at new device addresses. A captured CUDA graph replays the addresses it was
captured with, so the graphs are dropped at sleep and captured again once the weights and the KV cache are both
back (`capture_decode_graphs`, which also decides whether graphs apply at all). The CPU swap space is CPU memory
and stays (it holds nothing by then: the core recomputes every request that held KV).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncllm import protocol
from asyncllm.engine.sleep import WAKE_TAGS, sleep_error_reply
from asyncllm.errors import NotBuiltError
from asyncllm.workers import cuda_graphs, weight_update
from asyncllm.workers.sleep_tensors import Offloaded, held_tensors, storage_key

__all__ = ["RunnerSleep", "refuse_unbuilt"]

logger = logging.getLogger(__name__)


def refuse_unbuilt(runner: Any, command: protocol.Sleep | protocol.WakeUp) -> None:
    """A level-2 sleep of a pre-quantized checkpoint's weights: they would come back only through `update_weights`,
    which does not load those (level 1 moves every tensor, and works; the KV cache alone sleeps at either level)."""
    if not isinstance(command, protocol.Sleep) or command.level != 2 or "weights" not in (command.tags or ["weights"]):
        return
    try:
        weight_update.refuse_unbuilt(runner, "sleep(level=2)")
    except NotBuiltError as exc:
        raise NotBuiltError(exc.field, exc.value, f"{exc.feature} (update_weights must load the weights after it, "
                                                  "and is not built for this format; level 1 works)") from None


class RunnerSleep:
    """What of one runner's memory sleeps, and the moves between the states."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.weights = "awake"
        """awake, offloaded (level 1) or discarded (level 2)."""
        self.kv_asleep = False
        self.num_blocks = 0
        """The KV cache's blocks when it was freed (a wake-up allocates as many)."""
        self.offloaded: Offloaded | None = None
        """Level 1: the model's device tensors in CPU memory (a later level 2 empties the parameters among them)."""
        self.discarded: dict[str, torch.Tensor] = {}
        """Level 2: name -> a meta tensor of the parameter's shape, dtype and strides."""
        self.draft: Offloaded | None = None
        """The draft's own tensors (a draft model, an EAGLE head, an MTP layer) in CPU memory: at either level
        (update_weights loads the served model's weights only, so the draft's are kept)."""

    def handle(self, command: protocol.Sleep | protocol.WakeUp, rank: int) -> protocol.SleepModeDone:
        """Run one command; the reply for the core (an error reply changed nothing)."""
        tags = command.tags or list(WAKE_TAGS)
        try:
            refuse_unbuilt(self.runner, command)
        except NotBuiltError as exc:
            return sleep_error_reply(command.call_id, exc, rank)
        if isinstance(command, protocol.Sleep):
            self.sleep(command.level, tags)
        else:
            self.wake_up(tags)
        return protocol.SleepModeDone(command.call_id, rank=rank)

    def sleep(self, level: int, tags: list[str]) -> None:
        runner = self.runner
        with _memory_report(runner.device, f"sleep(level={level})"):
            runner.cuda_graphs = None  # they replay over tensors that are about to move
            if getattr(runner, "mm_runner", None) is not None:
                runner.mm_runner.forget_encoder_outputs()  # their memory too; the requests are recomputed anyway
            if "weights" in tags:
                lora = getattr(runner, "lora_runner", None)
                if lora is not None:
                    lora.release_slots()  # before the move: emptied on the device (a second sleep finds them so)
                self._weights_asleep(level)
            if "kv_cache" in tags and not self.kv_asleep:
                self.num_blocks = int(runner.kv_caches[0].shape[1])
                runner.kv_caches = []
                if getattr(runner, "drafter", None) is not None:
                    runner.drafter.kv_caches = []  # its blocks share the target's ids (and its scratch blocks)
                self.kv_asleep = True

    def wake_up(self, tags: list[str]) -> None:
        runner = self.runner
        woke = False
        with _memory_report(runner.device, f"wake_up(tags={tags})"):
            if "weights" in tags and self.weights != "awake":
                self._weights_awake()
                if getattr(runner, "lora_runner", None) is not None:
                    runner.lora_runner.reallocate_slots()
                woke = True
            if "kv_cache" in tags and self.kv_asleep:
                runner.kv_caches = runner._allocate_kv_caches(self.num_blocks)  # new addresses, zeroed
                if getattr(runner, "drafter", None) is not None:
                    runner.drafter.allocate(self.num_blocks)
                self.kv_asleep = False
                woke = True
            if woke and self.weights == "awake" and not self.kv_asleep:
                # The graphs bake in the device addresses of the weights and the KV cache: both changed.
                runner.cuda_graphs = cuda_graphs.capture_decode_graphs(runner)

    def _weights_asleep(self, level: int) -> None:
        device = self.runner.device
        pin = device.type == "cuda"
        if self.draft is None:
            self.draft = Offloaded(self._draft_tensors(), pin)
        if level == 1 and self.weights == "awake":
            self.offloaded = Offloaded(held_tensors(self.runner.model, device), pin)
            self.weights = "offloaded"
        elif level == 2 and self.weights != "discarded":
            for name, param in self._parameters().items():
                self.discarded[name] = torch.empty_like(param.data, device="meta")
                param.data = torch.empty(0, dtype=param.dtype, device=device)  # the memory goes, the object stays
            if self.offloaded is not None:  # after a level 1: the parameters' CPU copies go too
                self.offloaded.held()
            self.weights = "discarded"

    def _weights_awake(self) -> None:
        device = self.runner.device
        if self.draft is not None:
            self.draft.restore(device)
            self.draft = None
        if self.weights == "discarded":  # uninitialised: no step runs until update_weights has loaded a checkpoint
            for name, param in self._parameters().items():
                param.data = torch.empty_like(self.discarded[name], device=device)
            self.discarded = {}
            weight_update.forget_weights(self.runner)  # partial update_weights_from_tensors calls count them down
        if self.offloaded is not None:  # level 1 (then level 2: its buffers and attributes, parameters emptied)
            self.offloaded.restore(device)
            self.offloaded = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies from pinned memory are done before a step reads them
        self.weights = "awake"

    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        """Each parameter once (a tied embedding and LM head are one Parameter)."""
        return dict(self.runner.model.named_parameters())

    def _draft_tensors(self) -> list[torch.Tensor]:
        """The draft's own device tensors (none on a storage of the served model's: an EAGLE head's LM head)."""
        drafter = getattr(self.runner, "drafter", None)
        if drafter is None:
            return []
        device = self.runner.device
        served = {storage_key(t) for t in held_tensors(self.runner.model, device)}
        return [t for t in held_tensors(drafter.model, device) if storage_key(t) not in served]


@contextmanager
def _memory_report(device: torch.device, what: str) -> Iterator[None]:
    """Log the GPU memory a call freed or took back (free memory before and after, as vLLM reports it)."""
    start = time.perf_counter()
    if device.type != "cuda":
        yield
        logger.info("%s in %.2f s (CPU device: tensors moved, no GPU memory involved)", what,
                    time.perf_counter() - start)
        return
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    yield
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the freed blocks go back to the driver: what the colocated trainer can take
    free_after, total = torch.cuda.mem_get_info(device)
    change = free_after - free_before
    logger.info("%s in %.2f s: %.2f GiB of GPU memory %s, %.2f GiB now in use", what, time.perf_counter() - start,
                abs(change) / 2**30, "freed" if change >= 0 else "taken back", (total - free_after) / 2**30)
