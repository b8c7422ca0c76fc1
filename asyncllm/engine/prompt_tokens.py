"""One request's prompt as token ids, on the host's processor thread (asyncllm/engine/processor.py).

Text, token ids, chat messages, a prompt with images (asyncllm/mm/) or one given as embeddings
(asyncllm/engine/prompt_embeds.py): each becomes the ids the core schedules, truncated as the request asks and
checked against the model (vocabulary, ``max_model_len``), or an `InvalidRequestError` naming what is wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from asyncllm import errors
from asyncllm.engine.chat_bounds import check_chat_size
from asyncllm.engine.pooling_model import PoolingModel, lowercases, lowered
from asyncllm.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, prompt_embeds_of
from asyncllm.engine.validation import (check_prompt_chars, check_text, check_token_ids, max_prompt_chars,
                                       truncated_prompt, truncation_length)
from asyncllm.mm.host import multimodal_prompt, plain_prompt
from asyncllm.mm.inputs import MultiModalInputs
from asyncllm.mm.processor import MultiModalProcessor
from asyncllm.sampling import SamplingParams
from asyncllm.tokenizer import chat_token_ids, encode_prompt, render_chat, truncating

if TYPE_CHECKING:
    from asyncllm.engine.processor import Submit

__all__ = ["PromptTokenizer", "length_capped", "text_token_ids"]


@dataclass
class PromptTokenizer:
    """The processor thread's tokenization; `ready` once the core says its ``max_model_len``."""

    tokenizer: Any
    """None with ``skip_tokenizer_init`` (the processor refuses what needs it first)."""
    vocab_size: int
    mm: MultiModalProcessor | None = None
    """Image processing, for multimodal models only."""
    pooling_model: PoolingModel | None = None
    """A classifier's pair encoding (`score`)."""
    embeds_width: int | None = None
    """The width of a prompt given as embeddings (the model's hidden size); None: such prompts are refused."""
    max_model_len: int = 0
    """What the host serves: its core's (`ready`), or less (`serve`)."""
    core_max_model_len: int = 0
    """The core's own (its Ready's): a sequence runs on to it unless max_tokens ends it before."""
    max_prompt_chars: int = 2**62
    """Characters beyond which a text prompt may not fit (`max_prompt_chars`): counted by parts before it is
    tokenized whole, and refused when they make too many tokens."""

    def ready(self, max_model_len: int) -> None:
        self.core_max_model_len = max_model_len
        self.serve(max_model_len)

    def serve(self, max_model_len: int) -> None:
        """Serve `max_model_len` (data parallelism: the replicas' least), never past the core's own."""
        limit = min(max_model_len, self.core_max_model_len)
        if limit == self.max_model_len:  # told again (a Ready, then the replicas' least): no vocabulary scan
            return
        self.max_model_len = limit
        if self.tokenizer is not None:
            self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)

    def token_ids(self, job: Submit) -> list[int]:
        """The job's prompt token ids; sets ``job.embeds`` / ``job.mm_prompt`` for embeddings and images.

        With the option ``check_max_tokens`` (the OpenAI server's, for a request that set max_tokens), a prompt
        plus max_tokens over max_model_len is an error (else the engine cuts max_tokens to the room left: the core
        at its own max_model_len, ``job.params`` here when the host serves less or the option ``fit_max_tokens``
        asks it)."""
        token_ids = self._token_ids(job)
        if job.options.check_max_tokens and not job.options.echo_only:  # the prompt alone was checked when built
            errors.check_context_length(self.max_model_len, len(token_ids), job.params.max_tokens)
        if job.options.fit_max_tokens or self.max_model_len < self.core_max_model_len:
            job.params = length_capped(job.params, self.max_model_len - len(token_ids))
        return token_ids

    def _token_ids(self, job: Submit) -> list[int]:
        options = job.options
        operation = options.pooling_operation  # None: a generation, which needs room for one token
        if isinstance(job.prompt, dict) and not job.chat and "prompt_embeds" in job.prompt:
            if self.mm is not None and self.mm.marks_text_prompts:
                raise errors.InvalidRequestError("prompt.prompt_embeds", "a prompt given as embeddings is not built "
                                                                         "yet for PaliGemma (its prefix span)")
            job.embeds = prompt_embeds_of(job.prompt, self.embeds_width, job.params, self.max_model_len, operation)
            return [PLACEHOLDER_TOKEN_ID] * job.embeds.shape[0]
        if isinstance(job.prompt, dict) and not job.chat:  # vLLM's TextPrompt / TokensPrompt: the plain prompt
            plain = plain_prompt(job.prompt)  # {"prompt": ""} is "" (BOS alone), as vLLM's
            job.prompt = job.prompt if plain is None else plain
        if job.chat:  # bounds told before any template renders it, a multimodal chat's too (chat_bounds.py)
            check_chat_size(self.tokenizer, job.prompt, self.max_model_len, self.max_prompt_chars, operation,
                            cuttable=job.params.truncate_prompt_tokens is not None)
        if self.mm is not None or isinstance(job.prompt, dict) or job.chat:  # chat: media for a text model is refused
            job.mm_prompt = multimodal_prompt(self.mm, job.prompt, job.chat, options.chat_template_kwargs,
                                              options.tools, options.chat_template, options.mm_processor_kwargs,
                                              options.chat_template_content_format,
                                              lambda text: self._check_chat_chars(job, text, cuttable=False))
            if job.mm_prompt is not None:  # its length counts the media placeholders
                if options.add_special_tokens not in (None, not job.chat):
                    raise errors.InvalidRequestError("add_special_tokens", "only its default is built for a prompt "
                                                                           "with images, audio or video")
                errors.check_context_length(self.max_model_len, len(job.mm_prompt.token_ids), operation=operation,
                                            echo_only=options.echo_only)
                if job.params.truncate_prompt_tokens is not None:
                    raise errors.InvalidRequestError("truncate_prompt_tokens", "cannot cut a prompt with images")
                return job.mm_prompt.token_ids
            if self.mm is not None and self.mm.needs_audio is not None:  # Whisper: no transcript without audio
                raise errors.InvalidRequestError("prompt", f"a prompt without audio; the model takes "
                                                           f"{self.mm.needs_audio}")
        if job.chat:
            token_ids = self._truncated(job, self._chat_token_ids(job), chat=True)
        elif isinstance(job.prompt, str):
            check_text("prompt", job.prompt)
            token_ids = self._text_token_ids(job)
        else:
            token_ids = self._truncated(job, list(job.prompt))
            if len(token_ids) <= self.max_model_len:  # a huge list is refused below without a look at each id
                check_token_ids("prompt", token_ids, self.vocab_size)
        if not token_ids:
            raise errors.InvalidRequestError("prompt", "the prompt is empty")
        errors.check_context_length(self.max_model_len, len(token_ids), operation=operation,
                                    echo_only=options.echo_only)
        if self.mm is not None and self.mm.marks_text_prompts:  # PaliGemma: a text prompt is its prefix span too
            job.mm_prompt = self.mm.process(token_ids, MultiModalInputs(), "prompt")
        return token_ids

    def _chat_token_ids(self, job: Submit) -> list[int]:
        """The chat's ids: rendered as text first, counted by parts past ``max_prompt_chars`` as a text prompt is (the
        tokenizing of a huge chat would stall the processor thread for every request), then tokenized."""
        options = job.options
        text = render_chat(self.tokenizer, job.prompt, template_kwargs=options.chat_template_kwargs,
                           tools=options.tools, chat_template=options.chat_template,
                           content_format=options.chat_template_content_format, lower=lowercases(self.pooling_model))
        self._check_chat_chars(job, text)
        keep = truncation_length(job.params.truncate_prompt_tokens, self.max_model_len,
                                 pooling=options.pooling is not None)
        return chat_token_ids(self.tokenizer, text, bool(options.add_special_tokens), max_length=keep,
                              truncation_side="right" if options.pooling is not None else "left")

    def _check_chat_chars(self, job: Submit, text: str, cuttable: bool = True) -> None:
        """A rendered chat longer than ``max_prompt_chars`` refused by parts (`_refuse_past_chars`), unless it may be
        cut (``truncate_prompt_tokens``; a chat with media parts may not: asyncllm/mm/host.py)."""
        if not (cuttable and job.params.truncate_prompt_tokens is not None):
            self._refuse_past_chars(job, (text,), field="messages")

    def _refuse_past_chars(self, job: Submit, texts: tuple[str, ...], field: str = "prompt") -> None:
        """Texts longer together than ``max_prompt_chars`` refused once their parts make too many tokens
        (`check_prompt_chars`), before they are tokenized whole on the processor thread every request shares."""
        check_prompt_chars(self.tokenizer, tuple(lowered(self.pooling_model, text) for text in texts),
                           self.max_model_len, self.max_prompt_chars, job.options.pooling_operation, field)

    def _truncated(self, job: Submit, token_ids: list[int], chat: bool = False) -> list[int]:
        """Token ids cut to ``truncate_prompt_tokens``: the last k (vLLM's cut of token ids), the first k for a
        pooling request's rendered `chat` (`truncated_prompt`)."""
        return truncated_prompt(token_ids, job.params.truncate_prompt_tokens, self.max_model_len,
                                pooling=job.options.pooling is not None, chat=chat)

    def _text_token_ids(self, job: Submit) -> list[int]:
        """A text prompt's ids (`text_token_ids`); a pair's second text's token type start, to the model."""
        options = job.options
        token_ids, type_start = text_token_ids(self.tokenizer, job.prompt, self.max_model_len, self.max_prompt_chars,
                                               self.pooling_model, text_pair=options.text_pair,
                                               truncate_prompt_tokens=job.params.truncate_prompt_tokens,
                                               pooling=options.pooling is not None,
                                               add_special_tokens=options.add_special_tokens is not False,
                                               operation=options.pooling_operation)
        if type_start is not None and options.pooling is not None:
            pooling_params = msgspec.structs.replace(options.pooling, token_type_start=type_start)
            job.options = dataclasses.replace(options, pooling=pooling_params)
        return token_ids


