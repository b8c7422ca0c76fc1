"""Finding a checkpoint folder: a local folder as is, a hub id through huggingface_hub's cache (without torch).

The hub is asked at most ``HF_HUB_ETAG_TIMEOUT`` seconds (`hub_unanswered`) before huggingface_hub's own lookup,
which waits without a bound: a network that drops packets makes a cached hub id load from the cache, with a
warning, instead of hanging.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shlex
import time
from typing import Any

from asyncllm import envs
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.mistral_format import uses_mistral_weights
from asyncllm.models.st_dense import dense_folders, dense_pickle_patterns

__all__ = ["resolve_model_path", "hub_unanswered", "index_names", "names_a_path", "safetensors_patterns"]

logger = logging.getLogger(__name__)

_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.model.v*", "*.tiktoken", "*.txt", "*.jinja"]
"""A snapshot's configs and tokenizer files (all a tokenizer's has; `resolve_model_path` adds weights and code)."""
_PATH_PREFIXES = ("/", ".", "~")
"""How a string that names a folder begins (a hub id never begins with one: huggingface_hub's check refuses it)."""
_UNANSWERED_FOR_S = 60.0
"""How long after a lookup the hub did not answer the next ones are not tried (a model's, then its tokenizer's)."""
_unanswered: dict[str, Any] = {"at": None, "why": ""}


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None,
                       weights: bool = True, load_format: str = "auto", trust_remote_code: bool = False) -> str:
    """A local folder as is; otherwise a hub id looked up through huggingface_hub (``weights`` False: its configs and
    tokenizer files only, a `tokenizer_revision`'s snapshot; ``load_format`` 'pt': its pickles, not its safetensors;
    'dummy': no weights at all, as with ``weights`` False;
    `trust_remote_code`: its ``*.py`` too, the configuration_*.py, tokenization_*.py its ``auto_map`` names).

    The hub is asked first unless HF_HUB_OFFLINE is set (read now, not at import); when it does not answer within
    HF_HUB_ETAG_TIMEOUT seconds (`hub_unanswered`), the cache (``download_dir``, else HF_HUB_CACHE) is read alone,
    with a warning. A string that looks like a path (`names_a_path`: ``/``, ``.``, ``~``) must be a folder. A ``.gguf``
    file must exist locally (asyncllm/models/gguf_config.py; vLLM's hub form ``repo:quant`` is a `NotBuiltError`).
    Anything else is a `ConfigError` saying what was tried.
    """
    if model.startswith("~"):
        model = os.path.expanduser(model)
    if os.path.isdir(model):
        return model
    if model.lower().endswith(".gguf"):
        if not os.path.isfile(model):
            raise ConfigError("model", model, "a local folder, a hub id, or a .gguf file that exists")
        return model
    if names_a_path(model):
        raise ConfigError("model", model, f"a local folder or a hub id: no such folder: {os.path.expanduser(model)}")
    if re.fullmatch(r"[\w.-]+/[\w.-]+:[\w.-]+", model):  # vLLM's "owner/repo:Q4_K_M"
        raise NotBuiltError("model", model, "a hub GGUF named as 'repo:quant' (download the .gguf file and pass "
                                            "its path)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE or envs.HF_HUB_OFFLINE.get()
    cache_dir = download_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    unreachable: str | None = None
    try:
        if not offline:
            unreachable = hub_unanswered(model, revision)
        hub: dict[str, Any] = dict(revision=revision, cache_dir=cache_dir,
                                   local_files_only=offline or unreachable is not None)
        files = [*_TOKENIZER_PATTERNS, *(["*.py"] if trust_remote_code else [])]
        path = snapshot_download(model, **hub, allow_patterns=files)  # configs and the weights' index first
        if not weights or load_format == "dummy":  # random weights: none downloaded (vLLM's "Nothing to download")
            return path
        if load_format == "pt":  # vLLM's *.pt, and pytorch_model*.bin (asyncllm/models/pt_checkpoint.py)
            return snapshot_download(model, **hub, allow_patterns=[*files, "*.bin", "*.pt"])
        tensors = safetensors_patterns(path, load_format)
        path = snapshot_download(model, **hub, allow_patterns=[*files, *tensors])
        if uses_mistral_weights(path, load_format):  # Mistral's safetensors or nothing: no pickles to fall back to
            return path
        if glob.glob(os.path.join(path, "*.safetensors")) or load_format == "safetensors":  # no pickle fallback
            pickles = dense_pickle_patterns(path)  # (with safetensors the loader names load_format)
        else:
            pickles = ["*.bin", "*.pt"]
        return path if not pickles else snapshot_download(  # no safetensors, or a Dense module's pickle only
            model, **hub, allow_patterns=[*files, *tensors, *pickles])
    except HFValidationError as exc:
        why = " ".join(str(exc).split())  # huggingface_hub's text runs over lines; the CLI prints one
        raise ConfigError("model", model, f"a local folder or a hub id: {model!r} is neither ({why})") from exc
    except LocalEntryNotFoundError as exc:
        why = ("offline mode is on (HF_HUB_OFFLINE=1); set HF_HUB_OFFLINE=0 or download it first" if offline
               else f"the hub could not be reached (network? {unreachable or exc}); download it first when online")
        at = "" if revision is None else f" at revision {revision!r}"
        raise ConfigError("model", model, f"a local folder or a hub id in the Hugging Face cache: it is not a folder, "
                                          f"not in the cache{at} ({cache_dir}), and {why} "
                                          f"(`{_download_command(model, revision, download_dir)}`)") from exc
    except OSError as exc:  # RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError, HTTP errors
        why = " ".join(str(exc).split())
        raise ConfigError("model", model, f"a hub id that can be downloaded ({type(exc).__name__}: {why})") from exc


def _download_command(model: str, revision: str | None, download_dir: str | None) -> str:
    """The command that puts ``model`` where `resolve_model_path` looks: at ``revision``, in ``download_dir``."""
    words = ["huggingface-cli", "download", model, *(["--revision", revision] if revision is not None else []),
             *(["--cache-dir", download_dir] if download_dir else [])]
    return shlex.join(words)


def safetensors_patterns(path: str, load_format: str = "auto") -> list[str]:
    """The safetensors a snapshot's weights are: those its ``model.safetensors.index.json`` names (and its
    sentence-transformers Dense modules'), not the repo's other copies (Mistral's ``consolidated.safetensors``,
    gpt-oss's ``original/``); every ``*.safetensors`` without an index; Mistral's own consolidated files where
    those are read (`uses_mistral_weights`)."""
    if uses_mistral_weights(path, load_format):
        return ["consolidated*.safetensors"]
    try:
        names = index_names(path, "model.safetensors.index.json")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a broken index: the loader names it
        names = None
    if names is None:
        return ["*.safetensors"]
    return [*map(glob.escape, names), *(f"{folder}/*.safetensors" for folder in dense_folders(path))]


def index_names(path: str, index_name: str) -> list[str] | None:
    """The file names a checkpoint's index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``)
    maps its weights to, each once; None without one; `ConfigError` naming the index when it is not such a map
    (broken JSON, no ``weight_map``)."""
    index_path = os.path.join(path, index_name)
    if not os.path.exists(index_path):
        return None
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # broken JSON, no weight_map, not a mapping
        raise ConfigError("model", index_path, f"a checkpoint index whose \"weight_map\" maps each weight to its "
                                               f"file ({type(exc).__name__}: {exc}; download it again)") from exc
    if not all(isinstance(name, str) and name for name in names):
        raise ConfigError("model", index_path, "a checkpoint index whose \"weight_map\" maps each weight to its "
                                               "file name")
    return names


def names_a_path(model: str) -> bool:
    """Whether `model` names a local path, never a hub id: it begins with ``/``, ``.`` or ``~`` (the served model's
    rule and `update_weights`' alike)."""
    return model.startswith(_PATH_PREFIXES)


def hub_unanswered(model: str, revision: str | None) -> str | None:
    """None when the hub answers a lookup of ``model`` within HF_HUB_ETAG_TIMEOUT seconds (any answer: a missing
    repo is huggingface_hub's own error, raised by its download); otherwise why not, after a warning that the cache
    is read instead (huggingface_hub's own lookup waits without a bound when the network drops packets). The hub is
not asked again for a minute after it did not answer."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError

    timeout = envs.HF_HUB_ETAG_TIMEOUT.get()
    if _unanswered["at"] is not None and time.monotonic() - _unanswered["at"] < _UNANSWERED_FOR_S:
        return _unanswered["why"]
    try:
        HfApi().repo_info(model, revision=revision, timeout=timeout)
        return None
    except HFValidationError:
        raise
    except Exception as exc:  # the HTTP library's connection errors and timeouts (requests' or httpx's)
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is not None and status < 500:  # the hub answered (not found, gated, ...)
            return None
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    _unanswered.update(at=time.monotonic(), why=why)
    logger.warning("the Hugging Face hub did not answer a lookup of %s within %gs (HF_HUB_ETAG_TIMEOUT; %s): reading "
                   "it from the cache only (HF_HUB_OFFLINE=1 skips the lookup)", model, timeout, why)
    return why
