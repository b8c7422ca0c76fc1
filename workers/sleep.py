"""Sleep mode on one worker rank (docs/sleep-mode.md): give the GPU memory back, take it again.

Level 1 moves every parameter's data to CPU memory (pinned on CUDA, for fast copies back); level 2 replaces it
by an empty tensor (the Parameter objects stay, with their loader attributes, so `update_weights` can copy into
them after the wake-up). Both free the KV cache tensors and the CUDA graphs, then return the cached blocks to
the driver (`torch.cuda.empty_cache`). Buffers (rotary tables) stay: small, and derived from the config.

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

__all__ = ["RunnerSleep", "refuse_unbuilt"]

logger = logging.getLogger(__name__)


def refuse_unbuilt(runner: Any) -> None:
    """What moving the parameters does not cover: tensors built from the weights outside them (quantized
    kernels' layouts)."""
    weight_update.refuse_unbuilt(runner, "sleep mode")


class RunnerSleep:
    """What of one runner's memory sleeps, and the moves between the states."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.weights = "awake"
        """awake, offloaded (level 1) or discarded (level 2)."""
        self.kv_asleep = False
        self.num_blocks = 0
        """The KV cache's blocks when it was freed (a wake-up allocates as many)."""
        self.discarded: dict[str, torch.Tensor] = {}
        """Level 2: name -> a meta tensor of the parameter's shape, dtype and strides."""
        self.draft_offloaded = False
        """Whether the draft's own parameters (a draft model, an EAGLE head, an MTP layer) are in CPU memory: at
        either level (update_weights loads the served model's weights only, so the draft's are kept)."""

    def handle(self, command: protocol.Sleep | protocol.WakeUp, rank: int) -> protocol.SleepModeDone:
        """Run one command; the reply for the core (an error reply changed nothing)."""
        tags = command.tags or list(WAKE_TAGS)
        try:
            refuse_unbuilt(self.runner)
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
                self._weights_asleep(level)
                lora = getattr(runner, "lora_runner", None)
                if lora is not None and self.weights != "awake":
                    lora.release_slots()  # a second sleep finds them released
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
        if not self.draft_offloaded:
            _move(self._draft_parameters().values(), torch.device("cpu"), pin=device.type == "cuda")
            self.draft_offloaded = True
        if level == 1 and self.weights == "awake":
            _move(self._parameters().values(), torch.device("cpu"), pin=device.type == "cuda")
            self.weights = "offloaded"
        elif level == 2 and self.weights != "discarded":
            for name, param in self._parameters().items():
                self.discarded[name] = torch.empty_like(param.data, device="meta")
                param.data = torch.empty(0, dtype=param.dtype, device=device)  # the memory goes, the object stays
            self.weights = "discarded"

    def _weights_awake(self) -> None:
        device = self.runner.device
        if self.draft_offloaded:
            _move(self._draft_parameters().values(), device)
            self.draft_offloaded = False
        params = self._parameters()
        if self.weights == "offloaded":
            _move(params.values(), device)
        else:  # uninitialised: the core runs no step until update_weights has loaded a checkpoint into them
            for name, param in params.items():
                param.data = torch.empty_like(self.discarded[name], device=device)
            self.discarded = {}
            weight_update.forget_weights(self.runner)  # partial update_weights_from_tensors calls count them down
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies from pinned memory are done before a step reads them
        self.weights = "awake"

    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        """Each parameter once (a tied embedding and LM head are one Parameter)."""
        return dict(self.runner.model.named_parameters())

    def _draft_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The draft's own parameters (none it borrows from the served model: an EAGLE head's LM head)."""
        drafter = getattr(self.runner, "drafter", None)
        if drafter is None:
            return {}
        served = {id(p) for p in self.runner.model.parameters()}
        return {name: p for name, p in drafter.model.named_parameters() if id(p) not in served}


def _move(params: Any, device: torch.device, pin: bool = False) -> None:
    """Each parameter's data copied to ``device`` (pinned CPU memory with ``pin``; from the GPU the copy waits, to
    it the caller synchronizes before a step reads it)."""
    for param in params:
        moved = torch.empty_like(param.data, device=device, pin_memory=pin)
        moved.copy_(param.data, non_blocking=device.type == "cuda")
        param.data = moved


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
