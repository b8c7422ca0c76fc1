"""Completions' ``prompt_embeds`` (vLLM's, with ``--enable-prompt-embeds``): prompts given as embeddings.

Each entry is a base64 string of a ``torch.save``'d ``[tokens, hidden]`` (or ``[1, tokens, hidden]``) tensor
(vLLM's format: the OpenAI client sends it in ``extra_body``). It is read with ``torch.load(weights_only=True)``
(tensors only, never arbitrary objects) on a worker thread, sparse tensors under torch's invariant checks (vLLM's
fix of an out-of-bounds write in ``to_dense``; one load at a time, the checks' switch being process-wide) and no
larger once dense than the body could carry (``max_body_bytes``), and becomes the engine prompt ``{"prompt_embeds":
tensor}``, whose shape the engine checks, one rule for both (asyncllm/engine/prompt_embeds.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
from typing import Any

import anyio

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_protocol import CompletionRequest, ServerLimits

__all__ = ["completion_embeds_prompts"]

_FIELD = "prompt_embeds"
_SPARSE_CHECKS = threading.Lock()


async def completion_embeds_prompts(req: CompletionRequest, limits: ServerLimits) -> list[dict[str, Any]]:
    """The request's embeddings prompts; `InvalidRequestError` naming the field for what cannot be one."""
    for field, used in (("prompt", req.prompt is not None), ("echo", req.echo),
                        ("use_beam_search", req.use_beam_search)):
        if used:
            raise InvalidRequestError(field, "cannot be used with prompt_embeds")
    entries = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else req.prompt_embeds
    if not entries or len(entries) > limits.max_prompts:
        raise InvalidRequestError(_FIELD, f"1 to {limits.max_prompts} base64 tensors, got {len(entries or [])}")
    return [{"prompt_embeds": await anyio.to_thread.run_sync(_tensor, entry, limits.max_body_bytes)}
            for entry in entries]


def _tensor(entry: str, max_bytes: int) -> Any:
    import torch

    try:
        data = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(_FIELD, f"is not base64 ({exc})") from None
    with _SPARSE_CHECKS, torch.sparse.check_sparse_tensor_invariants():
        try:
            buffer = io.BytesIO(data)
            tensor = torch.load(buffer, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - any unreadable payload (or invalid sparse one) is the request's error
            raise InvalidRequestError(_FIELD, f"is not a torch.save'd tensor ({type(exc).__name__})") from None
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequestError(_FIELD, f"holds a {type(tensor).__name__}, not a tensor")
        if tensor.layout == torch.strided:
            return tensor
        dense = tensor.numel() * tensor.element_size()
        if dense > max_bytes:
            raise InvalidRequestError(_FIELD, f"is a sparse tensor of shape {tuple(tensor.shape)}: {dense} bytes once "
                                              f"dense, more than a request may carry ({max_bytes})")
        return tensor.to_dense()
