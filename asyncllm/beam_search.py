"""Beam search over the engine, as vLLM's ``LLM.beam_search``: `BeamSearchParams` in, `BeamSearchOutput` out.

It runs on the host, one token at a time: every step each live beam is one
engine request of ``max_tokens=1`` that returns its top ``2 * beam_width``
logprobs (the requests of a step run concurrently, and the prefix cache holds
each beam's prefix, so a step recomputes about one token per beam). The
candidates (a beam and one of its tokens) are ranked by cumulative logprob
and the best ``beam_width`` of those not ending in EOS go on; every
candidate ending in EOS (unless ``ignore_eos``) is complete. A beam generates at most ``max_tokens``
and at most what the prompt leaves of ``max_model_len`` (`beam_max_tokens`, the OpenAI server's rule too),
then ends with "length". At the end the complete and the live beams are ranked by
``cumulative_logprob / length ** length_penalty`` (vLLM's ``get_beam_search_score``: length counts the
prompt and output tokens, less an EOS the beam ends with) and the best ``beam_width`` are
returned, their text without the EOS that ended them (vLLM's; special or not). Logprobs are the model's raw
ones (greedy, no temperature, ``raw_logprobs`` whatever the engine's ``logprobs_mode``, so logits never rank
the beams). The model's generation config rules hold as in generate: a ``suppress_tokens`` id is never a
candidate, nor a ``begin_suppress_tokens``
id at the first step (`SuppressedTokens`); the others keep their raw logprobs, not renormalised, as in
transformers' beam search, whose processors mask the log-softmax scores (a step's request
asks for as many more logprobs as it leaves out). Each beam keeps, per output token, the step's whole
entry (vLLM's form): the ``2 * beam_width`` most likely tokens allowed, with their logprobs and (raw) ranks,
the chosen one among them.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncllm.config_checks import is_int
from asyncllm.errors import (
    EngineDeadError, InvalidRequestError, NotBuiltError, RequestTimeoutError, check_context_length,
)
from asyncllm.engine.admission import admission_group
from asyncllm.engine.stream import check_prompt
from asyncllm.engine.prompt_tokens import text_token_ids
from asyncllm.engine.validation import check_text, check_untokenized, max_prompt_chars, split_cache_salt
from asyncllm.generation_config import SuppressedTokens
from asyncllm.mm.host import MEDIA_KEYS, plain_prompt
from asyncllm.outputs import Logprob, RequestOutput
from asyncllm.sampling import SamplingParams, numpy_number

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "beam_max_tokens", "beam_search"]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam-search settings. ``temperature`` (finite, >= 0) changes no beam: the beams follow the raw
    logprobs, as vLLM's under its default ``raw_logprobs`` (there the step's temperature only picks the token
    it samples beside the top ``2 * beam_width``, which is never among the best ``beam_width`` candidates)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    """Kept for vLLM compatibility: beam search has no stop strings, so it changes nothing but must be False."""

    def __post_init__(self) -> None:
        """numpy's scalars (``np.float32`` temperatures, ``np.int64`` widths) as Python's int and float, as
        `SamplingParams` takes them."""
        for name, value in vars(self).items():
            if numpy_number(value):
                object.__setattr__(self, name, value.item())

    def validate(self, max_logprobs: int = -1) -> None:
        """`InvalidRequestError` naming the bad field; `max_logprobs`: the engine's, which each step's top
        ``2 * beam_width`` logprobs must not exceed (-1: the vocabulary, more than 128)."""
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= 64:
            raise InvalidRequestError("beam_width", f"must be an int in [1, 64], got {self.beam_width!r}")
        if max_logprobs != -1 and 2 * self.beam_width > max_logprobs:  # vLLM's error names the step's logprobs
            raise InvalidRequestError("beam_width", f"{self.beam_width} needs the top 2 * beam_width = "
                                                    f"{2 * self.beam_width} logprobs a step, more than the engine's "
                                                    f"max_logprobs={max_logprobs}: lower beam_width to "
                                                    f"{max_logprobs // 2} or raise max_logprobs")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise InvalidRequestError("length_penalty", f"must be a finite number, got {penalty!r}")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 \
                or not math.isfinite(temperature):
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {temperature!r}")
        if self.include_stop_str_in_output:
            raise InvalidRequestError("include_stop_str_in_output", "beam search has no stop strings")


def beam_max_tokens(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None) -> int:
    """How many tokens a beam search generates at most: `max_tokens` (None: no bound of its own) and no more than
    the prompt leaves of `max_model_len` (its beams then end with "length", as generate's sample would)."""
    room = max_model_len - num_prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


@dataclass
class BeamSearchSequence:
    """One beam: every token (prompt first), its cumulative logprob and its text (the output tokens)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    """Per output token, the step's top ``2 * beam_width`` tokens (the chosen one among them): vLLM's form."""
    text: str = ""
    finish_reason: str | None = None
    """'stop' (it ended with EOS) or 'length'."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.logprobs)

    @property
    def token_logprobs(self) -> list[float]:
        """The logprob of each output token (the chosen one of each step)."""
        return [entry[token].logprob for token, entry in zip(self.tokens[-len(self.logprobs):], self.logprobs)] \
            if self.logprobs else []


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """The best ``beam_width`` beams, best first."""


async def _prompt_ids(engine: "AsyncEngine", prompt: Any) -> list[int]:
    """Token ids of text, of token ids (a list or tuple, as generate's), or of vLLM's ``{"prompt": text}`` /
    ``{"prompt_token_ids": ids}`` (as the engine reads them: `plain_prompt`, None or empty media entries are none;
    its ``cache_salt`` split off first). One prompt: a list of prompts (vLLM's ``LLM.beam_search`` takes one) is an
    `InvalidRequestError` saying so, an encoder-decoder prompt a `NotBuiltError`."""
    if isinstance(prompt, dict):
        if {"encoder_prompt", "decoder_prompt"} & set(prompt):
            raise NotBuiltError("prompt", None, "beam search over an encoder-decoder prompt ({'encoder_prompt': ..., "
                                "'decoder_prompt': ...})", value_repr=f"a dict of {sorted(prompt)}")
        plain = plain_prompt(prompt)
        if plain is None:
            raise _not_plain(prompt)
        prompt = plain
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, dict, list, tuple)):
        raise InvalidRequestError("prompt", f"beam_search takes one prompt per call, got a list of {len(prompt)} "
                                            "prompts (vLLM's LLM.beam_search takes a list): call it once per prompt "
                                            "(asyncio.gather runs the searches concurrently)")
    check_prompt(prompt, chat=False)  # a str or token ids, not empty, as generate's
    return await text_prompt_ids(engine, prompt) if isinstance(prompt, str) else list(prompt)


async def text_prompt_ids(engine: "AsyncEngine", prompt: str, truncate_prompt_tokens: int | None = None,
                          add_special_tokens: bool = True) -> list[int]:
    """A text prompt's token ids as generate's (`text_token_ids`, the engine's), tokenized off the event loop:
    valid Unicode (`check_text`), a tokenizer (`check_untokenized`), ``do_lower_case``, a huge text refused by its
    parts past the engine's ``max_prompt_chars`` before it is tokenized whole, cut on the left to
    `truncate_prompt_tokens` (BOS kept), BOS and the like added unless not `add_special_tokens` (vLLM's)."""
    check_text("prompt", prompt)
    if engine.tokenizer is None:
        check_untokenized(prompt, False, SamplingParams(), None)
    max_model_len = engine.config.max_model_len

    def encode() -> list[int]:  # max_prompt_chars scans the vocabulary: off the loop too
        past = max_prompt_chars(engine.tokenizer, max_model_len) if truncate_prompt_tokens is None else 0
        return text_token_ids(engine.tokenizer, prompt, max_model_len, past, engine.pooling_model,
                              truncate_prompt_tokens=truncate_prompt_tokens, add_special_tokens=add_special_tokens)[0]

    return await asyncio.to_thread(encode)


_PLAIN_SHAPE = "beam search takes {'prompt': text} or {'prompt_token_ids': ids}, and optionally 'cache_salt'"
_NOT_BUILT = {"prompt_embeds": "a prompt given as embeddings", "token_type_ids": "a cross-encoder's token type ids"}
"""vLLM's prompt keys beam search cannot use (its steps extend token ids, and generate)."""


def _not_plain(prompt: dict[str, Any]) -> InvalidRequestError:
    """Why a dict (its ``cache_salt`` aside) holds no plain prompt, naming the key: one that vLLM's prompt dicts do
    not have, embeddings or media (not built for beam search), a text or ids of the wrong type, or neither or both
    of them."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"} - MEDIA_KEYS - set(_NOT_BUILT))
    if unknown:
        return InvalidRequestError(f"prompt.{unknown[0]}", f"unknown key {unknown[0]!r}: {_PLAIN_SHAPE}")
    for key, what in _NOT_BUILT.items():
        if key in prompt:
            return InvalidRequestError(f"prompt.{key}", f"{what} is not built for beam search: {_PLAIN_SHAPE}")
    media = [key for key in sorted(set(prompt) & MEDIA_KEYS)
             if plain_prompt({"prompt": "", key: prompt[key]}) is None]  # the keys that hold media
    if media:
        return InvalidRequestError(f"prompt.{media[0]}", f"media are not built for beam search: {_PLAIN_SHAPE}")
    for key, kind, name in (("prompt", str, "a str"), ("prompt_token_ids", list, "a list of ids")):
        if prompt.get(key) is not None and not isinstance(prompt[key], kind):
            return InvalidRequestError(f"prompt.{key}", f"must be {name}, got {type(prompt[key]).__name__}")
    return InvalidRequestError("prompt", _PLAIN_SHAPE)


def _score(beam: BeamSearchSequence, length_penalty: float, eos: frozenset[int]) -> float:
    """vLLM's ``get_beam_search_score``: the length counts prompt and output tokens, less an EOS the beam ends
    with (any of the engine's EOS ids, ``ignore_eos`` or not, as vLLM's)."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos)
    return beam.cum_logprob / (length ** length_penalty)


