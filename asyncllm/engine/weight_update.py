"""Live weight updates, the torch-free half (docs/weight-updates.md): errors on the wire, the host's pending updates.

A refused update (`InvalidRequestError` naming ``model_path``, or `NotBuiltError`) travels from a worker rank to
the core and from the core to the host as a `protocol.WeightsUpdated` with ``error_type`` set; `weights_error`
rebuilds the typed error on the other side. The processor thread keeps one future per update it sent
(`PendingWeightUpdates`), resolved by the core's answer or failed when the core dies.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import uuid
from typing import Any

from asyncllm import errors, protocol
from asyncllm.models.checkpoint import hf_config_json, load_hf_config, resolve_model_path
from asyncllm.models.hub import names_a_path

__all__ = ["OTHER_RANK_REFUSED", "PendingWeightUpdates", "new_checkpoint_config", "read_update_config",
           "resolve_update_path", "weights_error", "weights_error_reply"]

OTHER_RANK_REFUSED = "another tensor-parallel rank refused it"
"""The error of a rank whose own check passed (the core answers with the refusing rank's reason instead)."""


def resolve_update_path(model_path: str, revision: str | None, download_dir: str | None = None) -> str:
    """The new checkpoint's folder (a hub id downloaded to or found in the cache: ``download_dir``, the engine's);
    `InvalidRequestError` if none, or if a ``revision`` is given with a local folder."""
    if model_path.lower().endswith(".gguf"):
        raise errors.NotBuiltError("model_path", model_path, "update_weights from a GGUF file")
    folder = os.path.expanduser(model_path)
    meant_as_folder = names_a_path(model_path)  # no hub lookup
    if meant_as_folder and not os.path.isdir(folder):
        raise errors.InvalidRequestError("model_path", f"{model_path!r} is not a folder (a checkpoint folder "
                                                       "or hub id)")
    if revision is not None and os.path.isdir(folder):  # as the served model's (asyncllm/engine/prepare.py)
        raise errors.InvalidRequestError("revision", f"is {revision!r}, but {model_path!r} is a local folder, which "
                                                     "has no revisions: pass None")
    if meant_as_folder:
        return folder
    try:
        return resolve_model_path(model_path, revision, download_dir)
    except errors.ConfigError as exc:
        raise errors.InvalidRequestError("model_path", f"{model_path!r} cannot be found: {exc.allowed}") from exc


def read_update_config(path: str) -> str:
    """The folder's config.json, read by its architecture's class and written as `hf_config_json` (every default
    filled in, as the workers got the served model's)."""
    try:
        return hf_config_json(load_hf_config(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError...: all mean unreadable
        raise errors.InvalidRequestError("model_path", f"{path} has no readable config.json "
                                                       f"({type(exc).__name__}: {exc})") from exc


def new_checkpoint_config(model_path: str, revision: str | None, download_dir: str | None = None) -> str:
    """On the host (off the loop): the new checkpoint's config for the workers, so that they need not import its
    config class (seconds in transformers 5). Empty when the host cannot read it: an attached host may not see
    the core's disk (`AsyncEngine.connect` over tcp://), so the workers read it and give the refusal."""
    try:
        return read_update_config(resolve_update_path(model_path, revision, download_dir))
    except (errors.InvalidRequestError, errors.NotBuiltError):
        return ""


def weights_error_reply(update_id: str, exc: errors.InvalidRequestError | errors.NotBuiltError,
                        rank: int = 0) -> protocol.WeightsUpdated:
    """The `WeightsUpdated` that carries a refused update's error."""
    return protocol.WeightsUpdated(update_id, rank=rank, **protocol.call_error_fields(exc))


def weights_error(reply: protocol.WeightsUpdated) -> errors.AsyncLLMError | None:
    """The typed error of a refused update; None when it succeeded."""
    return protocol.call_error(reply, "model_path")


class PendingWeightUpdates:
    """The processor thread's updates sent to the core and not answered yet (the loop's thread adds them, the
    processor thread resolves them)."""

    def __init__(self) -> None:
        self._futures: dict[str, concurrent.futures.Future[int]] = {}
        self._lock = threading.Lock()
        self._closed: BaseException | None = None
        """Why no answer will ever come (`close`): a call made after gets it at once."""

    def new(self) -> tuple[str, concurrent.futures.Future[int]]:
        """A fresh update id and the future of its weights version."""
        update_id = uuid.uuid4().hex
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            closed = self._closed
            if closed is None:
                self._futures[update_id] = future
        if closed is not None:  # the processor thread ended: nobody would send it, nor resolve it
            future.set_exception(closed)
        return update_id, future

    def resolve(self, reply: Any) -> None:
        """The core's answer: the call's result (here the new weights version), or the typed error."""
        with self._lock:
            future = self._futures.pop(self._call_id(reply), None)
        if future is None or future.done():
            return
        error = self._error(reply)
        if error is None:
            future.set_result(self._result(reply))
        else:
            future.set_exception(error)

    # what a subclass for another call's reply overrides (asyncllm/engine/sleep.py)
    @staticmethod
    def _call_id(reply: protocol.WeightsUpdated) -> str:
        return reply.update_id

    @staticmethod
    def _error(reply: protocol.WeightsUpdated) -> errors.AsyncLLMError | None:
        return weights_error(reply)

    @staticmethod
    def _result(reply: protocol.WeightsUpdated) -> int:
        return reply.weights_version

    def close(self, error: BaseException) -> None:
        """The processor thread ends: the calls pending and every later one fail with `error`."""
        with self._lock:
            self._closed = error
        self.fail_all(error)

    def fail_all(self, error: BaseException) -> None:
        """The core is gone (or the engine closes): no answer will come."""
        with self._lock:
            futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error)
