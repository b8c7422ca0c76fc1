"""The engine core's half of sleep mode (docs/sleep-mode.md).

The core handles a `Sleep` or `WakeUp` between steps, in the order the host sent it: it collects the step in
flight (async_scheduling), has every worker rank free or take back its memory (workers/sleep.py), and answers.
After a sleep every running request goes back to the queue to be recomputed (its KV is gone) and the prefix
cache is forgotten. While any part sleeps no step runs: new requests queue, their timeouts count. After a
level-2 sleep the weights come back uninitialised, so no step runs either until `UpdateWeights` succeeds
(``awaiting_weights``): garbage weights never generate. Restarted workers come back awake with the last
weights that loaded whole and are put back to sleep as the core's state says (`after_restart`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from asyncllm import errors, protocol
from asyncllm.engine.core_weights import answer_between_steps
from asyncllm.engine.sleep import WAKE_TAGS, check_level, check_tags, sleep_error_reply
from asyncllm.sched.recovery import recompute_with_new_weights

if TYPE_CHECKING:
    from asyncllm.engine.core import EngineCore

__all__ = ["SleepController"]

logger = logging.getLogger("asyncllm.engine.core")

_NOT_ENABLED = ("sleep() and wake_up() need True: start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode), as vLLM requires")


class SleepController:
    """What of the workers' memory sleeps, as the core knows it, and the `Sleep` / `WakeUp` calls of the hosts."""

    def __init__(self, core: "EngineCore") -> None:
        self.core = core
        self.weights = "awake"
        """awake, offloaded (level 1: in CPU memory) or discarded (level 2)."""
        self.kv_asleep = False
        self.level = 0
        """The level of the last sleep."""
        self.awaiting_weights = False
        """Discarded by a level-2 sleep and not loaded since (`UpdateWeights`): no step may run."""

    @property
    def is_sleeping(self) -> bool:
        return self.weights != "awake" or self.kv_asleep

    @property
    def sleep_level(self) -> int:
        """For the stats: the last sleep's level while any part sleeps, else 0."""
        return self.level if self.is_sleeping else 0

    @property
    def holds_steps(self) -> bool:
        """No step may run: memory is asleep, or the weights are uninitialised."""
        return self.is_sleeping or self.awaiting_weights

    def handle(self, client_id: bytes, message: protocol.Sleep | protocol.WakeUp) -> None:
        """Run one call and answer the host that asked (after every host got the new stats)."""

        def run() -> protocol.SleepModeDone:
            reply = self._run(message)
            reply.sleep_level = self.sleep_level
            return reply

        answer_between_steps(self.core, client_id, run)

    def refuse_update(self, field: str) -> errors.InvalidRequestError | None:
        """`UpdateWeights` has nothing to copy into while the weights are discarded: refused naming ``field`` (the
        update's source: ``model_path`` or ``named_tensors``)."""
        if self.weights != "discarded":
            return None
        return errors.InvalidRequestError(field, "the weights were discarded by sleep(level=2): call "
                                                 "wake_up(tags=['weights']) first (docs/sleep-mode.md)")

    def weights_loaded(self) -> None:
        """An `UpdateWeights` succeeded: the weights are real again."""
        self.awaiting_weights = False

    def after_restart(self) -> None:
        """Fresh workers loaded the last weights and allocated the KV cache: put asleep what sleeps."""
        if self.core.weights.pushed:  # they started from dummy weights: the host's tensors are not on any disk
            self.awaiting_weights = True
            logger.error("restarted workers lost the weights written by update_weights_from_tensors: no step runs "
                         "until updates write every weight again (stats().awaiting_weights)")
        elif self.weights != "discarded":
            self.awaiting_weights = False  # real weights now, even if none had been loaded since a level-2 sleep
        tags = (["weights"] if self.weights != "awake" else []) + (["kv_cache"] if self.kv_asleep else [])
        if not tags:
            return
        level = 2 if self.weights == "discarded" else 1
        try:
            replies = self.core.executor.sleep_mode(protocol.Sleep("restart", level, tags))
        except errors.EngineDeadError as exc:
            self.core.recover_workers(exc)  # bounded by max_worker_restarts
            return
        assert not any(reply.error_type for reply in replies), replies  # they slept this way before
        logger.info("restarted workers put back to sleep (%s, level %d)", " and ".join(tags), level)

    def _run(self, message: protocol.Sleep | protocol.WakeUp) -> protocol.SleepModeDone:
        if not self.core.config.enable_sleep_mode:
            return sleep_error_reply(message.call_id, errors.ConfigError("enable_sleep_mode", False, _NOT_ENABLED))
        try:  # checked again: a peer speaking the protocol need not be an AsyncEngine
            if isinstance(message, protocol.Sleep):
                message = protocol.Sleep(message.call_id, check_level(message.level))  # a host sleeps every part
            else:
                message = protocol.WakeUp(message.call_id, check_tags(message.tags or None))
        except errors.InvalidRequestError as exc:
            return sleep_error_reply(message.call_id, exc)
        try:
            replies = self.core.executor.sleep_mode(message)
        except errors.EngineDeadError as exc:  # a rank failed (e.g. out of memory at wake-up): restart them all
            self.core.recover_workers(exc)
            return sleep_error_reply(message.call_id, errors.EngineDeadError(
                f"the workers failed ({exc}); they were restarted and put back in the state before this call"))
        refused = [reply for reply in replies if reply.error_type]
        if refused:
            return refused[0]
        if isinstance(message, protocol.Sleep):
            self._slept(message.level)
        else:
            self._woke(message.tags or list(WAKE_TAGS))
        return protocol.SleepModeDone(message.call_id)

    def _slept(self, level: int) -> None:
        num_running = recompute_with_new_weights(self.core.scheduler)  # their KV is gone; so is the prefix cache
        if level == 2:
            self.weights, self.awaiting_weights = "discarded", True
        elif self.weights == "awake":
            self.weights = "offloaded"
        self.kv_asleep = True
        self.level = 2 if self.weights == "discarded" else 1
        logger.info("asleep at level %d; %d running requests will be recomputed after wake_up", level, num_running)

    def _woke(self, tags: list[str]) -> None:
        if "weights" in tags:
            self.weights = "awake"
        if "kv_cache" in tags:
            self.kv_asleep = False
        logger.info("woke up: %s%s", " and ".join(tags), "; still asleep: " + self._asleep() if self.is_sleeping else "")
        if self.awaiting_weights and not self.is_sleeping:  # all awake, yet nothing can run: say why
            logger.warning("the weights are uninitialised after sleep(level=2): no step runs until "
                           "update_weights(...) loads a checkpoint")

    def _asleep(self) -> str:
        return " and ".join(part for part, asleep in (("weights", self.weights != "awake"),
                                                       ("kv_cache", self.kv_asleep)) if asleep)
