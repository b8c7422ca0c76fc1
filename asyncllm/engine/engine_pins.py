"""`EnginePins`: the host's side of `AsyncEngine.pin_lora` across replicas (docs/lora.md), and the engine's pinned
adapters, which a core restarted by its supervisor pins again (its host's other adapter ids it adds again).

A pin is sent to every replica's core (asyncllm/engine/core_lora.py runs it on the workers); refused by any, or the
call cancelled, it is undone on every replica (a `PinLoRA` with ``unpin``) and the call returns only once each core
answered that, so no rank of any replica keeps it pinned behind the caller's back; a cancel is raised then, however
often it came. An id pinned before the call (pinning again changes nothing) is never undone so. `remove_lora` of the
id while its pin is sent (`forget`) leaves nothing recorded. The record (`pinned`: the adapter as given and as
checked) is what `pin_again` sends to a restarted core, before any request reaches it, with the pins in progress
(begun while that replica was down, so not sent to it: undone there too should their call be undone); a pin that
core refuses (the folder unreadable since) is undone on every replica and logged. Every refusal of a `pin_lora`
names ``lora_id``, its only argument (`pin_refusal`), the host's check's and the cores' alike.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

from asyncllm import protocol
from asyncllm.engine.engine_weights import every_replica
from asyncllm.engine.lora_ids import pin_refusal
from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.lora import LoRARequest

if TYPE_CHECKING:
    from asyncllm.engine.processor import Processor
    from asyncllm.engine.replica import ReplicaSet

__all__ = ["EnginePins", "checked_everywhere", "check_not_removed"]

logger = logging.getLogger("asyncllm.engine")


class Replay:
    """What `EnginePins.pin_again` sent a restarted core through its `processor`: the adapters added again (each as
    given, and the future of the core's answer) and the pins (each id, and its answer's future)."""

    __slots__ = ("processor", "adds", "pins")

    def __init__(self, processor: "Processor", adds: list[tuple[LoRARequest, concurrent.futures.Future[Any]]],
                 pins: list[tuple[int, concurrent.futures.Future[Any]]]) -> None:
        self.processor, self.adds, self.pins = processor, adds, pins


class _PinCall:
    """One `pin_lora` in progress: whether its id was pinned before it, and whether `remove_lora` removed it since."""

    __slots__ = ("pinned_before", "removed", "given", "checked", "late", "late_answers", "refused")

    def __init__(self, pinned_before: bool, given: LoRARequest, checked: LoRARequest) -> None:
        self.pinned_before, self.removed = pinned_before, False
        self.given, self.checked = given, checked  # (replica 0's): what a core restarted meanwhile pins
        self.late: list["Processor"] = []
        """The processors of cores restarted while it was in progress, pinned by `pin_again` (undone with it)."""
        self.late_answers: list[concurrent.futures.Future[Any]] = []
        """Those cores' answers, which the call awaits before it succeeds: a refusal fails it, undone everywhere."""
        self.refused: BaseException | None = None
        """A restarted core's refusal of the id while the call was in progress (`settle`): the call fails with it."""


