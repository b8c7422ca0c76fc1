"""`SamplingParams`: how one request is sampled, when it stops, and what it returns.

A msgspec Struct so that it crosses the host -> core -> worker wire as is.
`validate()` raises `InvalidRequestError` naming the field; the host calls it
before a request leaves the process. docs/sampling.md lists every field.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

from asyncllm import envs
from asyncllm.config_checks import is_int
from asyncllm.errors import InvalidRequestError
from asyncllm.structured.spec import KINDS, StructuredOutputs

__all__ = ["MAX_LOGPROBS", "RequestOutputKind", "SamplingParams", "StructuredOutputs", "from_vllm_structured",
           "numpy_number", "sample_seed"]

_MAX_SEED = 2**63 - 1
_MIN_SEED = -(2**63)
"""Seeds are int64, as vLLM's server bounds them; a negative one draws as its 64-bit two's complement (torch's
``manual_seed`` reading of it in vLLM)."""
_MASK64 = (1 << 64) - 1

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for per token by default (vLLM's default max_logprobs, OpenAI's limit):
the engine's ``max_logprobs`` sets it (`asyncllm.engine.validation.check_logprobs_limit`)."""
_LOGPROBS_BOUND = 2**31 - 1
"""What `SamplingParams.validate` allows before the engine's ``max_logprobs`` applies: an int32 top-k."""

_MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a logit_bias value; a bias of +-100 bans or forces a token."""
_BAD_WORD_CHARS_PER_TOKEN = 64
"""bad_words' characters allowed per bad-word token, checked before tokenizing: no usual vocabulary entry is longer."""
_NONE_IS_EMPTY = ("stop", "stop_token_ids", "bad_words", "bad_words_token_ids")
"""List fields whose None (vLLM's default for them) is read as the empty list, so that the wire form is the same."""
_REPETITION_PENALTY_BOUND = 2.0**31
"""repetition_penalty lies in [1 / bound, bound]: the workers divide float32 logits by it, and a smaller one
overflows them to inf (below float32's range it is 0), which samples token 0 whatever the logits."""


