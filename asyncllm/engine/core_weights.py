"""The engine core's half of live weight updates (docs/weight-updates.md).

The core handles an `UpdateWeights` between steps, in the order the host sent it: it collects the step in
flight (async_scheduling), has every worker rank check and copy the new weights (workers/weight_update.py),
and on success recomputes every running request from its prompt and the tokens it has so far and forgets the
prefix cache, so no KV computed with the old weights is used again. Restarted workers load the last weights
that loaded whole.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable

from asyncllm import errors, protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.weight_update import OTHER_RANK_REFUSED, weights_error_reply
from asyncllm.sched.recovery import recompute_with_new_weights

if TYPE_CHECKING:
    from asyncllm.engine.core import EngineCore

__all__ = ["WeightUpdater", "answer_between_steps", "config_with_pushed_weights", "config_with_weights"]

logger = logging.getLogger("asyncllm.engine.core")


def config_with_weights(config: EngineConfig, model_path: str, revision: str | None) -> EngineConfig:
    """`config` whose workers load ``model_path`` (what a worker restart builds after an update)."""
    model = config.model_config
    load_format = "auto" if model.load_format == "dummy" else model.load_format
    model = dataclasses.replace(model, model=model_path, revision=revision, load_format=load_format)
    return dataclasses.replace(config, model_config=model)


def config_with_pushed_weights(config: EngineConfig) -> EngineConfig:
    """`config` whose workers start with dummy weights: those written from the host's tensors
    (`update_weights_from_tensors`) exist nowhere else, so restarted workers wait for them again."""
    model = dataclasses.replace(config.model_config, load_format="dummy")
    return dataclasses.replace(config, model_config=model)


def answer_between_steps(core: "EngineCore", client_id: bytes, run: Callable[[], protocol.CoreMessage]) -> None:
    """Run a host's call on the workers between two steps, then answer it (weight updates, sleep mode). The step
    in flight is collected and delivered first: it was computed with the weights and memory the call changes.
    Every host gets the new stats before the caller gets the answer, so its `stats()` is fresh when it returns."""
    if core.overlap is not None and core.overlap.in_flight:
        core.overlap.drain([])
    reply = run()
    core.send_outputs([])
    core.io.send(client_id, reply)


class WeightUpdater:
    """Runs a host's `UpdateWeights` in the core and counts the successful ones (`weights_version`)."""

    def __init__(self, core: "EngineCore") -> None:
        self.core = core
        self.weights_version = 0
        self.pushed = False
        """Weights were written from a host's tensors since the last checkpoint: a worker restart loses them."""

    def update(self, client_id: bytes, message: protocol.UpdateWeights) -> None:
        """Run one update and answer the host that asked (after every host got the new stats)."""

        def run() -> protocol.WeightsUpdated:
            reply = self._run(message)
            reply.weights_version = self.weights_version
            return reply

        answer_between_steps(self.core, client_id, run)

    def _run(self, message: protocol.UpdateWeights) -> protocol.WeightsUpdated:
        core = self.core
        field = "named_tensors" if message.segment else "model_path"
        refusal = core.sleep.refuse_update(field)
        if refusal is not None:
            return weights_error_reply(message.update_id, refusal)
        try:
            replies = core.executor.update_weights(message)
        except (errors.EngineDeadError, errors.ConfigError) as exc:  # a rank failed while copying: restart them all
            core.recover_workers(exc if isinstance(exc, errors.EngineDeadError) else errors.EngineDeadError(str(exc)))
            return weights_error_reply(message.update_id, errors.InvalidRequestError(
                field, f"the workers failed while loading {message.source()} ({exc}); they were restarted with "
                       f"the weights of version {self.weights_version}"))
        refused = [reply for reply in replies if reply.error_type]
        if refused:
            logger.warning("weight update from %s refused: %s", message.source(), refused[0].error)
            return _most_telling(refused)
        self.weights_version = message.weights_version or self.weights_version + 1
        self._loaded(message, max(reply.weights_unwritten for reply in replies))
        num_running = recompute_with_new_weights(core.scheduler)
        logger.info("weights updated from %s (version %d); %d running requests will be recomputed",
                    message.source(), self.weights_version, num_running)
        return protocol.WeightsUpdated(message.update_id)

    def await_pushed(self, weights_version: int) -> None:
        """A restarted core whose host had pushed weights from memory (`protocol.AwaitWeights`; its workers started
        on dummy weights): no step runs until updates write every weight again."""
        core = self.core
        self.weights_version, self.pushed = weights_version, True
        core.restarter.config = config_with_pushed_weights(core.restarter.config)
        core.sleep.awaiting_weights = True
        core.send_outputs([])  # every host sees awaiting_weights at once
        logger.error("this core replaces one that died after weights were pushed from memory (version %d): no step "
                     "runs until updates write every weight again (stats().awaiting_weights)", weights_version)

    def _loaded(self, message: protocol.UpdateWeights, unwritten: int) -> None:
        """What restarted workers load from now on, and whether the weights are all real again."""
        core = self.core
        self.pushed = bool(message.segment)
        if self.pushed:
            core.restarter.config = config_with_pushed_weights(core.restarter.config)
        else:
            core.restarter.config = config_with_weights(core.restarter.config, message.model_path, message.revision)
        if unwritten == 0:
            core.sleep.weights_loaded()
        elif core.sleep.awaiting_weights:
            logger.info("%d weights of a rank are still to be written before steps run again", unwritten)


def _most_telling(refused: list[protocol.WeightsUpdated]) -> protocol.WeightsUpdated:
    """A rank's own reason first: the others only say that another rank refused."""
    from_the_source = [reply for reply in refused if reply.error != OTHER_RANK_REFUSED]
    return (from_the_source or refused)[0]
