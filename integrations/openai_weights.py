"""SGLang's development route ``POST /update_weights_from_disk`` (with ASYNCLLM_SERVER_DEV_MODE=1).

The body ``{"model_path": ..., "revision": ...}`` runs `AsyncEngine.update_weights` (docs/weight-updates.md).
The answer is SGLang's: ``{"success": true, "message": ..., "weights_version": N}``, or a 400 whose body has
``"success": false`` and the message next to the usual OpenAI error object, for a checkpoint that does not fit
(`InvalidRequestError`) or a model that cannot be updated (`NotBuiltError`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.integrations.errors import error_body

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine

__all__ = ["UpdateWeightsFromDiskRequest", "update_weights_from_disk"]


class UpdateWeightsFromDiskRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's ``update_weights_from_disk`` body (the fields asyncllm takes; others are refused by name)."""

    model_path: str
    """A checkpoint folder or hub id of the served model's architecture and shapes."""
    revision: str | None = None
    """Hub revision of `model_path`."""


async def update_weights_from_disk(engine: "AsyncEngine", body: UpdateWeightsFromDiskRequest) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of one update."""
    try:
        version = await engine.update_weights(body.model_path, revision=body.revision)
    except (InvalidRequestError, NotBuiltError) as exc:
        _, error, _ = error_body(exc)
        return 400, {"success": False, "message": str(exc), **error}
    return 200, {"success": True, "message": f"weights updated from {body.model_path} (version {version})",
                 "weights_version": version}