class EnginePins:
    """The engine's pinned adapters and its `pin_lora` calls in progress (on the event loop)."""

    def __init__(self) -> None:
        self.pinned: dict[int, tuple[LoRARequest, LoRARequest]] = {}
        """Host id -> its adapter as given and as checked, pinned on every replica: a restarted core pins it again."""
        self._calls: dict[int, list[_PinCall]] = {}
        """Host id -> its `pin_lora` calls in progress."""

    async def pin(self, processors: list["Processor"], lora_id: int) -> None:
        """`AsyncEngine.pin_lora` on every replica; refused by any, or cancelled, pinned on none (unless pinned before
        the call), undone before the error or the cancel is raised."""
        given = next((lora for lora in (processor.lora_given(lora_id) for processor in processors) if lora), None)
        if given is None:
            raise InvalidRequestError("lora_id", f"no adapter has lora_int_id {lora_id} here: add_lora it (or use "
                                                 "it in a request) first")
        try:
            checked = await checked_everywhere(processors, given)
        except InvalidRequestError as exc:  # the check's (a bad folder, removed meanwhile): pin_lora's argument
            raise pin_refusal(exc, lora_id) from None
        check_not_removed(processors, lora_id, "pin_lora")
        call = _PinCall(lora_id in self.pinned, given, checked[0])
        self._calls.setdefault(lora_id, []).append(call)
        try:
            await self._pin_everywhere(processors, checked, call)
        except InvalidRequestError as exc:  # a core's (named so by any core of this version; a restarted one's)
            raise pin_refusal(exc, lora_id) from None
        finally:
            calls = self._calls[lora_id]
            calls.remove(call)
            if not calls:
                del self._calls[lora_id]
        if not call.removed:
            self.pinned[lora_id] = (given, checked[0])

    async def _pin_everywhere(self, processors: list["Processor"], checked: list[LoRARequest], call: _PinCall) -> None:
        lora_id = checked[0].lora_int_id
        for processor in processors:
            processor.pin_lora_id(lora_id)  # before the call: never forgotten as idle meanwhile
        try:
            await every_replica([processor.lora_call(protocol.PinLoRA("", lora))
                                 for processor, lora in zip(processors, checked)])
            await _late_answers(call)
        except BaseException as exc:  # refused by a replica, a core dead, or cancelled: undone everywhere first
            await self._undo(processors, checked, call, exc)

    async def _undo(self, processors: list["Processor"], checked: list[LoRARequest], call: _PinCall,
                    error: BaseException) -> None:
        """Raise `error`, the pin undone everywhere first (if `_undo_needed`; a cancel during the undo: raised)."""
        if self._undo_needed(checked[0].lora_int_id, call):
            late = call.late  # restarted meanwhile: `pin_again` pinned it there too
            if await _unpin([*processors, *late], [*checked, *[call.checked] * len(late)]):  # cancelled again
                raise asyncio.CancelledError from error
        raise error

    def _undo_needed(self, lora_id: int, call: _PinCall) -> bool:
        """Whether a failed or cancelled pin is to be undone: not if its id was pinned before it, or by another call
        since, or one is still in progress (its own outcome decides), or `remove_lora` unpinned it already."""
        return not (call.pinned_before or call.removed or lora_id in self.pinned or len(self._calls[lora_id]) > 1)

    def forget(self, lora_id: int) -> None:
        """`remove_lora`: the id is pinned no more (the cores unpin it), nor is a pin in progress recorded."""
        self.pinned.pop(lora_id, None)
        for call in self._calls.get(lora_id, ()):
            call.removed = True

    def pin_again(self, processor: "Processor", dead: "Processor | None" = None) -> Replay:
        """A restarted core's processor: with `dead`, the processor of the core that died (an engine serving LoRA),
        the host's record of adapters passes to it (`adopt_loras`: the host outlived its core) and every id not pinned
        is added again (`AddLoRA`); every pinned adapter is known to its host again (as checked: nothing read here)
        and pinned in the core; all sent now, before any request can reach it; `settle` awaits the answers. A
        `pin_lora` in progress (begun while this replica was down: not sent here) is pinned here too, and undone
        here should that call be undone."""
        pins = dict(self.pinned)
        late: dict[int, list[_PinCall]] = {}
        for lora_id, calls in self._calls.items():  # pins in progress, sent to the replicas live when they began
            live = [call for call in calls if not call.removed]
            if live and lora_id not in pins:
                pins[lora_id] = (live[-1].given, live[-1].checked)
                late[lora_id] = live
        if dead is not None:
            processor.adopt_loras(dead)
        sent = Replay(processor, [] if dead is None else processor.add_loras_again(pins.keys()), [])
        for lora_id, (given, checked) in pins.items():
            processor.remember_lora(given, checked)
            processor.pin_lora_id(lora_id)
            answer = processor.lora_call(protocol.PinLoRA("", checked))
            for call in late.get(lora_id, ()):
                call.late.append(processor)
                call.late_answers.append(answer)
            sent.pins.append((lora_id, answer))
        return sent

    async def settle(self, sent: Replay, replicas: "ReplicaSet") -> None:
        """The restarted core's answers to `pin_again`: an adapter it refused to add (its folder unreadable since) is
        forgotten by its host, a pin it refused undone on every replica and forgotten, logged; a core dead again gets
        them at its own restart."""
        for given, future in sent.adds:
            if (exc := await _refusal(future)) is not None:  # logged: the restart goes on without this adapter
                logger.error("the restarted engine core could not add LoRA adapter %r (id %d) again (%s): forgotten; "
                             "used again, it is checked afresh", given.lora_name, given.lora_int_id, exc)
                if sent.processor.lora_given(given.lora_int_id) == given:  # (not removed and added anew since)
                    sent.processor.forget_lora(given.lora_int_id)
        for lora_id, future in sent.pins:
            if (exc := await _refusal(future)) is not None:  # logged: the restart goes on without this pin
                for call in self._calls.get(lora_id, ()):  # calls in progress fail with it (never recorded)
                    call.refused = exc
                if lora_id not in self.pinned:  # only in progress: its calls undo it (`_late_answers`)
                    continue
                logger.error("the restarted engine core could not pin LoRA adapter id %d again (%s): it is unpinned "
                             "on every replica", lora_id, exc)
                await self._drop(lora_id, replicas)

    async def _drop(self, lora_id: int, replicas: "ReplicaSet") -> None:
        pinned = self.pinned.pop(lora_id, None)
        if pinned is not None and replicas.any_alive:
            live = replicas.live_processors()
            await _unpin(live, [pinned[1]] * len(live))


