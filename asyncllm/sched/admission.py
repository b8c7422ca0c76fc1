"""What the scheduler checks before it queues a request.

Two kinds of refusal, both at once and before the request holds anything:

- `check_request`: the request could never run (empty, longer than
  max_model_len or than the whole KV cache, or longer than one step with
  chunked prefill off): `InvalidRequestError` naming the prompt.
- `check_queue_capacity`: admission control, `max_num_queued_requests` and
  `max_num_queued_tokens`: `EngineOverloadedError`. The core is authoritative;
  the host also checks an estimate before tokenizing
  (`asyncllm.engine.admission`), so most refusals cost no tokenization.
  Requests of one admission group (`AdmissionGroups`) that found the queue empty
  may pass the limits by the group's size.
"""

from __future__ import annotations

from asyncllm.config import EngineConfig
from asyncllm.errors import EngineOverloadedError, InvalidRequestError
from asyncllm.sched.queue import RequestQueue
from asyncllm.sched.request import Request

__all__ = [
    "AdmissionGroups", "check_request", "check_queue_capacity", "check_queue_limits", "group_size", "kv_size_fields",
]


def kv_size_fields(config: EngineConfig, kv_budget_field: str) -> str:
    """What makes the KV cache larger: num_gpu_blocks_override when it is set, else what sized it
    (`protocol.WorkerReady.kv_budget_field`; "": unknown, gpu_memory_utilization), with kv_cache_memory_bytes and
    num_gpu_blocks_override as the other ways."""
    if config.num_gpu_blocks_override is not None:
        return "num_gpu_blocks_override"
    field = kv_budget_field or "gpu_memory_utilization"
    return " / ".join(dict.fromkeys((field, "kv_cache_memory_bytes", "num_gpu_blocks_override")))


