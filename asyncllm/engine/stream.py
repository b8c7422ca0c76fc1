"""`RequestStream`: the async iterator returned by `stream()` and `chat()`.

Leaving it in any way aborts the request in the core: the last delta,
``break`` (the object is dropped), ``aclose()``, ``async with`` exit, task
cancellation or a timeout around ``__anext__``, or garbage collection. A stream
left before its end ends as the engine's ``aclose()`` ends it: each unfinished
sample's last delta has finish_reason "abort" (what a task still reading it, or
a later ``__anext__``, gets), then it stops.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from asyncllm.engine.admission import current_admission_group
from asyncllm.engine.collector import RequestCollector
from asyncllm.errors import POOLING_OPERATIONS, EventLoopError, InvalidRequestError, running_asyncio_loop
from asyncllm.lora import LoRARequest
from asyncllm.metrics.tracing import capture_context
from asyncllm.pooling import PoolingParams
from asyncllm.outputs import StreamDelta
from asyncllm.sampling import SamplingParams
from asyncllm.engine.validation import check_priority, check_text, split_cache_salt
from asyncllm.chat_content import check_content_format
from asyncllm.tokenizer import check_chat_template, check_template_kwargs
from asyncllm.tool_calls import check_tools

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine


@dataclass(frozen=True)
class RequestOptions:
    """Per-request options of `stream`/`generate`/`chat` besides the sampling parameters."""

    priority: int = 0
    """Lower runs first under scheduling_policy="priority"; ties by arrival."""
    request_id: str | None = None
    """Caller-given id (unique among in-flight requests); by default the engine makes one."""
    timeout: float | None = None
    """Seconds after the engine core receives the request at which it ends with finish_reason "timeout"
    (wherever it is: queued, prefilling, decoding or swapped out; its blocks are freed)."""
    cache_salt: str | None = None
    """Requests with different salts never share prefix-cached KV blocks."""
    chat_template_kwargs: dict[str, Any] | None = None
    """`chat` only: variables for the chat template (``add_generation_prompt``, ``enable_thinking``, ...)."""
    tools: list[dict[str, Any]] | None = None
    """`chat` only: OpenAI function tools, rendered by the chat template (asyncllm/tool_calls.py)."""
    chat_template: str | None = None
    """`chat` only: a Jinja chat template used instead of the tokenizer's."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter to run the request with (enable_lora; docs/lora.md); None: the base model."""
    pooling: PoolingParams | None = None
    """`embed`, `classify` and `score` only: what the request returns (docs/embeddings.md, docs/pooling.md)."""
    text_pair: str | None = None
    """`score` on a cross-encoder only: the second text, tokenized with the prompt as one pair (docs/pooling.md)."""
    data_parallel_rank: int | None = None
    """data_parallel_size > 1: the replica that runs the request (vLLM's ``data_parallel_rank``); None: the least
    loaded (docs/parallelism.md)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """`chat` only: the image processor's settings for this request's images, over the engine's (a prompt dict
    carries its own)."""
    chat_template_content_format: str = "auto"
    """`chat` only: how message content reaches the template (vLLM's): "string" (text parts joined with "\\n"),
    "openai" (a list of parts) or "auto" (as the template reads it; asyncllm/chat_content.py)."""
    check_max_tokens: bool = False
    """The OpenAI server's (as vLLM's server): a prompt plus ``max_tokens`` over max_model_len is an
    `InvalidRequestError` (code ``context_length_exceeded``) instead of max_tokens cut to the room left."""
    fit_max_tokens: bool = False
    """The OpenAI server's, for a request that set no max_tokens (vLLM's ``get_max_tokens``): its ``max_tokens`` (the
    model's generation-config default, or none) is cut to the room the prompt leaves in max_model_len, and the cut
    value is the request's max_tokens in its metrics and span, as vLLM's server hands its engine the least of them."""
    echo_only: bool = False
    """The OpenAI server's echo with max_tokens 0 (params' max_tokens 1, the sampled token dropped): the prompt may
    fill max_model_len, as vLLM's server (`errors.check_context_length`); the request ends at its first token."""

    pooling_api: str | None = None
    """The pooling API that made the request when it is not `pooling`'s task (``"score"``; ``"rerank"``, the
    OpenAI server's): it names the operation in a context-length error (`errors.POOLING_OPERATIONS`)."""
    add_special_tokens: bool | None = None
    """vLLM's: whether tokenizing the prompt adds the tokenizer's special tokens (BOS, ...); None: its default,
    True for a text prompt, False for a chat (its template writes them). A prompt with media takes the default."""
    admission_group: str = ""
    """The requests it is admitted with (`asyncllm.engine.admission.admission_group`; "": none): the
    `admission_group` its stream was made in."""

    @property
    def pooling_operation(self) -> str | None:
        """A pooling request's operation in vLLM's context-length error (`errors.POOLING_OPERATIONS`' word for its
        API); None: the request generates (`errors.check_context_length`)."""
        if self.pooling is None:
            return None
        return POOLING_OPERATIONS[self.pooling_api or self.pooling.task]

    def salted(self, prompt: Any) -> tuple[Any, "RequestOptions"]:
        """`prompt` without a prompt dict's ``cache_salt``, and these options with that salt as the request's
        (`split_cache_salt`: vLLM's TextPrompt / TokensPrompt / EmbedsPrompt key)."""
        prompt, cache_salt = split_cache_salt(prompt, self.cache_salt)
        return prompt, self if cache_salt == self.cache_salt else replace(self, cache_salt=cache_salt)

    def validate(self) -> None:
        check_priority(self.priority)
        if self.request_id is not None and (not isinstance(self.request_id, str) or not self.request_id):
            raise InvalidRequestError("request_id", f"must be a non-empty str, got {self.request_id!r}")
        if self.timeout is not None:
            ok = isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool)
            if not ok or math.isnan(self.timeout) or self.timeout <= 0:
                raise InvalidRequestError("timeout", f"must be a positive number of seconds, got {self.timeout!r}")
        rank = self.data_parallel_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise InvalidRequestError("data_parallel_rank", f"must be a replica index (an int >= 0) or None, got {rank!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError("cache_salt", f"must be a str, got {self.cache_salt!r}")
        if self.add_special_tokens is not None and not isinstance(self.add_special_tokens, bool):
            raise InvalidRequestError("add_special_tokens", f"must be a bool or None, got {self.add_special_tokens!r}")
        if self.lora_request is not None:
            if not isinstance(self.lora_request, LoRARequest):
                raise InvalidRequestError("lora_request", f"must be an asyncllm.LoRARequest, got {self.lora_request!r}")
            self.lora_request.validate()
        if self.pooling is not None:
            if not isinstance(self.pooling, PoolingParams):
                raise InvalidRequestError("pooling_params", f"must be an asyncllm.PoolingParams, got {self.pooling!r}")
            self.pooling.validate()
        if self.text_pair is not None:
            if not isinstance(self.text_pair, str):
                raise InvalidRequestError("text_2", f"must be a str, got {type(self.text_pair).__name__}")
            check_text("text_2", self.text_pair)
        check_template_kwargs(self.chat_template_kwargs)
        check_tools(self.tools)
        check_chat_template(self.chat_template)
        check_content_format(self.chat_template_content_format)


class RequestStream:
    """Iterate with ``async for delta in stream``; deltas are `StreamDelta`s. Leaving it aborts the request:
    ``aclose()``, ``async with``, an error or cancellation in `__anext__`, or the object collected. A `break`
    alone tells an async iterator nothing: a stream held in a variable generates on until closed or collected."""

    def __init__(self, engine: "AsyncEngine", prompt: Any, params: SamplingParams | None, options: RequestOptions,
                 chat: bool) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        group = current_admission_group()  # where the stream is made, as its trace context
        self._options = replace(options, admission_group=group) if group else options
        self._chat = chat
        self._trace_context = capture_context()
        """The OpenTelemetry context where the stream was made: its request span's parent, however late and on
        whichever task the stream is first iterated (a StreamingResponse iterates it after the handler returned)."""
        self.collector: RequestCollector | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The event loop the request was submitted from: its deliveries go there (`_check_loop`)."""
        self._done = False
        """Left, or every delta handed out: nothing more is aborted, what the collector holds is still handed out."""
        self._reading = False
        """A task is inside `__anext__` (another one is refused)."""
        self._accepted: asyncio.Event | None = None
        """`acceptance`'s event, if it was asked for."""

    @property
    def request_id(self) -> str | None:
        return None if self.collector is None else self.collector.request_id

    @property
    def num_samples(self) -> int:
        """How many samples its deltas carry (``params.n``; 1 without params)."""
        return 1 if self._params is None else self._params.n

    def __aiter__(self) -> "RequestStream":
        return self

    @property
    def exhausted(self) -> bool:
        """Left (closed, or ended) with every delta handed out: `__anext__` only raises StopAsyncIteration."""
        return self._done and (self.collector is None or not self.collector.pending)

    async def __anext__(self) -> StreamDelta:
        if self.exhausted:
            raise StopAsyncIteration
        if self._reading:  # one reader at a time: a second would submit the request again, or find none to wait on
            raise RuntimeError("anext(): this stream is already being read by another task (read it from one "
                               "task at a time, as an async generator)")
        if self.collector is not None:
            self._check_loop()
        self._reading = True
        try:
            if self.collector is None:
                collector = await self._engine._submit(self._prompt, self._params, self._options, self._chat,
                                                       self._trace_context, self._accepted)
                self.collector, self._loop = collector, asyncio.get_running_loop()
                if self._done:  # left (``aclose()`` from another task) while this was submitting it
                    self._abort()
            delta = await self.collector.get()
        except BaseException:
            self._leave()
            raise
        finally:
            self._reading = False
        if self.collector.done:  # every sample finished and was handed out
            self._done = True
        return delta

    def acceptance(self) -> asyncio.Event:
        """An event set once the engine accepted the request (tokenized and checked on the host, sent to the core:
        what a request can be refused for before it runs has been said), or it has a delta or its error. Ask before
        the first `__anext__` (which submits it); a server waits for it for each prompt of a list before it sends
        its status line (asyncllm/integrations/streams.py `accepted_streams`)."""
        if self._accepted is None:
            if self.collector is not None:
                raise RuntimeError("acceptance(): ask before the stream's first __anext__ (it submits the request)")
            self._accepted = asyncio.Event()
        return self._accepted

    async def aclose(self) -> None:
        self._leave()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if not self._done:
            self._done = True
            self._abort()

    def _abort(self) -> None:
        """Abort the request in the core, and end its collector's samples now (a reader in another task wakes)."""
        if self._abort_in_core():
            assert self.collector is not None
            self.collector.abort()

    def _abort_in_core(self) -> bool:
        """Post the core's abort of an unfinished request (thread-safe); whether there was one."""
        if self.collector is None or self.collector.finished:
            return False
        self._engine._abort(self.collector.request_id, self.collector)
        return True

    def _check_loop(self) -> None:
        """A stream's deltas reach the loop it was submitted from; a takeover of the engine by a new loop
        (`AsyncEngine._check_loop`) aborted the requests of the closed one."""
        loop = self._loop
        if loop is running_asyncio_loop():  # under trio: EventLoopError, asyncllm runs on asyncio
            return
        self._engine._check_loop()  # the engine's open loop refuses this one; a closed one's is taken over
        if loop is not None and loop.is_closed():
            raise EventLoopError(
                "this stream's request was made in an event loop that has closed; the engine moved to this loop, "
                "which aborted that loop's requests: make a new request here")
        raise EventLoopError("this stream's request was made in another event loop, which is still open and "
                             "receives its deltas: iterate it there")

    def __del__(self) -> None:
        """Garbage collected (no reader holds it): only the core's abort, posted, as any thread may run this; the
        collector, the loop's, is left alone (an asyncio.Event set off its loop's thread races it)."""
        try:
            if not self._done:
                self._done = True
                self._abort_in_core()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
            pass


def check_prompt(prompt: Any, chat: bool, pooling_task: str | None = None) -> None:
    """Cheap type checks on the loop; tokenization happens on the processor thread. A text prompt may be empty (""):
    with the tokenizer's special tokens its ids are [BOS], which generate as vLLM's do; empty ids are refused there.
    `pooling_task` ("embed", "classify"; None: a generation) names the call in the error for a list of prompts."""
    if chat:
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("messages", "must be a non-empty list of {'role': ..., 'content': ...} dicts")
        return
    if isinstance(prompt, str):
        return
    if isinstance(prompt, dict):
        return  # {"prompt": str, "images": [...]}, vLLM's prompt dicts: checked on the processor thread (asyncllm/mm/)
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if isinstance(prompt[0], (str, dict, list, tuple)):
            raise InvalidRequestError("prompt", _one_prompt_only(len(prompt), pooling_task))
        return
    raise InvalidRequestError("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")


def _one_prompt_only(count: int, pooling_task: str | None) -> str:
    """The error for a list of prompts given where one is taken (vLLM's ``LLM.generate`` / ``LLM.embed`` take a
    list): the batch call to use instead."""
    if pooling_task is None:
        return (f"takes one prompt (a str, a prompt dict or a list of token ids), got a list of {count} prompts: "
                f"`await engine.generate_many(prompts, params)` runs a batch (vLLM's LLM.generate takes a list)")
    return (f"{pooling_task} takes one prompt (a str or a list of token ids), got a list of {count} prompts: there "
            f"is no batch {pooling_task} call; `asyncio.gather(*(engine.{pooling_task}(p) for p in prompts))` runs "
            f"them together (vLLM's LLM.{pooling_task} takes a list)")
