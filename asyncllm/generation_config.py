"""The model's ``generation_config.json``, read by one function for everyone who needs it
(`read_generation_config`): the default sampling parameters (asyncllm/engine/defaults.py), the EOS ids
(asyncllm/tokenizer.py), the generation rules (workers/generation_rules.py) and a Whisper checkpoint's task and
timestamp tokens (asyncllm/speech.py). The host reads it once when the engine starts, each worker once when it
loads the model.

The engine's ``generation_config`` field says which file (vLLM's ``--generation-config``): ``auto`` and ``vllm``
the model folder's (none for a GGUF file; for a folder without one, as vLLM, the generation attributes its
config.json sets, its ``eos_token_id`` say: `from_model_config`), a folder that folder's (it must hold one).
``vllm`` turns off only the file's default sampling parameters (asyncllm/engine/prepare.py): what the file says
about the model itself (its EOS ids, ``suppress_tokens``, Whisper's task and timestamp tokens) still applies.
Whether a Whisper checkpoint predicts timestamps is decided here too, once for the host and the workers
(`timestamp_rules`). Without torch.
"""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError

__all__ = ["SuppressedTokens", "TimestampRules", "from_model_config", "read_generation_config", "rule_keys_of",
           "sampling_fields_of", "source_of", "timestamp_rules"]

_NO_BOUND = 2**62
"""An upper bound past any vocabulary."""