def check_request(
    request: Request, max_model_len: int, kv_capacity: int, splits_prompts: bool, max_num_batched_tokens: int,
    kv_size: str,
) -> None:
    """`InvalidRequestError` (field "prompt") if the request could never be scheduled; ``kv_size``: what makes the KV
    cache larger (`kv_size_fields`); ``splits_prompts``: a prompt may run in several steps
    (`ChunkPolicy.splits_prompts`).

    A generation keeps one position for its first generated token; a request that samples one token (pooling, its
    token dropped, or max_tokens 1: the OpenAI server's echo) may fill max_model_len and the whole KV cache: that
    token ends it, never stored."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise InvalidRequestError("prompt", "is empty: at least one token is needed")
    reserved = 0 if request.samples_once else 1
    if num_prompt > max_model_len - reserved:
        raise InvalidRequestError(
            "prompt",
            f"{num_prompt} tokens is too long: max_model_len={max_model_len} leaves room for "
            f"at most {max_model_len - reserved} prompt tokens" + (" and one generated token" if reserved else ""),
        )
    if num_prompt > kv_capacity - reserved:
        raise InvalidRequestError(
            "prompt",
            f"{num_prompt} tokens do not fit in the whole KV cache ({kv_capacity} tokens"
            + (", one of which the first generated token needs" if reserved else "") + f"): shorten the prompt, or "
            f"raise {kv_size} or tensor_parallel_size",
        )
    longest = max((item.bidirectional[1] - item.bidirectional[0] for item in request.mm_items if item.bidirectional),
                  default=0)
    if longest > max_num_batched_tokens:
        raise InvalidRequestError(
            "prompt",
            f"an image (or a prompt read both ways: PaliGemma's, SigLIP's text) of {longest} tokens that attend to "
            f"each other must be prefilled in one step, more than max_num_batched_tokens={max_num_batched_tokens}: "
            f"raise max_num_batched_tokens to at least {longest}",
        )
    if not splits_prompts and num_prompt > max_num_batched_tokens:
        raise InvalidRequestError(
            "prompt",
            f"{num_prompt} tokens exceed max_num_batched_tokens={max_num_batched_tokens} with "
            f"enable_chunked_prefill=False: enable chunked prefill, raise max_num_batched_tokens or set "
            f"long_prefill_token_threshold to at most max_num_batched_tokens",
        )


def check_queue_capacity(
    waiting: RequestQueue, request: Request, groups: AdmissionGroups, max_num_queued_requests: int | None,
    max_num_queued_tokens: int | None,
) -> None:
    """`EngineOverloadedError` if queueing `request` would pass a limit: the core's rule, which the host shares
    (`AdmissionGroups.check` on its estimates) but for the samples checked with another.

    An n > 1 request is checked once, on its sample 0, for its n samples
    (`Request.num_samples`; its other samples, 0, are queued with it unchecked, or refused with it:
    asyncllm/engine/sample_groups.py; the host checks a request's n at once, never 0).
    `max_num_queued_requests`: refused when the waiting requests plus these
    samples would pass it. `max_num_queued_tokens`: refused when the waiting
    requests' tokens plus these samples' prompts would pass it. An empty queue
    accepts any request, so a long prompt or a large n is delayed by load,
    never refused forever; and the rest of its admission group (`groups`), up to
    the group's size past the limits.
    """
    if request.num_samples:
        groups.check(request.admission_group, len(waiting), waiting.num_tokens, request.num_samples,
                     request.num_prompt_tokens, max_num_queued_requests, max_num_queued_tokens)


class AdmissionGroups:
    """Requests admitted as one (`asyncllm.engine.admission.admission_group`): an OpenAI server request's prompts,
    a beam-search step's beams, a `generate_many` batch, `score`'s documents. A group whose request found the queue
    empty is open: its later requests are checked against the limits raised by its size (`group_size`, known when it
    opened: its prompts × n, its beams, its batch's concurrency), so it may add at most its size beyond
    max_num_queued_requests (and as many times its request's prompt beyond max_num_queued_tokens), whatever other
    requests wait; an empty queue accepts a group as it accepts an n > 1 request's samples. Several groups may be
    open (the last `MAX_OPEN` to open). A group that found the queue busy is checked request by request, each counting
    those before it: its first requests may be admitted and a later one refused (the rest of the group then aborted
    by its caller). The core's rule (`check_queue_capacity`, group ids from `AddRequest.admission_group`) and the
    host's (`HostAdmission`)."""

    MAX_OPEN = 1024
    """Open groups remembered: the oldest is forgotten (its later requests checked as ever) past this."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        """The open groups' ids and sizes, oldest first."""

    def check(self, group: str, num_waiting: int, num_waiting_tokens: int, num_samples: int, num_prompt_tokens: int,
              max_num_queued_requests: int | None, max_num_queued_tokens: int | None, about: str = "") -> None:
        """`check_queue_limits` for a request of `group` ("": none), the limits raised by its size if it is open;
        opens it when the queue is empty. `num_samples` is at least 1 (`check_queue_capacity` skips a request's
        samples checked with its sample 0)."""
        name, size = group_size(group)
        extra = self.open.get(name, 0) if group else 0
        check_queue_limits(num_waiting, num_waiting_tokens, num_samples, num_prompt_tokens,
                           max_num_queued_requests, max_num_queued_tokens, about, extra)
        if group and num_waiting == 0:
            self.open.pop(name, None)
            self.open[name] = size
            if len(self.open) > self.MAX_OPEN:
                del self.open[next(iter(self.open))]


def group_size(group: str) -> tuple[str, int]:
    """An admission group id's name and size ("NAME/SIZE", `asyncllm.engine.admission.admission_group`; 1 without a
    size of at most 9 digits)."""
    name, _, size = group.rpartition("/")
    return (name, max(1, int(size))) if name and size.isascii() and size.isdigit() and len(size) <= 9 else (group, 1)


def check_queue_limits(
    num_waiting: int, num_waiting_tokens: int, num_samples: int, num_prompt_tokens: int,
    max_num_queued_requests: int | None, max_num_queued_tokens: int | None, about: str = "", extra: int = 0,
) -> None:
    """`EngineOverloadedError` if `num_samples` samples of a `num_prompt_tokens` prompt, queued behind `num_waiting`
    requests of `num_waiting_tokens` tokens, would pass a limit raised by `extra` requests (and `extra` such prompts:
    an open admission group's size, `AdmissionGroups`); nothing when the queue is empty. The core's rule
    (`check_queue_capacity`) and the host's estimate of it (`asyncllm.engine.admission`, `about` "about ": its
    counts are estimates)."""
    if num_waiting == 0:
        return
    group = f" (its admission group may pass it by {extra})" if extra else ""
    if max_num_queued_requests is not None and num_waiting + num_samples > max_num_queued_requests + extra:
        samples = "" if num_samples == 1 else f" and this request has n={num_samples} samples"
        raise EngineOverloadedError(
            f"max_num_queued_requests={max_num_queued_requests}{group}: {about}{num_waiting} requests are already "
            f"waiting{samples}; retry later, or raise max_num_queued_requests or the engine's capacity"
        )
    num_tokens = num_prompt_tokens * num_samples
    if (max_num_queued_tokens is not None
            and num_waiting_tokens + num_tokens > max_num_queued_tokens + extra * num_prompt_tokens):
        prompts = "this prompt has" if num_samples == 1 else f"this request's n={num_samples} samples have"
        group = f" (its admission group may pass it by {extra} such prompts)" if extra else ""
        raise EngineOverloadedError(
            f"max_num_queued_tokens={max_num_queued_tokens}{group}: {about}{num_waiting_tokens} tokens are already "
            f"waiting and {prompts} {about}{num_tokens}; retry later, or raise max_num_queued_tokens or the engine's "
            "capacity"
        )