class RequestOutputKind(enum.IntEnum):
    """What each item of `AsyncEngine.stream` carries (vLLM's names and values)."""

    CUMULATIVE = 0
    """The whole output of the sample so far."""
    DELTA = 1
    """Only what is new since the sample's previous item (the default)."""
    FINAL_ONLY = 2
    """One item per sample, when it finishes, with its whole output."""


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """Sampling and stopping parameters of one request (vLLM's names and defaults, but for ``output_kind``: DELTA,
    what a stream wants, where vLLM's is CUMULATIVE; `AsyncEngine.generate` collects whole outputs either way)."""

    n: int = 1
    """Number of samples of the prompt; they share its prefix-cached KV blocks."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 means all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is batched; -1 is None (vLLM's)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop_token_ids may end the request."""
    stop: list[str] = []
    """Strings that end generation; they are not included in the text (None, vLLM's default, is [])."""
    stop_token_ids: list[int] = []
    """Token ids that end generation (the token is kept in token_ids; None is [])."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the decoded text."""
    spaces_between_special_tokens: bool = True
    """False (with skip_special_tokens False): an added token right after another is emitted as its bare content,
    without the space the tokenizer's decoder may put before it (vLLM's rule; docs/sampling.md)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI's formula)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated."""
    repetition_penalty: float = 1.0
    """Divides positive and multiplies negative logits of tokens in the prompt or the output (HF, CTRL)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling, in [-100, 100]."""
    logprobs: int | None = None
    """Return the logprob of each generated token and of the N most likely ones (0: the token's only; -1: the whole
    vocabulary, as vLLM's)."""
    prompt_logprobs: int | None = None
    """Return the logprob of each prompt token and of the N most likely ones there (-1: the whole vocabulary;
    disables prefix-cache reads)."""
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    """What `stream` yields: deltas, cumulative outputs, or each sample once at its end."""
    structured: StructuredOutputs | None = None
    """Constrain the output to a JSON schema, a regex, a choice list or a grammar, EBNF or Lark (needs xgrammar)."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated (every other logit is set to -inf)."""
    bad_words: list[str] = []
    """Words that may not be generated: a word's last token is forbidden where the output ends with its
    other tokens (each word tokenized as written and, by vLLM's rule, after a space; the engine fills
    bad_words_token_ids; None is [])."""
    bad_words_token_ids: list[list[int]] = []
    """Token sequences that may not be generated (as bad_words, in ids); filled from bad_words by the engine."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (left truncation; a text prompt is cut by the tokenizer, its special
    tokens kept, as vLLM's); -1 keeps as many as max_model_len allows. A pooling request's text prompt keeps its
    first k instead, cut by the tokenizer with its special tokens (vLLM's)."""
    detokenize: bool = True
    """False: the outputs carry token ids only (empty text, logprobs without ``decoded_token``), and the host
    spends no time decoding: for callers that only need ids (RL rollouts). Stop strings need the text."""
    logprobs_mode: str | None = None
    """What this request's ``logprobs`` hold, one of the engine's ``logprobs_mode`` values (None: the engine's;
    ``prompt_logprobs`` are log-softmaxed under every mode, as vLLM's): beam search asks for ``raw_logprobs`` whatever the engine's mode, to rank by them."""
    structured_outputs: Any = None
    """vLLM's name of `structured` (its StructuredOutputsParams as a dict or object: json, regex, choice, grammar,
    json_object); moved into `structured` at construction and by validate() (one set after construction)."""
    guided_decoding: Any = None
    """Older vLLM's name of `structured` (GuidedDecodingParams), read as `structured_outputs`."""

    def __post_init__(self) -> None:
        if self.seed == -1 and is_int(self.seed):  # vLLM's "no seed"
            self.seed = None
        for name in _NONE_IS_EMPTY:
            if getattr(self, name) is None:  # vLLM's default: no stop strings, no stop ids, no bad words
                setattr(self, name, [])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.output_kind, str) and self.output_kind.upper() in RequestOutputKind.__members__:
            self.output_kind = RequestOutputKind[self.output_kind.upper()]
        elif type(self.output_kind) is int and self.output_kind in iter(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.logit_bias, dict) and any(isinstance(k, str) for k in self.logit_bias):
            self.logit_bias = {_int_key(k): v for k, v in self.logit_bias.items()}  # JSON clients send str keys
        _take_structured_alias(self)
        if isinstance(self.structured, dict):
            self.structured = _structured_from_dict(self.structured)

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first bad field (numpy scalars taken as Python numbers first)."""
        self._plain_numbers()
        if self.seed == -1 and is_int(self.seed):  # np.int64(-1) too: vLLM's "no seed"
            self.seed = None
        if self.structured_outputs is not None or self.guided_decoding is not None:  # set after construction
            _take_structured_alias(self)
        _check_int("n", self.n, 1, 2**31 - 1)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p", "must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, -1, 2**31 - 1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, _MIN_SEED, _MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _check_int("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, 2**31 - 1,
                       f"must be -1 or in [1, {2**31 - 1}], got {self.truncate_prompt_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"{self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", "must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be a list of non-negative token ids")
        self.stop_token_ids = _distinct(self.stop_token_ids)  # a set: at most the vocabulary's size on the wire
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a bool, got {getattr(self, name)!r}")
        if not self.detokenize and self.stop:
            raise InvalidRequestError("stop", "stop strings are matched in the text: they need detokenize=True "
                                              "(stop_token_ids work without it)")
        self._validate_logits_params()
        self._validate_outputs()

    def _plain_numbers(self) -> None:
        """numpy's scalars (an ``np.linspace`` sweep's temperatures, ``np.int64`` seeds) as Python's int and float,
        as vLLM takes them: the wire encodes those only."""
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if numpy_number(value):
                setattr(self, name, value.item())
        if isinstance(self.logit_bias, dict) and any(map(numpy_number, [*self.logit_bias, *self.logit_bias.values()])):
            self.logit_bias = {(k.item() if numpy_number(k) else k): (v.item() if numpy_number(v) else v)
                               for k, v in self.logit_bias.items()}

    def _validate_logits_params(self) -> None:
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 1 / _REPETITION_PENALTY_BOUND,
                     _REPETITION_PENALTY_BOUND)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias", f"must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for token_id, bias in self.logit_bias.items():
                if not is_int(token_id) or token_id < 0:
                    raise InvalidRequestError("logit_bias", f"keys must be non-negative token ids, got {token_id!r}")
                _check_float("logit_bias", bias, -_MAX_LOGIT_BIAS, _MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise InvalidRequestError("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _distinct(self.allowed_token_ids)
        self._validate_bad_words()

    def _validate_bad_words(self) -> None:
        """Types, and vLLM's bounds on what a request may ban, checked before the host tokenizes a word: the
        tokenizer checks the sequences the words add (`asyncllm.tokenizer.bad_words_token_ids`)."""
        max_sequences, max_tokens = envs.MAX_NUM_BAD_WORDS.get(), envs.MAX_BAD_WORDS_TOTAL_TOKENS.get()
        words, sequences = self.bad_words, self.bad_words_token_ids
        if not isinstance(words, list) or len(words) > max_sequences or not all(
                isinstance(w, str) and w.strip() for w in words):
            raise InvalidRequestError("bad_words", f"must be a list of at most {max_sequences} non-blank strings "
                                                   f"(ASYNCLLM_MAX_NUM_BAD_WORDS)")
        if sum(len(w) for w in words) > max_tokens * _BAD_WORD_CHARS_PER_TOKEN:
            raise InvalidRequestError("bad_words", f"at most {max_tokens * _BAD_WORD_CHARS_PER_TOKEN} characters in "
                                                   f"all (ASYNCLLM_MAX_BAD_WORDS_TOTAL_TOKENS={max_tokens} tokens)")
        if not isinstance(sequences, list) or len(sequences) > max_sequences or not all(
                isinstance(ids, list) and ids for ids in sequences):
            raise InvalidRequestError("bad_words_token_ids", f"must be a list of at most {max_sequences} "
                                      f"(ASYNCLLM_MAX_NUM_BAD_WORDS) non-empty lists of token ids >= 0")
        total = sum(len(ids) for ids in sequences)
        if total > max_tokens:
            raise InvalidRequestError("bad_words_token_ids", f"at most {max_tokens} tokens in all "
                                                             f"(ASYNCLLM_MAX_BAD_WORDS_TOTAL_TOKENS), got {total}")
        if not all(is_int(t) and t >= 0 for ids in sequences for t in ids):
            raise InvalidRequestError("bad_words_token_ids", "must be a list of non-empty lists of token ids >= 0")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:  # -1: the whole vocabulary (vLLM's)
                _check_int(name, value, -1, _LOGPROBS_BOUND, f"must be in [0, {_LOGPROBS_BOUND}] or -1 (the whole "
                                                             f"vocabulary), got {value}")
        if self.logprobs_mode is not None:
            from asyncllm.config_model import LOGPROBS_MODES  # the engine field's values, not imported up front

            if self.logprobs_mode not in LOGPROBS_MODES:
                raise InvalidRequestError("logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)} or None "
                                                           f"(the engine's), got {self.logprobs_mode!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestError("output_kind", f"must be a RequestOutputKind or one of "
                                      f"{[k.lower() for k in RequestOutputKind.__members__]}, got {self.output_kind!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                raise InvalidRequestError("structured", f"must be a StructuredOutputs, got {type(self.structured).__name__}")
            self.structured.validate()
            if self.min_tokens:  # the grammar decides where the output ends; min_tokens would forbid that end
                raise InvalidRequestError("structured", "cannot be combined with min_tokens > 0")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `InvalidRequestError` if a token id in the parameters is not below `vocab_size`."""
        fields = {"logit_bias": list(self.logit_bias or ()), "allowed_token_ids": self.allowed_token_ids or [],
                  "bad_words_token_ids": [t for ids in self.bad_words_token_ids for t in ids],
                  "structured": self.structured.start_after_token_ids + self.structured.start_after_suffix_token_ids
                  + self.structured.start_after_opener_token_ids if isinstance(self.structured, StructuredOutputs)
                  else []}
        for name, token_ids in fields.items():
            bad = [t for t in token_ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(name, f"token ids must be < the vocabulary size {vocab_size}, got {bad[:5]}")

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` of an n > 1 request, sent to the core as its own request.

        Each sample has n=1 and a derived seed; only sample 0 computes prompt_logprobs.
        """
        seed = None if self.seed is None else sample_seed(self.seed, index)
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return msgspec.structs.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request: `seed` itself for sample 0, then unrelated seeds.

    A splitmix64 finaliser of (seed, index), so sample 1 of seed s does not
    repeat sample 0 of seed s + 1.
    """
    if index == 0:
        return seed
    x = ((seed ^ 0x5851F42D4C957F2D) + 0x9E3779B97F4A7C15 * index) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & _MAX_SEED


def _int_key(key: object) -> object:
    """A decimal str key as an int (JSON object keys are strings); anything else unchanged for validate()."""
    digits = key.strip().lstrip("-") if isinstance(key, str) else ""
    if digits.isascii() and digits.isdigit():  # (str.isdigit takes "¹", which int() refuses)
        return int(key)
    return key


_STRUCTURED_NAMES = ("structured", "structured_outputs", "guided_decoding")


def _take_structured_alias(params: SamplingParams) -> None:
    """vLLM's structured_outputs (older vLLM's guided_decoding) moved into `structured`; more than one of the three
    given is an InvalidRequestError naming the second."""
    given = [name for name in _STRUCTURED_NAMES if getattr(params, name) is not None]
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"{given[0]} is given too: structured_outputs (vLLM's) and guided_decoding "
                                  "(older vLLM's) are names of structured; give one of them")
    if given and given[0] != "structured":
        params.structured = from_vllm_structured(given[0], getattr(params, given[0]))
        setattr(params, given[0], None)


def from_vllm_structured(field: str, value: object) -> StructuredOutputs:
    """vLLM's StructuredOutputsParams (a dict or its dataclass) as ours: `SamplingParams`' structured_outputs and
    guided_decoding, the server's ``structured_outputs``. Unset fields (None; False but for a kind) and private
    (``_backend``) attributes are dropped, as vLLM ignores them; ``json_object`` true (or 1, as vLLM's pydantic reads
    it) is the schema ``{"type": "object"}`` (not with json); older vLLM's ``backend`` "auto" or "xgrammar" is
    dropped (asyncllm's one), another refused; `StructuredOutputs`' own fields (start_after, ...) are taken as
    given; another field set is an InvalidRequestError naming it.
    More than one kind is left for validate() to name."""
    if isinstance(value, StructuredOutputs):
        return value
    items = value if isinstance(value, dict) else _attributes(field, value)
    settings = {key: item for key, item in items.items() if item is not None and not str(key).startswith("_")
                and (item is not False or key in KINDS)}
    json_object = settings.pop("json_object", False)
    backend = settings.pop("backend", "auto")  # older vLLM's per-request choice: asyncllm's one is xgrammar
    if backend not in ("auto", "xgrammar"):
        raise InvalidRequestError(field, f"backend={backend!r}: asyncllm's structured outputs run on xgrammar alone "
                                  "(give 'xgrammar', 'auto' or none)")
    unknown = sorted(map(str, set(settings) - set(StructuredOutputs.__struct_fields__)))
    if unknown:
        raise InvalidRequestError(field, f"{', '.join(unknown)}: not built in asyncllm (it reads json, regex, choice, "
                                  "grammar and json_object, and asyncllm's own start_after)")
    if json_object not in (True, False):  # (1 and 0 too)
        raise InvalidRequestError(field, f"json_object must be true or false, got {json_object!r}")
    if json_object:
        if "json" in settings:
            raise InvalidRequestError(field, "set json or json_object, not both")
        settings["json"] = {"type": "object"}
    return StructuredOutputs(**settings)


def _attributes(field: str, value: object) -> dict:
    """An object's fields by name: its ``__dict__``, else its ``__slots__`` (a slots dataclass's too)."""
    if hasattr(value, "__dict__"):
        return vars(value)
    slots = [name for cls in type(value).__mro__ for name in _names(getattr(cls, "__slots__", ()))]
    if not slots:
        raise InvalidRequestError(field, "must be a dict or vLLM's StructuredOutputsParams (json, regex, choice, "
                                  f"grammar, json_object), got {type(value).__name__}")
    return {name: getattr(value, name, None) for name in slots}


def _names(slots: str | tuple[str, ...]) -> tuple[str, ...]:
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _structured_from_dict(value: dict) -> object:
    """`structured={"json": schema}` as a StructuredOutputs; unknown keys are left for validate() to name."""
    try:
        return StructuredOutputs(**value)
    except TypeError:
        return value


def _distinct(token_ids: list[int]) -> list[int]:
    """`token_ids` without repeats, in first-seen order (the same list when it has none)."""
    distinct = list(dict.fromkeys(token_ids))
    return token_ids if len(distinct) == len(token_ids) else distinct


def numpy_number(value: object) -> bool:
    """A numpy integer or floating scalar (not numpy's bool, named ``bool`` since numpy 2: a bool field takes
    Python's only)."""
    return type(value).__module__ == "numpy" and hasattr(value, "item") \
        and type(value).__name__ not in ("bool_", "bool") and isinstance(value.item(), (int, float))


def _check_int(field: str, value: object, lo: int, hi: int, why: str = "") -> None:
    if not is_int(value):
        raise InvalidRequestError(field, f"must be an int, got {value!r}")
    if not lo <= value <= hi:  # type: ignore[operator]
        raise InvalidRequestError(field, why or f"must be in [{lo}, {hi}], got {value}")


def _check_float(field: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(field, f"must be a number, got {value!r}")
    if isinstance(value, float) and math.isnan(value) or not lo <= value <= hi:  # (an int may not fit a float)
        raise InvalidRequestError(field, f"must be in [{lo}, {hi}], got {value}")