async def checked_everywhere(processors: list["Processor"], lora: LoRARequest) -> list[LoRARequest]:
    """`lora` as each replica's host checked it: each replica's `AdapterChecker` (its own record of ids) checks it
    off the loop, all at once (settled at once where the id is known)."""
    futures = [asyncio.wrap_future(processor.checking_lora(lora)) for processor in processors]
    return list(await asyncio.gather(*futures))


def check_not_removed(processors: list["Processor"], lora_id: int, call: str) -> None:
    """`InvalidRequestError` when `remove_lora` forgot the id on a replica after its check: the call would bind it
    in the core again behind the removal (remove wins). It names the call's own argument: `add_lora`'s
    ``lora_request``, `pin_lora`'s ``lora_id``."""
    if any(processor.lora_given(lora_id) is None for processor in processors):
        field = "lora_id" if call == "pin_lora" else "lora_request"
        raise InvalidRequestError(field, f"lora_int_id {lora_id} was removed (remove_lora) while {call} checked its "
                                         "adapter")


async def _refusal(future: concurrent.futures.Future[Any]) -> Exception | None:
    """A restarted core's answer: its refusal, or None when it agreed or died again (it is sent again at that core's
    own restart)."""
    try:
        await asyncio.wrap_future(future)
    except EngineDeadError:
        return None
    except Exception as exc:  # noqa: BLE001 - the caller logs it and goes on
        return exc
    return None


async def _late_answers(call: _PinCall) -> None:
    """Wait for the cores restarted while `call` was in progress (`pin_again` pinned it there too): the first
    refusal among their answers, or one `settle` saw for the id, is raised (a core dead again pins it at its own
    restart, from the record)."""
    while call.late_answers:  # (another may restart meanwhile)
        try:
            await asyncio.wrap_future(call.late_answers.pop(0))
        except EngineDeadError:
            continue
    if call.refused is not None:
        raise call.refused


async def _unpin(processors: list["Processor"], checked: list[LoRARequest]) -> bool:
    """Unpin the adapter on every replica (its id left bound there) and wait for every core's answer, however often
    cancelled meanwhile (an error, a dead core's, means nothing is pinned there); whether a cancel came."""
    for processor, lora in zip(processors, checked):
        processor.pin_lora_id(lora.lora_int_id, pinned=False)
    answers = asyncio.gather(*(asyncio.wrap_future(processor.lora_call(protocol.PinLoRA("", lora, unpin=True)))
                               for processor, lora in zip(processors, checked)), return_exceptions=True)
    cancelled = False
    while not answers.done():
        try:
            await asyncio.shield(answers)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled
