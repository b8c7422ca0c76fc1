"""Beam search over the engine, as vLLM's ``LLM.beam_search``: `BeamSearchParams` in, `BeamSearchOutput` out.

It runs on the host, one token at a time: every step each live beam is one
engine request of ``max_tokens=1`` that returns its top ``2 * beam_width``
logprobs (the requests of a step run concurrently, and the prefix cache holds
each beam's prefix, so a step recomputes about one token per beam). The
candidates (a beam and one of its tokens) are ranked by cumulative logprob
and the best ``beam_width`` of those not ending in EOS go on; every
candidate ending in EOS (unless ``ignore_eos``) is complete. At the end the complete and
the live beams are ranked by ``cumulative_logprob / length ** length_penalty``
(length: prompt and output tokens, as vLLM) and the best ``beam_width`` are
returned. Logprobs are the model's raw ones (greedy, no temperature, ``raw_logprobs``
whatever the engine's ``logprobs_mode``, so logits never rank the beams); each
beam keeps, per output token, the step's whole entry (vLLM's form): the
``2 * beam_width`` most likely tokens with their logprobs and ranks, the
chosen one among them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncllm.errors import InvalidRequestError
from asyncllm.engine.validation import check_untokenized, split_cache_salt
from asyncllm.mm.host import MEDIA_KEYS, plain_prompt
from asyncllm.outputs import Logprob
from asyncllm.sampling import SamplingParams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "beam_search"]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam-search settings (``temperature`` only 0: the beams follow the raw logprobs)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    """Kept for vLLM compatibility: beam search has no stop strings, so it changes nothing but must be False."""

    def validate(self, max_logprobs: int = -1) -> None:
        """`InvalidRequestError` naming the bad field; `max_logprobs`: the engine's, which each step's top
        ``2 * beam_width`` logprobs must not exceed (-1: the vocabulary, more than 128)."""
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 64:
            raise InvalidRequestError("beam_width", f"must be an int in [1, 64], got {self.beam_width!r}")
        if max_logprobs != -1 and 2 * self.beam_width > max_logprobs:  # vLLM's error names the step's logprobs
            raise InvalidRequestError("beam_width", f"{self.beam_width} needs the top 2 * beam_width = "
                                                    f"{2 * self.beam_width} logprobs a step, more than the engine's "
                                                    f"max_logprobs={max_logprobs}: lower beam_width to "
                                                    f"{max_logprobs // 2} or raise max_logprobs")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise InvalidRequestError("temperature", "beam search ranks the raw logprobs: only 0.0 is built")
        if self.include_stop_str_in_output:
            raise InvalidRequestError("include_stop_str_in_output", "beam search has no stop strings")


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


def _prompt_ids(engine: "AsyncEngine", prompt: Any) -> list[int]:
    """Token ids of text, of token ids, or of vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` (as the
    engine reads them: `plain_prompt`, None or empty media entries are none; its ``cache_salt`` split off first)."""
    if isinstance(prompt, dict):
        plain = plain_prompt(prompt)
        if plain is None:
            raise _not_plain(prompt)
        prompt = plain
    if not isinstance(prompt, list) and engine.tokenizer is None:
        check_untokenized(prompt, False, SamplingParams(), None)
    return list(prompt) if isinstance(prompt, list) else engine.tokenizer(prompt).input_ids


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


def _score(beam: BeamSearchSequence, length_penalty: float) -> float:
    return beam.cum_logprob / (len(beam.tokens) ** length_penalty)


async def beam_search(engine: "AsyncEngine", prompt: Any, params: BeamSearchParams, **options: Any) -> BeamSearchOutput:
    """See the module docstring; `prompt` is text or token ids, bare or in vLLM's prompt dicts (whose ``cache_salt``
    salts every step's requests)."""
    params.validate()
    if options.get("request_id") is not None:
        raise InvalidRequestError("request_id", "beam search runs one request per beam and step and names them itself")
    await engine.start()
    params.validate(engine.config.max_logprobs)  # once started: an attached host's config is then the core's
    prompt, cache_salt = split_cache_salt(prompt, options.get("cache_salt"))  # every step's requests are salted
    if cache_salt is not None:
        options = {**options, "cache_salt": cache_salt}
    prompt_ids = _prompt_ids(engine, prompt)
    width = params.beam_width
    # raw_logprobs whatever the engine's logprobs_mode: the beams are ranked by log-probabilities, never by logits
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True,
                          logprobs_mode="raw_logprobs")
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    beams, complete = [BeamSearchSequence(list(prompt_ids))], []
    for _ in range(params.max_tokens):
        outs = await asyncio.gather(*(engine.generate(b.tokens, step, **options) for b in beams))
        candidates = []
        for beam, out in zip(beams, outs):
            entry = out.outputs[0].logprobs[0]  # type: ignore[index]
            for token, logprob in entry.items():
                candidate = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + logprob.logprob,
                                               beam.logprobs + [entry])
                if token in eos:
                    candidate.finish_reason = "stop"
                    complete.append(candidate)
                else:
                    candidates.append(candidate)
        beams = sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:width]
        if not beams:
            break
    for beam in beams:
        beam.finish_reason = "length"
    best = sorted(complete + beams, key=lambda b: _score(b, params.length_penalty), reverse=True)[:width]
    for beam in best if engine.tokenizer is not None else ():  # skip_tokenizer_init: ids only, text ""
        beam.text = engine.tokenizer.decode(beam.tokens[len(prompt_ids):], skip_special_tokens=True)
    return BeamSearchOutput(best)
