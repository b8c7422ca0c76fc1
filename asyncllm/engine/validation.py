"""Checks on what enters the engine, so that a bad request fails alone and never takes the engine down.

The host checks first (types and values on the loop, token ids and lengths on
the processor thread): a bad prompt or parameter gets `InvalidRequestError`
naming the field before anything reaches the core. The core checks again what
it decodes (`check_add_request`), because its socket may be reached by other
hosts (`AsyncEngine.connect`) or by anything that can write to it: msgspec
already enforces the types of every frame, this adds the values a worker would
crash on (token ids outside the vocabulary, non-finite numbers).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from asyncllm import protocol
from asyncllm.config_checks import is_int
from asyncllm.errors import InvalidRequestError, prompt_too_many_chars
from asyncllm.models.architectures import (CLASSIFICATION_ARCHITECTURES, EMBEDDING_ARCHITECTURES, REWARD_ARCHITECTURES,
                                           LATE_INTERACTION_ARCHITECTURES, TOKEN_CLASSIFICATION_ARCHITECTURES)
from asyncllm.pooling import PoolingParams
from asyncllm.sampling import MAX_LOGPROBS, SamplingParams

__all__ = [
    "truncated_prompt", "truncation_length",
    "MAX_N", "MAX_REQUEST_ID_CHARS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "check_add_request", "check_request_id",
    "check_allowed_tokens",
    "check_text", "served_tasks", "split_cache_salt",
    "check_params_text", "check_params_vocab", "check_request_strings",
    "check_token_ids",
    "max_prompt_chars",
    "tokens_at_least", "check_prompt_chars", "PART_CHARS",
]

MAX_REQUEST_ID_CHARS = 1024
"""Longest request id (caller-given ids are echoed in logs, metrics and every delta)."""
CORE_ID_SUFFIX_CHARS = 48
"""Room the core's bound leaves past `MAX_REQUEST_ID_CHARS` for the host's ``#<submission>-<sample>`` suffix
(asyncllm/engine/processor_requests.py `sample_request_ids`)."""
MAX_N = 1024
"""Most samples per request: each is a request in the core, so n is bounded like a batch, not like an int."""
MAX_STOP_STRINGS = 256
"""Most stop strings per request: the processor thread matches each against every new piece of text."""
MAX_STOP_CHARS = 4096
"""Longest stop string: the detokenizer holds back that much text before a stream may show it."""
_UNKNOWN_VOCAB_LIMIT = 2**31
"""Bound on token ids when the vocabulary size is unknown (test runners): they must fit int32 tensors."""
_PRIORITY_LIMIT = 2**63
"""Priorities are compared as ints; beyond int64 is certainly a mistake."""


# ---------------------------------------------------------------- host side
def check_request_id(request_id: str, sent_as: str = "", limit: int = MAX_REQUEST_ID_CHARS) -> None:
    """`InvalidRequestError` for a request id over `MAX_REQUEST_ID_CHARS` (the one bound, the engine's and the
    server's; the core's allows the host's suffix, `CORE_ID_SUFFIX_CHARS`); `sent_as` says how a client sent it."""
    if len(request_id) > limit:
        raise InvalidRequestError("request_id", f"{sent_as}must be at most {limit} characters, "
                                                f"got {len(request_id)}")


def check_text(field: str, text: str) -> None:
    """`InvalidRequestError` if `text` cannot be encoded as UTF-8 (a lone surrogate, e.g. from a bad decode)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(field, f"is not valid Unicode text: {exc.reason} at index {exc.start}") from None


def check_params_text(params: SamplingParams) -> None:
    """Sizes the host's processor thread pays for per token, and UTF-8 strings (after `params.validate()`)."""
    if params.n > MAX_N:
        raise InvalidRequestError("n", f"at most {MAX_N} samples per request, got {params.n}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
    for stop in params.stop:
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequestError("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters, "
                                      f"got {len(stop)}")
        check_text("stop", stop)
    for word in params.bad_words:  # tokenized on the host and sent to the core as text too
        check_text("bad_words", word)
    if params.structured is not None:  # its texts (regex, grammar, choices, a schema's strings) go to the core
        for text in _texts(msgspec.structs.asdict(params.structured)):
            check_text("structured", text)


def _texts(value: object) -> Iterator[str]:
    """Every string in `value` (dicts' keys too, lists, nested)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def check_request_strings(params: SamplingParams, request_id: str | None, cache_salt: str | None) -> None:
    """Strings that cross the wire must be valid UTF-8 (a lone surrogate would fail the processor's encoder)."""
    check_params_text(params)
    if request_id is not None:
        check_text("request_id", request_id)
        check_request_id(request_id)
    if cache_salt is not None:
        check_text("cache_salt", cache_salt)


def split_cache_salt(prompt: Any, cache_salt: str | None) -> tuple[Any, str | None]:
    """A prompt dict without its ``cache_salt`` (vLLM's TextPrompt / TokensPrompt / EmbedsPrompt key), and the
    request's salt: the dict's, or else `cache_salt` (the argument). A dict's salt is a str (None: none; ``""`` is
    a salt, as the argument's); the argument may repeat it, a different one is refused. Any other prompt: as is."""
    if not isinstance(prompt, dict) or "cache_salt" not in prompt:
        return prompt, cache_salt
    salt = prompt["cache_salt"]
    prompt = {key: value for key, value in prompt.items() if key != "cache_salt"}
    if salt is None:
        return prompt, cache_salt
    if not isinstance(salt, str):
        raise InvalidRequestError("prompt.cache_salt", f"must be a str, got {type(salt).__name__}")
    if cache_salt is not None and cache_salt != salt:
        raise InvalidRequestError("prompt.cache_salt", "differs from the cache_salt argument: give one of them")
    check_text("prompt.cache_salt", salt)
    return prompt, salt


def check_untokenized(prompt: Any, chat: bool, params: SamplingParams, text_pair: str | None) -> None:
    """`InvalidRequestError` naming the first thing of a request that needs the tokenizer an engine started with
    ``skip_tokenizer_init=True`` does not have (vLLM refuses text prompts there too)."""
    needs = (("messages", chat), ("prompt", isinstance(prompt, str) or isinstance(prompt, dict) and "prompt" in prompt),
             ("text_pair", text_pair is not None), ("stop", bool(params.stop)), ("bad_words", bool(params.bad_words)),
             ("structured", params.structured is not None))
    for field, used in needs:
        if used:
            raise InvalidRequestError(field, "needs the tokenizer, and this engine loads none (skip_tokenizer_init="
                                             "True): give prompts as token ids and stop tokens as stop_token_ids")


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Characters beyond which a text prompt is counted by parts (`tokens_at_least`) before it is tokenized whole.

    Most tokenizers spell every character: as no vocabulary entry spells more than its string's length, a prompt
    longer than ``max_model_len * longest entry`` cannot fit. Some drop or squash characters (BERT's whitespace and
    control characters, XLM-R's and T5's runs of spaces) or spell a whole word as one token (WordPiece's [UNK] past
    100 characters), so that length alone refuses nothing: past it, `tokens_at_least` decides.
    """
    longest = _LONGEST_ENTRY.get(tokenizer) if _weakly_keyed(tokenizer) else None
    if longest is None:
        try:
            longest = max(len(token) for token in tokenizer.get_vocab())
        except (AttributeError, TypeError, ValueError):  # a tokenizer without a vocabulary listing: no bound
            return 2**62
        if _weakly_keyed(tokenizer):
            _LONGEST_ENTRY[tokenizer] = longest
    return max_model_len * max(longest, 1)


_LONGEST_ENTRY: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
"""Each tokenizer's longest vocabulary entry, read once (a 150k vocabulary's listing takes tens of ms; beam search
asks for each prompt)."""


def _weakly_keyed(tokenizer: Any) -> bool:
    try:
        weakref.ref(tokenizer)
        hash(tokenizer)
    except TypeError:
        return False
    return True


PART_CHARS = 1 << 16
"""Fewest characters per part a long text is counted by (`tokens_at_least`), else 4 per token of
``max_model_len``: few tokenizer calls for a text whose characters make few tokens."""
PART_CUT_TOKENS = 2
"""Tokens a cut before a space may add (a dummy-prefix "▁", a space token joined differently): not counted."""
HARD_CUT_WINDOW = 32
"""A part with no space is cut inside a word, which may add more tokens than `PART_CUT_TOKENS` (a word's merges
redone on both sides: "return" repeated, cut in one, made 4 more): such a cut takes off the tokens of the text
`HARD_CUT_WINDOW` characters either side of it."""


def tokens_at_least(tokenizer: Any, text: str, limit: int, part_chars: int) -> int:
    """`text`'s token count or less: its parts of at most `part_chars` characters, cut before a space, tokenized one
    by one without special tokens (``PART_CUT_TOKENS`` taken off per cut, more at a cut inside a word:
    `HARD_CUT_WINDOW`), stopped once past `limit`.

    Costs about `limit` tokens' tokenizing however long `text` is (a huge prompt does not hold the processor thread
    for every request), unless its characters make few tokens: then it is tokenized whole, as it may fit.
    """
    found, start, spared = 0, 0, 0  # the first part has no cut before it
    while start < len(text) and found <= limit:
        end, cut_spares = start + part_chars, PART_CUT_TOKENS
        if end < len(text):
            cut = text.rfind(" ", start + 1, end)
            if cut > start:
                end = cut
            else:
                cut_spares = _count(tokenizer, text[end - HARD_CUT_WINDOW : end + HARD_CUT_WINDOW])
        found += max(0, _count(tokenizer, text[start:end]) - spared)
        start, spared = end, cut_spares
    return found


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def check_prompt_chars(tokenizer: Any, texts: tuple[str, ...], max_model_len: int, past: int,
                       operation: str | None = None, field: str = "prompt") -> None:
    """Texts of more than `past` characters together (``max_prompt_chars``) counted by parts (`tokens_at_least`),
    and refused once those make more than `max_model_len` tokens (`prompt_too_many_chars`: `operation` and
    `field` as `prompt_too_long`'s), before they are tokenized whole: a huge text's tokenizing would hold its
    thread. Past ``max(4 * max_model_len, PART_CHARS)`` a text is more than one part: no count is needed below."""
    chars, found = sum(len(text) for text in texts), 0
    if chars <= past:
        return
    for text in texts:
        found += tokens_at_least(tokenizer, text, max_model_len - found, max(4 * max_model_len, PART_CHARS))
        if found > max_model_len:
            raise prompt_too_many_chars(max_model_len, chars, found, operation, field)


def check_token_ids(field: str, token_ids: list[Any], vocab_size: int) -> None:
    """Every id an int (not a bool) in [0, vocab_size); O(n) in C for the common case."""
    if not all(type(t) is int for t in token_ids):
        bad = [t for t in token_ids if type(t) is not int][:5]
        raise InvalidRequestError(field, f"token ids must be ints, got {bad!r}")
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = [t for t in token_ids if not 0 <= t < vocab_size][:5]
        raise InvalidRequestError(field, f"token ids must be in [0, {vocab_size}), got {bad}")


def check_logprobs_limit(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """`InvalidRequestError` for ``logprobs`` / ``prompt_logprobs`` above the engine's ``max_logprobs`` (-1: the
    vocabulary's size). A request's -1 asks for the whole vocabulary, as vLLM's ``_validate_logprobs`` reads it:
    it needs ``max_logprobs`` -1 or at least the vocabulary's size."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        asked = vocab_size if value == -1 else value
        if asked is not None and asked > limit:
            whole = " (-1: the whole vocabulary)" if value == -1 else ""
            raise InvalidRequestError(name, f"at most {limit} (the engine's max_logprobs), got {value}{whole}")


def check_params_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token ids inside the parameters (logit_bias keys, stop_token_ids) must be below `vocab_size`:
    the workers index logits with them."""
    params.check_vocab(vocab_size)
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError("stop_token_ids",
                                  f"token ids must be < the vocabulary size {vocab_size}, got {bad[:5]}")


def check_priority(priority: Any) -> None:
    """`InvalidRequestError` unless ``priority`` is an int that fits the wire's int64."""
    if not is_int(priority):
        raise InvalidRequestError("priority", f"must be an int, got {priority!r}")
    if not -_PRIORITY_LIMIT <= priority < _PRIORITY_LIMIT:
        raise InvalidRequestError("priority", f"must fit in int64, got {priority}")


# ---------------------------------------------------------------- core side
def check_add_request(message: protocol.AddRequest, vocab_size: int, prompt_embeds: bool = False,
                      max_logprobs: int = MAX_LOGPROBS, tasks: frozenset[str] | None = None) -> None:
    """`InvalidRequestError` naming the field for a decoded `AddRequest` a worker could not run.

    `vocab_size` 0 means unknown: ids must then fit int32. `prompt_embeds`: the engine takes prompts given as
    embeddings (``enable_prompt_embeds``); `max_logprobs` is the engine's; `tasks`: what the model serves
    (`served_tasks`; None: not checked).
    """
    if not message.request_id:
        raise InvalidRequestError("request_id", "must not be empty")
    check_request_id(message.request_id, limit=MAX_REQUEST_ID_CHARS + CORE_ID_SUFFIX_CHARS)
    message.params.validate()
    _check_core_params(message.params, message.eos_token_ids)
    if message.lora is not None:
        message.lora.validate()
    if message.pooling is not None:
        message.pooling.validate()
        if message.params.max_tokens != 1:  # later steps would pool their decode rows alone
            raise InvalidRequestError("max_tokens", "an embedding or classification request samples one token: "
                                                    f"must be 1, got {message.params.max_tokens}")
    _check_task(message.pooling, tasks)
    limit = vocab_size or _UNKNOWN_VOCAB_LIMIT
    check_token_ids("prompt", message.prompt_token_ids, limit)
    check_token_ids("eos_token_ids", message.eos_token_ids, limit)
    check_params_vocab(message.params, limit)
    check_logprobs_limit(message.params, max_logprobs, limit)
    if not math.isfinite(message.arrival_time):
        raise InvalidRequestError("arrival_time", f"must be a finite time, got {message.arrival_time}")
    check_priority(message.priority)
    if not 0 <= message.num_samples <= MAX_N:  # sample 0 counts for its n samples (engine/sample_groups.py)
        raise InvalidRequestError("num_samples", f"must be from 0 to {MAX_N} (the samples of a request), "
                                                 f"got {message.num_samples}")
    timeout = message.timeout
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise InvalidRequestError("timeout", f"must be a positive number of seconds, got {timeout}")
    if message.prompt_embeds is not None:
        _check_prompt_embeds(message.prompt_embeds, len(message.prompt_token_ids), prompt_embeds)


def _check_core_params(params: SamplingParams, eos_token_ids: list[int]) -> None:
    """What only the host fills in or splits up (n > 1, bad_words' ids), and allowed tokens that are all banned:
    the workers would sample token 0, allowed or not (the host checks that too)."""
    if params.n != 1:
        raise InvalidRequestError("n", f"the engine core runs one sample per request (a host sends each of n "
                                       f"samples as its own request), got {params.n}")
    if params.bad_words and not params.bad_words_token_ids:
        raise InvalidRequestError("bad_words", "the engine core bans token ids: send bad_words_token_ids too "
                                               "(a host fills them from bad_words)")
    check_allowed_tokens(params, eos_token_ids)


def check_allowed_tokens(params: SamplingParams, eos_token_ids: list[int]) -> None:
    """`InvalidRequestError` when every allowed token is always banned (after the host filled bad_words' ids)."""
    if not params.allowed_token_ids:
        return
    banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
    if params.min_tokens:  # the workers mask these until min_tokens outputs
        banned |= set(params.stop_token_ids) | set(eos_token_ids)
    if banned.issuperset(params.allowed_token_ids):
        raise InvalidRequestError("allowed_token_ids", "every allowed token is banned (a one-token bad word, or EOS "
                                                       "or a stop token while min_tokens holds): none is left to sample")


def served_tasks(architectures: Sequence[str] | None, runner: str = "auto",
                 convert: str = "auto") -> frozenset[str] | None:
    """What a model of these ``architectures`` (its config's, as the workers serve it) serves ("generate", "embed",
    "classify"; a reward model's, ``convert="reward"``, and a token classifier's: "token_classify" only; a ColBERT's
    "token_embed" only) under the
    config's resolved ``runner`` (generate: generation only; pooling: no generation), as
    `asyncllm.engine.pooling_model.pooling_model_of` decides it; None when unknown (a test runner without a config):
    then requests are not checked against it."""
    if architectures is None:
        return None
    architectures = list(architectures) or [None]
    if convert == "reward" or architectures[0] in REWARD_ARCHITECTURES:  # docs/pooling.md#reward-models
        return frozenset({"token_classify"})
    if architectures[0] in TOKEN_CLASSIFICATION_ARCHITECTURES:  # NER-style taggers: every row's labels only
        return frozenset({"token_classify"})
    if architectures[0] in LATE_INTERACTION_ARCHITECTURES:  # ColBERT: every row's embedding only
        return frozenset({"token_embed"})
    if architectures[0] in CLASSIFICATION_ARCHITECTURES:
        return frozenset({"classify"})
    if architectures[0] in EMBEDDING_ARCHITECTURES:  # no LM head
        return frozenset({"embed"})
    return frozenset({"generate", "embed"} - ({"embed"} if runner == "generate" else set())
                     - ({"generate"} if runner == "pooling" else set()))


def _check_task(pooling: PoolingParams | None, tasks: frozenset[str] | None) -> None:
    """A classification on a model without a score head would end its workers; the host refuses what the model does
    not serve (`PoolingModel.check`), and so does the core."""
    task = "generate" if pooling is None else pooling.task
    served = task if tasks is not None and task in tasks else \
        {"token_embed": "embed", "token_classify": "classify"}.get(task, task)  # per-token: as per prompt
    if tasks is not None and served not in tasks:
        raise InvalidRequestError("prompt" if pooling is None else "model",  # as the host (`PoolingModel.check`)
                                  f"this model serves {' and '.join(sorted(tasks))} requests only, not {task}")


_EMBEDS_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _check_prompt_embeds(embeds: protocol.PromptEmbeds, num_tokens: int, enabled: bool) -> None:
    if not enabled:
        raise InvalidRequestError("prompt_embeds", "this engine core was started without enable_prompt_embeds")
    shape, itemsize = embeds.shape, _EMBEDS_ITEMSIZE.get(embeds.dtype, 0)
    sized = len(shape) == 2 and len(embeds.data) == shape[0] * shape[1] * itemsize
    if not itemsize or not sized or shape[0] != num_tokens:
        raise InvalidRequestError("prompt_embeds", f"{num_tokens} rows of {', '.join(_EMBEDS_ITEMSIZE)} matching "
                                                   f"its bytes, got {embeds.dtype} {shape} in {len(embeds.data)} bytes")


def truncated_prompt(token_ids: list[int], limit: int | None, max_model_len: int, *, pooling: bool = False,
                     chat: bool = False) -> list[int]:
    """vLLM's ``truncate_prompt_tokens`` for token ids: the prompt's last ``limit`` tokens (a text prompt of a
    `pooling` request is cut on the right instead, by its tokenizer: `truncation_length`). A `pooling` request's
    rendered `chat` keeps its first ``limit``: vLLM's ``_preprocess_chat`` tokenizes the rendered text with
    ``truncation=True, max_length=k`` on the right, adding no special tokens."""
    keep = truncation_length(limit, max_model_len, pooling=pooling)
    if keep is None:
        return token_ids
    return token_ids[:keep] if pooling and chat else token_ids[-keep:]


def truncation_length(limit: int | None, max_model_len: int, *, pooling: bool = False) -> int | None:
    """How many tokens ``truncate_prompt_tokens`` keeps (-1: max_model_len - 1, one left to generate; a `pooling`
    request generates nothing: max_model_len); None: no truncation; `InvalidRequestError` when that leaves no
    room or no prompt."""
    if limit is None:
        return None
    room = max_model_len if pooling else max_model_len - 1
    keep = room if limit == -1 else limit
    if not 1 <= keep <= room:
        bound = "max_model_len" if pooling else "max_model_len - 1"
        raise InvalidRequestError("truncate_prompt_tokens", f"is {limit}, but a prompt can have 1 to {bound} = {room} "
                                                            "tokens (or give -1)")
    return keep