def text_token_ids(tokenizer: Any, prompt: str, max_model_len: int, past: int,
                   pooling_model: PoolingModel | None = None, *, text_pair: str | None = None,
                   truncate_prompt_tokens: int | None = None, pooling: bool = False, add_special_tokens: bool = True,
                   operation: str | None = None) -> tuple[list[int], int | None]:
    """A text prompt's ids (and `text_pair`'s, `score`'s), and where the pair's token type 1 starts (None: all 0):
    the engine's and beam search's (asyncllm/beam_search.py) text prompts. Lowercased where `pooling_model` does
    (``do_lower_case``, vLLM's, before tokenizing); longer than `past` characters (``max_prompt_chars``) and not
    cut: refused once its parts make too many tokens (`check_prompt_chars`), before it is tokenized whole; cut by
    the tokenizer as vLLM's (``truncation=True, max_length=k``, special tokens kept): a generation's on the left
    (BOS, then the text's last tokens), a `pooling` request's (embed, classify, score) on the right, as vLLM's
    pooling runner and sentence-transformers. Call it off the event loop: it tokenizes."""
    keep = truncation_length(truncate_prompt_tokens, max_model_len, pooling=pooling)
    texts = (lowered(pooling_model, prompt), lowered(pooling_model, text_pair or ""))
    if keep is None:
        check_prompt_chars(tokenizer, texts, max_model_len, past, operation)
    if text_pair is None:
        return encode_prompt(tokenizer, texts[0], add_special_tokens, max_length=keep,
                             truncation_side="right" if pooling else "left"), None
    return _encode_pair(tokenizer, pooling_model, texts, keep)


def _encode_pair(tokenizer: Any, pooling_model: PoolingModel | None, texts: tuple[str, str],
                 max_length: int | None) -> tuple[list[int], int | None]:
    """The pair's one prompt as the classifier encodes it (`score`), and where its token type 1 starts (None: all
    0); ``max_length``: cut on the right."""
    assert pooling_model is not None, "score sends pairs to a started engine's classifier"
    if max_length is None:
        return pooling_model.encode_pair(tokenizer, *texts)
    with truncating(tokenizer, max_length, "right", pair=True) as cut:
        return pooling_model.encode_pair(cut, *texts, max_length)


def length_capped(params: SamplingParams, room: int) -> SamplingParams:
    """`params` ending by length after `room` tokens at the latest (the served max_model_len less the prompt):
    max_tokens cut to it, and min_tokens, which may not exceed max_tokens. The core then stops the sequence there
    with finish_reason "length", as vLLM's at max_model_len. A prompt that fills the length (an echo's or a pooling
    request's, max_tokens 1) keeps its one token."""
    room = max(room, 1)
    if params.max_tokens is not None and params.max_tokens <= room:
        return params
    return msgspec.structs.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
