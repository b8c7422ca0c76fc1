"""`EngineRequests`: the request methods of `AsyncEngine` (asyncllm/engine/async_engine.py), a mixin, with the
defaults of a request given no `SamplingParams` (`default_sampling_params`): `stream`,
`chat`, `generate`, and the pooling (`embed`, `encode`, `classify`, `score`), speech (`transcribe`), batch
(`generate_many`)
and beam-search forms built on them, and vLLM's `abort` (by request id) and `get_tokenizer`. Each request goes through
the engine's `_submit` (by `RequestStream`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec

from asyncllm.beam_search import BeamSearchOutput, BeamSearchParams
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.drain import EngineDrain
from asyncllm.engine.stream import RequestOptions, RequestStream
from asyncllm.errors import AsyncLLMError, ConfigError, InvalidRequestError, RequestAbortedError, RequestTimeoutError
from asyncllm.lora import LoRARequest
from asyncllm.outputs import CompletionOutput, RequestOutput
from asyncllm.pooling import (PER_TOKEN_TASKS, ClassificationOutput, EmbeddingOutput, PoolingOutput, PoolingParams,
                              ScoringOutput, encode_params, token_rows)
from asyncllm.sampling import RequestOutputKind, SamplingParams
from asyncllm.speech import transcribe, transcribe_segments
from asyncllm.speech_segments import Segment

__all__ = ["EngineRequests"]


class EngineRequests:
    """Mixin of `AsyncEngine`: what a request looks like to the caller; the engine starts, submits and delivers."""

    if TYPE_CHECKING:
        _default_sampling: dict[str, Any] | None
        _drain: EngineDrain
        _in_flight: weakref.WeakSet[RequestCollector]
        tokenizer: Any
        pooling_model: Any

        async def start(self) -> None: ...

        def _check_loop(self) -> None: ...

        def _abort(self, request_id: str, collector: RequestCollector | None = None) -> None: ...

    def default_sampling_params(self) -> SamplingParams:
        """What a request without `SamplingParams` runs with (vLLM's ``get_default_sampling_params``): the model's
        generation_config.json sampling fields and ``override_generation_config`` over SamplingParams' defaults
        (``generation_config="vllm"``: those alone). Known once the engine started (it reads the file then)."""
        return SamplingParams(**self.default_sampling_fields())

    def default_sampling_fields(self) -> dict[str, Any]:
        """The `SamplingParams` fields that generation_config and override_generation_config set (a copy; the
        OpenAI server uses them for fields a request leaves unset). Known once the engine started."""
        if self._default_sampling is None:
            raise AsyncLLMError("the default sampling parameters are read when the engine starts: await start() first")
        return dict(self._default_sampling)

    def stream(self, prompt: Any, params: SamplingParams | None = None, *, priority: int = 0,
               request_id: str | None = None, timeout: float | None = None,
               cache_salt: str | None = None, lora_request: LoRARequest | None = None,
               data_parallel_rank: int | None = None, check_max_tokens: bool = False,
               echo_only: bool = False, add_special_tokens: bool | None = None,
               sampling_params: SamplingParams | None = None, fit_max_tokens: bool = False) -> RequestStream:
        """Stream `StreamDelta`s of one completion; leaving the loop aborts it.

        `lora_request` runs it with a LoRA adapter (enable_lora; docs/lora.md); `data_parallel_rank` on that
        replica (data_parallel_size > 1; default: the least loaded). `check_max_tokens` (the OpenAI server's):
        a prompt plus max_tokens over max_model_len is an `InvalidRequestError`, not max_tokens cut to fit;
        `echo_only` (its echo with max_tokens 0, max_tokens 1 here): the prompt may fill max_model_len.
        `add_special_tokens` (vLLM's; None: True) whether a text prompt's tokens start with BOS and the like.
        `sampling_params` is vLLM's name for `params` (give one of them). `fit_max_tokens` (the OpenAI server's, for
        a request that set no max_tokens): max_tokens cut to the room the prompt leaves, and recorded cut
        (`RequestOptions.fit_max_tokens`)."""
        options = RequestOptions(priority, request_id, timeout, cache_salt, lora_request=lora_request,
                                 data_parallel_rank=data_parallel_rank, check_max_tokens=check_max_tokens,
                                 echo_only=echo_only, add_special_tokens=add_special_tokens,
                                 fit_max_tokens=fit_max_tokens)
        params = _checked_params(_one_params(params, sampling_params))
        if echo_only and (params is None or params.max_tokens != 1):
            raise InvalidRequestError("echo_only", "needs params with max_tokens=1 (the token sampled for it is "
                                                   "dropped)")
        return RequestStream(self, prompt, params, options, chat=False)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, priority: int = 0,
             request_id: str | None = None, timeout: float | None = None,
             cache_salt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
             lora_request: LoRARequest | None = None, data_parallel_rank: int | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None, check_max_tokens: bool = False,
             chat_template_content_format: str = "auto", add_special_tokens: bool | None = None,
             sampling_params: SamplingParams | None = None, fit_max_tokens: bool = False) -> RequestStream:
        """Stream a reply to chat `messages`, formatted by the tokenizer's chat template.

        `chat_template_kwargs` are variables for the template, as in
        transformers' ``apply_chat_template`` (``{"enable_thinking": False}``
        for Qwen3; ``{"add_generation_prompt": False}`` to continue the last message).
        `tools` are OpenAI function tools for the template; the reply's text
        holds the calls in the model's format (`asyncllm.tool_calls` parses them).
        `chat_template` (Jinja) replaces the tokenizer's template for this request; `mm_processor_kwargs` (vLLM's)
        the image processor's settings for its images (over the engine's; docs/multimodal.md); `check_max_tokens`
        and `fit_max_tokens` as for `stream`. `chat_template_content_format` (vLLM's ``LLM.chat`` argument) is how
        a message's content reaches the template: "string" (text parts joined with "\\n"), "openai" (a list of
        ``{"type": "text", "text": ...}`` and media parts) or "auto" (the default: "openai" when the template loops
        over a message's content; asyncllm/chat_content.py). `add_special_tokens` (vLLM's; None: False, the
        template writes them) True adds the tokenizer's special tokens to the rendered text's as well.
        `sampling_params` is vLLM's name for `params` (give one of them).
        """
        options = RequestOptions(priority, request_id, timeout, cache_salt, chat_template_kwargs, tools, chat_template,
                                 lora_request, data_parallel_rank=data_parallel_rank,
                                 mm_processor_kwargs=mm_processor_kwargs, check_max_tokens=check_max_tokens,
                                 chat_template_content_format=chat_template_content_format,
                                 add_special_tokens=add_special_tokens, fit_max_tokens=fit_max_tokens)
        return RequestStream(self, messages, _checked_params(_one_params(params, sampling_params)), options, chat=True)

    async def generate(self, prompt: Any, params: SamplingParams | None = None, *,
                       sampling_params: SamplingParams | None = None, **options: Any) -> RequestOutput:
        """Run one request to the end and return it whole, every sample in `.outputs` (options as for `stream`;
        `sampling_params` is vLLM's name for `params`).

        `params.output_kind` does not apply: samples are collected whole on the
        host (FINAL_ONLY), so the caller's task wakes once per sample.
        """
        params = _one_params(params, sampling_params)
        if _checked_params(params) is None:
            await self.start()
            params = self.default_sampling_params()
        if params.output_kind != RequestOutputKind.FINAL_ONLY:
            params.validate()  # a bad output_kind (a typo) is refused even here, where none applies
            params = msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        stream = self.stream(prompt, params, **options)
        outputs: dict[int, CompletionOutput] = {}
        async with stream:
            async for delta in stream:
                outputs[delta.index] = CompletionOutput(delta.index, delta.text, delta.token_ids, delta.finish_reason,
                                                        delta.stop_reason, delta.logprobs, delta.cumulative_logprob)
        collector = stream.collector
        assert collector is not None and len(outputs) == collector.num_samples, (len(outputs), collector)
        return RequestOutput(collector.request_id, _prompt_text(prompt), collector.prompt_token_ids,
                             [outputs[i] for i in sorted(outputs)], collector.metrics, collector.num_cached_tokens,
                             prompt_logprobs=collector.prompt_logprobs)

    async def embed(self, prompt: Any, pooling_params: PoolingParams | None = None, *, priority: int = 0,
                    request_id: str | None = None, timeout: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None,
                    truncate_prompt_tokens: int | None = None, data_parallel_rank: int | None = None,
                    add_special_tokens: bool | None = None) -> EmbeddingOutput:
        """The embedding of a prompt (text or token ids): its last token's final hidden state (or the model's
        MEAN / CLS pooling, ``pooler_config``), normalized unless `pooling_params` says otherwise
        (docs/embeddings.md). It is scheduled like any request (one prefill and one dropped token), so
        embeddings and generations share batches. `add_special_tokens` (vLLM's; None: True) as for `stream`."""
        pooling = PoolingParams() if pooling_params is None else pooling_params
        if getattr(pooling, "task", None) == "token_embed":
            raise InvalidRequestError("pooling_params", "task 'token_embed' returns one embedding per prompt token: "
                                                        "use encode(prompt, pooling_task='token_embed')")
        options = RequestOptions(priority, request_id, timeout, cache_salt, lora_request=lora_request, pooling=pooling,
                                 data_parallel_rank=data_parallel_rank, add_special_tokens=add_special_tokens)
        collector = await self._pool(prompt, options, truncate_prompt_tokens)
        return EmbeddingOutput(collector.request_id, collector.prompt_token_ids, collector.embedding,
                               collector.metrics, collector.num_cached_tokens)

    async def encode(self, prompt: Any, pooling_params: PoolingParams | None = None, *,
                     pooling_task: str | None = None, priority: int = 0, request_id: str | None = None,
                     timeout: float | None = None, cache_salt: str | None = None,
                     lora_request: LoRARequest | None = None, truncate_prompt_tokens: int | None = None,
                     data_parallel_rank: int | None = None, add_special_tokens: bool | None = None) -> PoolingOutput:
        """vLLM's ``LLM.encode``: the pooler's output for `pooling_task` (required): ``"token_embed"`` one embedding
        per prompt token (every token's final hidden state, normalized and cut to ``dimensions`` as `embed`'s;
        vLLM's ALL pooling), ``"token_classify"`` a classification model's probabilities per prompt token (its score
        head on every row, through `classify`'s activation unless ``use_activation=False``; a reward model's rows,
        docs/pooling.md#reward-models), ``"embed"`` `embed`'s
        vector (docs/pooling.md#per-token-pooling-token_embed-token_classify).
        Scheduled as `embed` is, without prefix-cache hits for the per-token tasks; other options as for `embed`."""
        pooling = encode_params(pooling_task, pooling_params)
        options = RequestOptions(priority, request_id, timeout, cache_salt, lora_request=lora_request, pooling=pooling,
                                 data_parallel_rank=data_parallel_rank, add_special_tokens=add_special_tokens)
        collector = await self._pool(prompt, options, truncate_prompt_tokens)
        assert collector.embedding is not None, collector
        data = collector.embedding
        if pooling.task in PER_TOKEN_TASKS:  # rows, activated (token_classify): `PoolingModel.token_rows`
            data = token_rows(data, len(collector.prompt_token_ids)) if self.pooling_model is None else \
                self.pooling_model.token_rows(pooling, data, collector.prompt_token_ids)
        return PoolingOutput(collector.request_id, collector.prompt_token_ids, data, collector.metrics,
                             collector.num_cached_tokens)

    async def reward(self, prompt: Any, pooling_params: PoolingParams | None = None, **options: Any) -> PoolingOutput:
        """vLLM's ``LLM.reward``: a reward model's rows per prompt token (every token, or STEP's step tags), that is
        `encode` with ``pooling_task="token_classify"``; `options` as `encode`'s (docs/pooling.md#reward-models)."""
        return await self.encode(prompt, pooling_params, pooling_task="token_classify", **options)

    async def classify(self, prompt: Any, *, priority: int = 0, request_id: str | None = None,
                       timeout: float | None = None, cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None,
                       truncate_prompt_tokens: int | None = None, data_parallel_rank: int | None = None,
                       add_special_tokens: bool | None = None) -> ClassificationOutput:
        """A ``*ForSequenceClassification`` model's verdict on a prompt (text or token ids): its score head's
        logits over the last token, the probabilities (softmax; sigmoid for one label) and the top label's
        name (docs/pooling.md). Scheduled as `embed` is; any other model refuses it. `add_special_tokens` as for
        `embed`."""
        from asyncllm.engine.scoring import classify

        options = RequestOptions(priority, request_id, timeout, cache_salt, lora_request=lora_request,
                                 data_parallel_rank=data_parallel_rank, add_special_tokens=add_special_tokens)
        return await classify(self, prompt, options, truncate_prompt_tokens)

    async def score(self, text_1: str | list[str], text_2: str | list[str], *, priority: int = 0,
                    timeout: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None,
                    truncate_prompt_tokens: int | None = None,
                    use_activation: bool | None = None) -> list[ScoringOutput]:
        """vLLM's ``LLM.score``: how well each text of `text_2` matches `text_1` (one text for all, 1:N; or
        one per text, N:N), one `ScoringOutput` per pair in `text_2`'s order. A cross-encoder (a classifier
        with one label) reads each pair as one prompt (sigmoid of its logit; ``use_activation=False``, vLLM's
        pooling switch: the raw logit); any other model scores the cosine similarity of the two embeddings
        (docs/pooling.md)."""
        from asyncllm.engine.scoring import score

        if use_activation not in (None, True, False):
            raise InvalidRequestError("use_activation", f"must be true, false or None, got {use_activation!r}")
        options = RequestOptions(priority, None, timeout, cache_salt, lora_request=lora_request, pooling_api="score")
        with self._drain.request():  # in flight for aclose(drain=True) from its call, as its texts' requests are
            await self.start()
            with self._drain.steps():
                return await score(self, text_1, text_2, options, truncate_prompt_tokens, use_activation is not False)

    async def _pool(self, prompt: Any, options: RequestOptions, truncate_prompt_tokens: int | None,
                    chat: bool = False) -> RequestCollector:
        """Run a pooling request (`options.pooling` set) to its end; its collector holds the pooled vector. `chat`:
        `prompt` is chat messages, rendered on the processor thread as `chat`'s (media parts and all:
        asyncllm/engine/pooling_chat.py)."""
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY,
                                truncate_prompt_tokens=truncate_prompt_tokens)
        stream = RequestStream(self, prompt, params, options, chat=chat)
        reason = None
        async with stream:
            async for delta in stream:
                reason = delta.finish_reason or reason
        collector = stream.collector
        assert collector is not None, stream
        if collector.embedding is None:  # ended before its rows were pooled: its deadline, `abort`, the engine's close
            if reason == "timeout":
                raise RequestTimeoutError(f"request {collector.request_id!r} did not finish within its timeout")
            raise RequestAbortedError(f"request {collector.request_id!r} was aborted before it was pooled")
        return collector

    def transcribe(self, audio: Any, *, task: str = "transcribe", language: str | None = None,
                   prompt: str | None = None, params: SamplingParams | None = None) -> AsyncIterator[str]:
        """Speech to text with a Whisper model: the text of ``audio`` (a ``(waveform, rate)`` pair, a waveform or an
        encoded file) as it comes, ``task`` "translate" into English; ``language`` the spoken one (ISO-639-1, default
        English), ``prompt`` context before it. Audio longer than the model hears at once (30 s) runs as pieces cut
        at quiet moments, all at once, their texts in order (docs/multimodal.md#whisper); greedy unless ``params``."""
        return transcribe(self, audio, task=task, language=language, prompt=prompt, params=params)

    async def transcribe_segments(self, audio: Any, *, task: str = "transcribe", language: str | None = None,
                                  prompt: str | None = None, params: SamplingParams | None = None) -> list[Segment]:
        """`transcribe` with timestamps: the audio's segments (``start``/``end`` seconds in the whole audio,
        ``text``), Whisper's timestamp tokens predicted under its rules (docs/multimodal.md#whisper)."""
        return await transcribe_segments(self, audio, task=task, language=language, prompt=prompt, params=params)

    async def generate_many(self, prompts: Any, params: Any = None, *, progress: bool = False,
                            max_concurrency: int | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """Run a batch job: one `RequestOutput` per prompt, in input order (a single prompt, a str, a prompt dict
        or a flat list of token ids, is a batch of one: a list of one output, as vLLM's ``LLM.generate``).

        `params` is one `SamplingParams` for all or a list with one per prompt,
        and so is `lora_request` (a `LoRARequest`, or None for the base model);
        `progress` shows a tqdm bar; at most `max_concurrency` requests are in
        flight (default: 2 x max_num_seqs, enough to keep every batch slot fed).
        The first error cancels the rest and is raised.
        """
        from asyncllm.engine.batch import generate_many

        return await generate_many(self, prompts, params, progress=progress, max_concurrency=max_concurrency,
                                   lora_request=lora_request)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests by their ``request_id`` (vLLM's ``AsyncLLM.abort``): each one's stream ends as a stream
        left early does, every unfinished sample's last delta with finish_reason "abort" (its `generate` returns
        them), and the core frees its KV blocks; a pooling request (`embed`, `encode`, `classify`, `score`), which has
        no partial result, raises `RequestAbortedError`. An id unknown here, or of a finished request, is ignored (as
        vLLM's); other requests run on."""
        ids = _request_ids(request_id)
        self._check_loop()  # collectors belong to the engine's loop
        for collector in list(self._in_flight):
            if collector.request_id in ids and not collector.finished:
                self._abort(collector.request_id, collector)  # as `RequestStream._abort`: the core's abort, then deltas
                collector.abort()

    async def get_tokenizer(self) -> Any:
        """The tokenizer that prompts are encoded with (vLLM's ``AsyncLLM.get_tokenizer``; the Hugging Face
        tokenizer, also `engine.tokenizer` once started). It is loaded as the engine starts, which this starts
        if needed; ``skip_tokenizer_init=True`` loads none: a `ConfigError` naming it."""
        await self.start()
        if self.tokenizer is None:
            raise ConfigError("skip_tokenizer_init", True, "False for get_tokenizer() (no tokenizer was loaded)")
        return self.tokenizer

    async def beam_search(self, prompt: Any, params: BeamSearchParams, **options: Any) -> BeamSearchOutput:
        """Beam search (vLLM's ``LLM.beam_search``): the `params.beam_width` most likely continuations, best first
        (asyncllm/beam_search.py). `options` (priority, lora_request, ...) apply to every step's requests."""
        from asyncllm.beam_search import beam_search, check_beam_request

        check_beam_request(params, options)  # refused before the engine starts, as any request
        with self._drain.request():  # in flight for aclose(drain=True) between its steps too; they are taken
            await self.start()  # not in `steps`: the tasks the start begins are no step of it
            with self._drain.steps():
                return await beam_search(self, prompt, params, **options)


def _prompt_text(prompt: Any) -> str | None:
    """`RequestOutput.prompt`: a text prompt's text, a ``{"prompt": text, ...}`` dict's too (vLLM's); None for
    token ids or embeddings."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _request_ids(request_id: str | Iterable[str]) -> set[str]:
    """`abort`'s ids: one str or an iterable of them (vLLM's form)."""
    if isinstance(request_id, str):
        return {request_id}
    ids = list(request_id) if isinstance(request_id, Iterable) else [request_id]
    if not all(isinstance(i, str) for i in ids):
        raise InvalidRequestError("request_id", f"must be a request id (str) or an iterable of them, got "
                                                f"{request_id!r}")
    return set(ids)


def _checked_params(params: SamplingParams | None) -> SamplingParams | None:
    """`params` if it is a SamplingParams or None (the engine's defaults, resolved once it started)."""
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be a SamplingParams, got {type(params).__name__}")
    return params


def _one_params(params: SamplingParams | None, sampling_params: SamplingParams | None) -> SamplingParams | None:
    """`params`, or `sampling_params` (vLLM's name for it): not both."""
    if params is not None and sampling_params is not None:
        raise InvalidRequestError("sampling_params", "is vLLM's name for params: give one of them, not both")
    return params if sampling_params is None else sampling_params
