"""Pushed tensors the loader skips in a checkpoint (docs/weight-updates.md, "tensors the loader skips"): a tied
``lm_head.weight`` and rotary ``inv_freq`` buffers, checked before an `update_weights_from_tensors` loads.

A tied head is the embedding (transformers writes a tied ``lm_head.weight`` into the shared parameter), so a pushed
one is written into ``model.embed_tokens.weight``; pushed with the embedding, the two must be equal. An
``inv_freq`` changes nothing (the rotary tables come from config.json, as vLLM skips them too): accepted if it has
the served model's shape, refused otherwise.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from asyncllm import protocol
from asyncllm.engine.weight_tensors import FIELD, tensor_views
from asyncllm.errors import InvalidRequestError
from asyncllm.models.registry import text_config_of
from asyncllm.models.rotary import RotaryEmbedding

__all__ = ["as_loaded", "check_tied_head_equal"]

TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def as_loaded(meta_model: Any, hf_config: Any, tensors: list[protocol.WeightTensor]) -> list[protocol.WeightTensor]:
    """``tensors`` as the served model's loader is to read them (``meta_model``: it built on the meta device): a
    tied head pushed alone renamed to the embedding's name, pushed with it left out (`check_tied_head_equal`
    compares them); `InvalidRequestError` naming ``named_tensors`` for a skipped tensor of another shape than the
    served model's."""
    _check_inv_freq(meta_model, tensors)
    by_name = {t.name: t for t in tensors}
    head = by_name.get(TIED_HEAD)
    if head is None or not _ties_head(meta_model):
        return tensors
    config = text_config_of(hf_config)
    expected = [int(config.vocab_size), int(config.hidden_size)]
    if list(head.shape) != expected:
        raise InvalidRequestError(FIELD, f"{TIED_HEAD!r} of the tied embedding's shape {expected} (the served model "
                                         f"ties its LM head to its embedding), got {list(head.shape)}")
    if not _reads_embedding(meta_model, expected):  # its checkpoints name it otherwise: skipped, as in files
        return tensors
    if EMBEDDING in by_name:
        return [t for t in tensors if t.name != TIED_HEAD]
    return [msgspec.structs.replace(t, name=EMBEDDING) if t is head else t for t in tensors]


def check_tied_head_equal(buf: Any, pushed: list[protocol.WeightTensor], loaded: list[protocol.WeightTensor]) -> None:
    """A tied head pushed with the embedding (left out of ``loaded``) must hold the same values: one parameter
    cannot take both."""
    pair = [t for t in pushed if t.name in (TIED_HEAD, EMBEDDING)]
    if len(pair) < 2 or any(t.name == TIED_HEAD for t in loaded):
        return
    head, embedding = tensor_views(buf, pair)
    if head.shape != embedding.shape or not torch.equal(head, embedding.to(head.dtype)):
        raise InvalidRequestError(FIELD, f"{TIED_HEAD!r} equal to {EMBEDDING!r} (the served model ties them: one "
                                         "parameter), got different tensors: push one of them")


def _ties_head(model: Any) -> bool:
    """Whether ``model``'s loader skips a checkpoint's ``lm_head.weight`` for its embedding (`LlamaWeights`)."""
    tied = getattr(model, "tie_word_embeddings", False) and getattr(model, "has_lm_head", False)
    return bool(tied) and EMBEDDING in dict(model.named_parameters())


def _reads_embedding(meta_model: Any, shape: list[int]) -> bool:
    """Whether the loader takes the embedding as ``model.embed_tokens.weight`` (GPT-2's takes ``transformer.wte``)."""
    try:
        meta_model.load_weights([(EMBEDDING, torch.empty(shape, device="meta"))])
    except Exception:  # noqa: BLE001 - an unexpected name: the loader's own error
        return False
    return True


def _check_inv_freq(model: Any, tensors: list[protocol.WeightTensor]) -> None:
    shapes = {(module.rotary_dim // 2,) for module in model.modules() if isinstance(module, RotaryEmbedding)}
    refused = [f"{t.name!r} of shape {list(t.shape)}" for t in tensors
               if t.name.endswith("rotary_emb.inv_freq") and tuple(t.shape) not in shapes]
    if refused:
        served = " or ".join(str(list(shape)) for shape in sorted(shapes)) or "none: it has no rotary embedding"
        raise InvalidRequestError(FIELD, f"rotary inv_freq buffers of the served model's shape ({served}; ignored: "
                                         f"its rotary tables come from config.json), got {', '.join(refused)}")
