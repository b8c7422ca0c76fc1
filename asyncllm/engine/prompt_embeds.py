"""Prompts given as embeddings (vLLM's ``enable_prompt_embeds``): ``{"prompt_embeds": tensor}``, the host side.

The tensor (``[tokens, hidden]``, or ``[1, tokens, hidden]`` as transformers' ``inputs_embeds``; float32 / bfloat16
/ float16, what the model's input embedding layer would return for a prompt: transformers'
``get_input_embeddings()(ids)``; dense, on any device) travels to the workers as raw bytes
(`protocol.PromptEmbeds`; workers/prompt_embeds.py scales them where the model's forward scales
``inputs_embeds``, Granite's ``embedding_multiplier``); the scheduler sees one placeholder token (id 0) per row,
so chunked prefill, preemption and budgets work as for token prompts. Two prompts share prefix-cache blocks only
when their embeddings are byte-identical: a digest of them salts the first block's hash. What would read the
placeholders as tokens is refused by name: ``repetition_penalty`` (it counts the prompt's tokens) and
``prompt_logprobs``; so are the models whose per-layer inputs are looked up by token id, at start.
"""

from __future__ import annotations

import hashlib
from typing import Any

from asyncllm import protocol
from asyncllm.engine.validation import truncated_prompt
from asyncllm.errors import InvalidRequestError, check_context_length
from asyncllm.sampling import SamplingParams

__all__ = ["PLACEHOLDER_TOKEN_ID", "prompt_embeds_of", "embeds_salt"]

PLACEHOLDER_TOKEN_ID = 0
"""The scheduler's token id for each embedded row (never looked up: the workers use the row)."""
_DTYPES = ("float32", "bfloat16", "float16")
_FIELD = "prompt.prompt_embeds"


def prompt_embeds_of(prompt: dict[str, Any], hidden_size: int | None, params: SamplingParams,
                     max_model_len: int, pooling_operation: str | None = None) -> protocol.PromptEmbeds:
    """The dict prompt's embeddings, checked, as sent to the core; `InvalidRequestError` naming what is wrong (rows
    past the context: `check_context_length`'s, with its code; `pooling_operation` as there)."""
    import torch

    if hidden_size is None:
        raise InvalidRequestError(_FIELD, "prompts given as embeddings need an engine started with "
                                          "enable_prompt_embeds=True")
    if set(prompt) != {"prompt_embeds"}:
        raise InvalidRequestError("prompt", f"an embeddings prompt is {{'prompt_embeds': tensor}} alone, got keys "
                                            f"{sorted(prompt)}")
    embeds = _rows(prompt["prompt_embeds"], hidden_size)
    if str(embeds.dtype).removeprefix("torch.") not in _DTYPES:
        raise InvalidRequestError(_FIELD, f"float32, bfloat16 or float16, got {embeds.dtype}")
    for field, used in (("repetition_penalty", params.repetition_penalty != 1.0),
                        ("prompt_logprobs", params.prompt_logprobs is not None)):
        if used:
            raise InvalidRequestError(field, "reads the prompt's token ids, and a prompt given as embeddings has none")
    if params.truncate_prompt_tokens is not None:  # as a token prompt's: the last rows
        keep = len(truncated_prompt(list(range(embeds.shape[0])), params.truncate_prompt_tokens, max_model_len,
                                    pooling=pooling_operation is not None))
        embeds = embeds[embeds.shape[0] - keep:]
    if embeds.shape[0] == 0:
        raise InvalidRequestError(_FIELD, "has no rows: a prompt has at least one token")
    check_context_length(max_model_len, embeds.shape[0], operation=pooling_operation, field=_FIELD)
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise InvalidRequestError(_FIELD, "holds NaN or infinite values")
    data = embeds.view(torch.uint8).numpy().tobytes()
    return protocol.PromptEmbeds(data, list(embeds.shape), str(embeds.dtype).removeprefix("torch."))


def embeds_salt(cache_salt: str | None, embeds: protocol.PromptEmbeds) -> str:
    """The request's cache salt with the embeddings' digest: equal embeddings (and salts) share cached blocks. The
    core tags it (`Request.cache_salt`), so it never keys a token prompt's blocks; no salt and "" differ."""
    digest = hashlib.sha256(embeds.data).hexdigest()[:32]
    return f"{embeds.dtype}:{digest}" + ("" if cache_salt is None else f":{cache_salt}")


def _rows(embeds: Any, hidden_size: int) -> Any:
    """The prompt's tensor as ``[tokens, hidden_size]``: a leading batch of one (``[1, tokens, hidden_size]``,
    transformers' ``inputs_embeds``) squeezed, as vLLM's; the OpenAI server's tensors are checked here too."""
    import torch

    expected = f"a torch.Tensor [tokens, {hidden_size}] (the model's hidden size) or [1, tokens, {hidden_size}]"
    if not isinstance(embeds, torch.Tensor):
        raise InvalidRequestError(_FIELD, f"{expected}, got {_described(embeds)}")
    if embeds.is_nested:  # strided or jagged: no shape to check (torch raises reading it)
        raise InvalidRequestError(_FIELD, "a dense tensor, got a nested one (one prompt per tensor: a batch's prompts "
                                          "are separate prompts)")
    if embeds.layout != torch.strided:
        raise InvalidRequestError(_FIELD, f"a dense tensor, got a {str(embeds.layout).removeprefix('torch.')} one "
                                          f"(sparse tensors are not accepted: .to_dense() it)")
    if embeds.is_meta:
        raise InvalidRequestError(_FIELD, "a tensor holding its values, got a meta tensor (it has none)")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        batch = " (one prompt per tensor: a batch's prompts are separate prompts)" if embeds.dim() == 3 else ""
        raise InvalidRequestError(_FIELD, f"{expected}, got {_described(embeds)}{batch}")
    return embeds


def _described(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else type(value).__name__