def _step_params(width: int, left_out: int, max_logprobs: int, vocab_size: int) -> SamplingParams:
    """A step's request: one token, and the top ``2 * width`` raw logprobs plus one per id the step leaves out
    (`SuppressedTokens`), within the engine's `max_logprobs` and the vocabulary (0, -1: no bound)."""
    bounds = [bound for bound in (max_logprobs, vocab_size) if bound > 0]
    logprobs = max(2 * width, min([2 * width + left_out, *bounds]))
    # raw_logprobs whatever the engine's logprobs_mode: the beams are ranked by log-probabilities, never by logits
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=logprobs, ignore_eos=True,
                          logprobs_mode="raw_logprobs")


def _step_entry(out: RequestOutput, left_out: frozenset[int], width: int) -> dict[int, Logprob]:
    """A step's top ``2 * width`` tokens but those it leaves out, best first. A step that ended without a token
    ends the search: `RequestTimeoutError` (its ``timeout`` passed), else `EngineDeadError` (aborted: the engine
    closed)."""
    sample = out.outputs[0]
    if not sample.logprobs:
        if sample.finish_reason == "timeout":
            raise RequestTimeoutError("a beam search step ended with finish_reason 'timeout' (the timeout option "
                                      "applies to each step's requests)")
        raise EngineDeadError(f"a beam search step ended with finish_reason {sample.finish_reason!r} and no token")
    allowed = [(token, logprob) for token, logprob in sample.logprobs[0].items() if token not in left_out]
    return dict(sorted(allowed, key=lambda item: item[1].logprob, reverse=True)[:2 * width])


def check_beam_request(params: BeamSearchParams, options: dict[str, Any]) -> None:
    """The checks that need no engine (run before it starts): the parameters, and no caller's ``request_id``."""
    params.validate()
    if options.get("request_id") is not None:
        raise InvalidRequestError("request_id", "beam search runs one request per beam and step and names them itself")


async def beam_search(engine: "AsyncEngine", prompt: Any, params: BeamSearchParams, **options: Any) -> BeamSearchOutput:
    """See the module docstring; `prompt` is text or token ids, bare or in vLLM's prompt dicts (whose ``cache_salt``
    salts every step's requests)."""
    check_beam_request(params, options)
    await engine.start()
    params.validate(engine.config.max_logprobs)  # once started: an attached host's config is then the core's
    prompt, cache_salt = split_cache_salt(prompt, options.get("cache_salt"))  # every step's requests are salted
    if cache_salt is not None:
        options = {**options, "cache_salt": cache_salt}
    prompt_ids = await _prompt_ids(engine, prompt)
    max_model_len, width = engine.config.max_model_len, params.beam_width
    check_context_length(max_model_len, len(prompt_ids))  # a prompt that leaves no room: generate's error
    suppressed: SuppressedTokens = engine.suppressed_tokens
    eos = frozenset(engine.eos_token_ids)
    ends = frozenset() if params.ignore_eos else eos
    beams, complete = [BeamSearchSequence(list(prompt_ids))], []
    for index in range(beam_max_tokens(max_model_len, len(prompt_ids), params.max_tokens)):
        left_out = suppressed.always | suppressed.at_start if index == 0 else suppressed.always
        step = _step_params(width, len(left_out), engine.config.max_logprobs, suppressed.vocab_size)
        with admission_group(len(beams), own=True):  # a step's beams are admitted together, in a group of their own
            outs = await asyncio.gather(*(engine.generate(b.tokens, step, **options) for b in beams))
        candidates = []
        for beam, out in zip(beams, outs):
            entry = _step_entry(out, left_out, width)
            for token, logprob in entry.items():
                candidate = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + logprob.logprob,
                                               beam.logprobs + [entry])
                if token in ends:
                    candidate.finish_reason = "stop"
                    complete.append(candidate)
                else:
                    candidates.append(candidate)
        beams = sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:width]
        if not beams:
            break
    for beam in beams:
        beam.finish_reason = "length"
    best = sorted(complete + beams, key=lambda b: _score(b, params.length_penalty, eos), reverse=True)[:width]
    for beam in best if engine.tokenizer is not None else ():  # skip_tokenizer_init: ids only, text ""
        end = len(beam.tokens) - (beam.finish_reason == "stop")  # vLLM's: an EOS that ended it is no text
        beam.text = engine.tokenizer.decode(beam.tokens[len(prompt_ids):end], skip_special_tokens=True)
    return BeamSearchOutput(best)
