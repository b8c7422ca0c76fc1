"""`EngineControl`: the methods of `AsyncEngine` (asyncllm/engine/async_engine.py) that change what the running
engine holds rather than run a request, a mixin: LoRA adapters checked ahead, listed, pinned and forgotten
(`add_lora`, `list_loras`, `pin_lora`, `remove_lora`), the prefix cache forgotten, live weight updates
(docs/weight-updates.md) and sleep mode (docs/sleep-mode.md), on every replica."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import anyio
import msgspec

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.config_checks import is_int
from asyncllm.engine.engine_pins import EnginePins, check_not_removed, checked_everywhere
from asyncllm.engine.engine_weights import EngineWeights, every_replica
from asyncllm.engine.replica import Replica, ReplicaSet
from asyncllm.engine.sleep import check_level, check_tags
from asyncllm.engine.stream import RequestOptions
from asyncllm.engine.weight_update import new_checkpoint_config
from asyncllm.errors import InvalidRequestError
from asyncllm.lora import LoRARequest
from asyncllm.outputs import EngineStats

if TYPE_CHECKING:
    import torch

    from asyncllm.engine.processor import Processor

__all__ = ["EngineControl"]


class EngineControl:
    """Mixin of `AsyncEngine`: each method starts the engine if needed, then acts on every live replica."""

    config: EngineConfig
    _replicas: ReplicaSet
    _weights: EngineWeights
    _pins: EnginePins

    if TYPE_CHECKING:
        async def start(self) -> None: ...

        def stats(self) -> EngineStats: ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Check a LoRA adapter now (folder, config, every tensor's shape against the model) rather than at
        its first request; `InvalidRequestError` says what is wrong. The engine core checks it too (a shared
        core on another machine must read the folder at the same path) and binds this engine's `lora_int_id` to
        it. Its weights are read by the workers when a request first uses it (docs/lora.md)."""
        if lora_request is None:
            raise InvalidRequestError("lora_request", "must be an asyncllm.LoRARequest, got None")
        RequestOptions(lora_request=lora_request).validate()
        await self.start()
        processors = await self._replicas.serving_processors()
        checked = await checked_everywhere(processors, lora_request)  # shared with the requests waiting for the id
        check_not_removed(processors, lora_request.lora_int_id, "add_lora")  # (remove_lora meanwhile wins)
        await every_replica([processor.lora_call(protocol.AddLoRA("", lora))
                             for processor, lora in zip(processors, checked)])

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget the LoRA adapter id `lora_id` (vLLM's ``remove_lora``), here and in the engine core: the id used
        again is checked and bound afresh, so it may name another folder, whose weights the workers read anew.
        Requests already running with it finish with it; a pinned id is unpinned (`pin_lora`); a check of it in
        flight records nothing, what waits on it (parked requests, `add_lora`, `pin_lora`) fails saying the id was
        removed. Returns whether any replica knew the id or was checking it (False: an unknown one, as vLLM's)."""
        if not is_int(lora_id):
            raise InvalidRequestError("lora_id", f"an adapter's lora_int_id (int), got {lora_id!r}")
        await self.start()
        processors = await self._replicas.serving_processors()
        self._pins.forget(lora_id)
        forgot = [processor.forget_lora(lora_id) for processor in processors]
        # a replica restarting meanwhile (another serves): its new processor adopts the dead one's record of ids
        forgot += [replica.processor.forget_lora(lora_id) for replica in self._replicas.replicas
                   if replica.processor is not None and replica.processor not in processors]
        removed = await every_replica([processor.lora_call(protocol.RemoveLoRA("", lora_id))
                                       for processor in processors])
        return any(forgot) or any(removed)

    async def list_loras(self) -> set[int]:
        """The LoRA adapter ids this engine has checked and the core binds (vLLM's ``list_loras``): added with
        `add_lora` or used by a request, and not removed or forgotten as idle since (docs/lora.md)."""
        await self.start()
        processors = await self._replicas.serving_processors()
        return set().union(*(processor.lora_ids() for processor in processors))

    async def pin_lora(self, lora_id: int) -> bool:
        """Keep the LoRA adapter ``lora_id`` (added with `add_lora` or used by a request) from eviction (vLLM's
        ``pin_lora``): every worker reads it now if it has not, into its CPU cache and an adapter slot, and keeps it
        there until `remove_lora` of the id unpins it; on every replica (one that has not seen the id checks and
        binds it first). Returns True. `InvalidRequestError` naming ``lora_id``, the engine serving on: an id this
        engine does not know, more pinned adapters than ``max_loras`` slots, the last slot while requests with other
        adapters are in the engine, an adapter the workers cannot read (a folder the core cannot read);
        refused by any replica, it is pinned on none (docs/lora.md)."""
        if not is_int(lora_id):
            raise InvalidRequestError("lora_id", f"an adapter's lora_int_id (int), got {lora_id!r}")
        await self.start()
        await self._pins.pin(await self._replicas.serving_processors(), lora_id)
        return True

    async def _replay_on_restart(self, replica: Replica, owned: bool, dead: "Processor | None" = None) -> None:
        """A core the supervisor restarted: the LoRA adapters its host knew (the `dead` processor's record) added and
        the pinned ones pinned again, and (an `owned` core) the last weight update loaded again, all sent before any
        request can reach it, then their answers awaited."""
        assert replica.processor is not None
        pinning = self._pins.pin_again(replica.processor, dead if self.config.enable_lora else None)
        if owned:
            await self._weights.replay(replica)
        await self._pins.settle(pinning, self._replicas)

    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's ``reset_prefix_cache``) of every replica, e.g. after new weights or
        between benchmark runs: requests this engine submits afterwards hit nothing computed before; running
        requests keep their KV blocks. Returns True (it cannot fail while the engine lives; `EngineDeadError`
        otherwise)."""
        await self.start()
        for processor in await self._replicas.serving_processors():
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
        from asyncllm.engine.weight_tensors import pack_off_loop

        await self.start()
        await self._replicas.serving_processors()  # a dead engine refuses before anything is copied
        packed = await pack_off_loop(named_tensors)
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
        await self._replicas.wait_restart()  # a restarting core's stats say nothing yet
        return self.stats().is_sleeping

    async def _sleep_mode(self, message: protocol.Sleep | protocol.WakeUp) -> None:
        await self.start()
        await every_replica([processor.sleep_mode(msgspec.structs.replace(message))
                              for processor in await self._replicas.serving_processors()])