def read_generation_config(generation_config: str, model_path: str, model_config: Any = None, *,
                           fallback: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The keys of the generation_config.json that ``generation_config`` names for the model at ``model_path`` ({}:
    none). An unreadable file is a `ConfigError` naming the field that chose it (``model`` for ``auto`` / ``vllm``).
    A model folder without the file: the generation attributes of its config (`model_config`, the loaded
    config.json; None: {}), as vLLM's ``try_get_generation_config`` and transformers' ``generate`` take them
    (`fallback`, by default `from_model_config`; a value transformers refuses is a `ConfigError` naming ``model``)."""
    if generation_config in _MODEL_FOLDER and os.path.isfile(model_path):  # a GGUF file has none
        return {}
    field, folder = source_of(generation_config, model_path)
    generation = _read(os.path.join(folder, "generation_config.json"), field, must_exist=field == "generation_config")
    if generation is None and model_config is not None:
        try:
            return (fallback or from_model_config)(model_config)
        except ValueError as exc:  # GenerationConfig's checks (max_new_tokens 0, say)
            raise ConfigError(field, folder, f"a checkpoint whose config.json (it has no generation_config.json) "
                                             f"sets generation attributes transformers accepts: {exc}") from exc
    return generation or {}


def from_model_config(model_config: Any) -> dict[str, Any]:
    """The generation attributes a model config (config.json, its decoder's too) sets to other than
    `GenerationConfig`'s defaults: transformers' ``GenerationConfig.from_model_config(config).to_diff_dict()``,
    what vLLM reads where a model has no generation_config.json (its ``eos_token_id``, say)."""
    from transformers import GenerationConfig

    if not hasattr(model_config, "get_text_config"):  # a worker's WireConfig: its values (transformers reads dicts)
        model_config = model_config.to_dict()
    generation = GenerationConfig.from_model_config(model_config).to_diff_dict()
    return {key: value for key, value in generation.items() if key not in _BOOKKEEPING}


_BOOKKEEPING = frozenset({"_from_model_config", "transformers_version"})
"""`to_diff_dict` keys that say where the config came from, not how to generate."""


def rule_keys_of(model_config: Any) -> dict[str, Any]:
    """`from_model_config`'s keys that the workers' rules read (workers/generation_rules.py), without transformers
    (its import costs a worker's start about 2 s): ``suppress_tokens`` and ``begin_suppress_tokens``, the config's
    own, else its decoder's (the first of ``decoder``, ``generator``, ``text_config`` it sets, as transformers reads a
    config's values). The other keys it keeps no rule reads, and it drops Whisper's timestamp keys (not
    `GenerationConfig` attributes): no timestamp rule comes from a config.json."""
    values = model_config.to_dict()
    decoder = next((values[name] for name in ("decoder", "generator", "text_config") if values.get(name)), values)
    found = {key: values.get(key) if values.get(key) is not None else decoder.get(key) for key in _RULE_KEYS}
    return {key: value for key, value in found.items() if value is not None}


_RULE_KEYS = ("suppress_tokens", "begin_suppress_tokens")


@dataclass(frozen=True)
class SuppressedTokens:
    """The ids the model's generation config never lets come (``suppress_tokens``) and never first
    (``begin_suppress_tokens``), those inside the vocabulary: the one reading of those keys (`of`), for beam search,
    which ranks the raw logprobs on the host, and for the workers' rules, which mask them
    (workers/generation_rules.py)."""

    always: frozenset[int] = frozenset()
    at_start: frozenset[int] = frozenset()
    vocab_size: int = 0

    @classmethod
    def of(cls, config: Mapping[str, Any], vocab_size: int, source: tuple[str, str]) -> "SuppressedTokens":
        """The keys' ids in ``config``, read as transformers' processors read them (a tensor of the list): an
        entry that is a whole number is an id, an integral float or a bool too (``1.0`` and ``true`` are id 1). A
        key unset, null or ``""`` suppresses nothing (transformers' processors read ``""`` as no ids); any other
        value that is not a list of such entries (a string, a null, a fraction or a nested list in it; a bare
        number: transformers' `GenerationConfig` refuses it, its processors fail on the others or, a fraction,
        ignore it) is a `ConfigError` on ``source`` (the field that chose the file and its folder: `source_of`)
        naming the key. Ids outside the vocabulary, negative ones too, are left out: transformers' masks give them
        no effect."""
        return cls(_ids(config, "suppress_tokens", vocab_size, source),
                   _ids(config, "begin_suppress_tokens", vocab_size, source), vocab_size)


def _ids(config: Mapping[str, Any], key: str, vocab_size: int, source: tuple[str, str]) -> frozenset[int]:
    value = config.get(key)
    if value is None or value == "":
        return frozenset()
    ids = [_id(entry) for entry in value] if isinstance(value, (list, tuple)) else [None]
    if None in ids:
        bad = f", whose entry {ids.index(None)} is {reprlib.repr(value[ids.index(None)])}" if len(ids) > 1 else ""
        raise ConfigError(*source, f"generation_config.json's {key}: a list of token ids (whole numbers; it is "
                                   f"{reprlib.repr(value)}{bad})")
    return frozenset(t for t in ids if 0 <= t < vocab_size)


def _id(entry: Any) -> int | None:
    """The token id a list entry is, as torch reads it: an int, a bool (true: 1) or an integral float; None: not
    one."""
    if isinstance(entry, int) or (isinstance(entry, float) and entry.is_integer()):
        return int(entry)
    return None


_MODEL_FOLDER = ("auto", "vllm")
"""The ``generation_config`` values that read the model folder's file."""


def sampling_fields_of(generation_config: str, generation: dict[str, Any]) -> dict[str, Any]:
    """The keys the default sampling parameters come from: ``generation``, none for ``vllm``."""
    return {} if generation_config == "vllm" else generation


def source_of(generation_config: str, model_path: str) -> tuple[str, str]:
    """(the field that chose the file, its folder): ``model`` for ``auto`` / ``vllm``, else ``generation_config``."""
    return ("model", model_path) if generation_config in _MODEL_FOLDER else ("generation_config", generation_config)


def _read(path: str, field: str, must_exist: bool) -> dict[str, Any] | None:
    """The file's keys; None: no file (unless it `must_exist`)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: the file itself given as the folder
        if must_exist:
            raise ConfigError(field, os.path.dirname(path), "'auto', 'vllm' or a folder holding a "
                                                            "generation_config.json") from None
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(field, path, f"a readable generation_config.json ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(field, path, "a generation_config.json holding a JSON object")
    return raw


@dataclass(frozen=True)
class TimestampRules:
    """Whisper's timestamp tokens (the ids after ``<|notimestamps|>``: ``<|0.00|>``, ``<|0.02|>``, ...) and the
    prompt endings after which they are predicted; `bounds` is what the workers' rules allow after an output
    (workers/generation_rules.py)."""

    no_timestamps_id: int
    eos_id: int
    max_initial: int | None
    """``max_initial_timestamp_index``: the first timestamp is at most ``timestamp_begin`` + this (None: any)."""
    prompt_ends: frozenset[int]
    """The task tokens (multilingual) or ``<|startoftranscript|>`` (English-only) that start timestamped output."""

    @property
    def timestamp_begin(self) -> int:
        """The id of ``<|0.00|>``."""
        return self.no_timestamps_id + 1

    def bounds(self, outputs: Sequence[int]) -> tuple[int, int, int]:
        """(ids below it forbidden, timestamps below it forbidden, ids from it forbidden) after ``outputs``."""
        begin = self.timestamp_begin
        if not outputs:
            top = _NO_BOUND if self.max_initial is None else begin + self.max_initial + 1
            return begin, begin, top
        last = outputs[-1] >= begin
        penultimate = len(outputs) < 2 or outputs[-2] >= begin
        text_below, top = 0, _NO_BOUND
        if last and penultimate:
            top = begin
        elif last:
            text_below = self.eos_id
        stamp = next((token for token in reversed(outputs) if token >= begin), None)
        low = begin if stamp is None else stamp if last and not penultimate else stamp + 1
        return text_below, low, top


def timestamp_rules(config: Mapping[str, Any], vocab_size: int) -> TimestampRules | None:
    """Whisper's timestamp rules, where the checkpoint has timestamp tokens (ids past ``no_timestamps_token_id``
    inside the model's ``vocab_size``), an EOS and the prompt endings that ask for them; else None (the host then
    refuses timestamped requests, the workers apply no timestamp rule)."""
    no_timestamps = config.get("no_timestamps_token_id")
    if not isinstance(no_timestamps, int) or no_timestamps + 1 >= vocab_size:
        return None
    eos = config.get("eos_token_id")
    eos = config.get("bos_token_id") if eos is None else eos
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if config.get("is_multilingual", True):
        ends = frozenset(int(t) for t in (config.get("task_to_id") or {}).values())
    else:
        ends = frozenset([int(config["decoder_start_token_id"])]) if "decoder_start_token_id" in config else frozenset()
    if not isinstance(eos, int) or not ends:
        return None
    return TimestampRules(no_timestamps, eos, config.get("max_initial_timestamp_index"), ends)
