"""Pushed tensors the loader skips in a checkpoint (docs/weight-updates.md, "tensors the loader skips"): a tied
``lm_head.weight`` and rotary ``inv_freq`` buffers, checked before an `update_weights_from_tensors` loads.

A tied head is the embedding (transformers writes a tied ``lm_head.weight`` into the shared parameter), so a pushed
one is written into the parameter the served model's LM head shares (found by identity in the module tree: an
image-text model's is its decoder's), of that parameter's shape (OPT's ``word_embed_proj_dim`` wide); pushed with
the embedding, the two must be equal. An ``inv_freq`` changes nothing (the rotary tables come from config.json, as
vLLM skips them too): accepted if it has the served model's shape, refused otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import torch
from torch import nn

from asyncllm import protocol
from asyncllm.engine.weight_tensors import FIELD, tensor_views
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.models.rotary import RotaryEmbedding

__all__ = ["TiedPair", "as_loaded", "check_tied_head_equal"]

TIED_HEAD = "lm_head.weight"

TiedPair = tuple[protocol.WeightTensor, protocol.WeightTensor]
"""A pushed tied head and the pushed embedding it is tied to."""


class _Tied(NamedTuple):
    param: nn.Parameter
    shape: list[int]
    """The whole tensor's (each rank holds a slice of its rows: `VocabParallelEmbedding`)."""
    names: list[str]
    """The embedding's names: in the module tree (``language_model.model.embed_tokens.weight``) and checkpoints'
    (the model's ``embedding_checkpoint_name`` last, where its loader takes no module-tree name: GPT-2's)."""
    head_names: set[str]
    """What a pushed head is named: ``lm_head.weight`` (every layout's) and its name in the module tree."""


def as_loaded(meta_model: Any, tensors: list[protocol.WeightTensor]
              ) -> tuple[list[protocol.WeightTensor], TiedPair | None]:
    """``tensors`` as the served model's loader is to read them (``meta_model``: it built on the meta device): a
    tied head pushed alone renamed to the embedding's name, pushed with it left out and returned with it (the pair
    `check_tied_head_equal` compares); `InvalidRequestError` naming ``named_tensors`` for a skipped tensor of another
    shape than the served model's, or a tied head its loader cannot write."""
    _check_inv_freq(meta_model, tensors)
    tied = _tied_embedding(meta_model)
    head = next((t for t in tensors if tied is not None and t.name in tied.head_names), None)
    if head is None or tied is None:
        return tensors, None
    expected = tied.shape
    if list(head.shape) != expected:
        raise InvalidRequestError(FIELD, f"{head.name!r} of the tied embedding's shape {expected} (the served model "
                                         f"ties its LM head to its embedding), got {list(head.shape)}")
    others = [t for t in tensors if t is not head]
    embedding = next((t for t in others if list(t.shape) == expected and _loads_into(meta_model, tied, t.name)), None)
    if embedding is not None:
        return others, (head, embedding)
    name = next((name for name in tied.names if _loads_into(meta_model, tied, name)), None)
    if name is None:
        raise InvalidRequestError(FIELD, f"the embedding under its checkpoint's name, not {head.name!r} alone: the "
                                         f"served model ties its LM head to its embedding ({tied.names[0]!r}), "
                                         "which its loader takes under no name this check knows")
    return [msgspec.structs.replace(t, name=name) if t is head else t for t in tensors], None


def check_tied_head_equal(buf: Any, pair: TiedPair | None) -> None:
    """A tied head pushed with the embedding (`as_loaded`'s pair) must hold the same values: one parameter cannot
    take both. Both are read in full: two ``[vocab, hidden]`` tensors compared."""
    if pair is None:
        return
    head, embedding = tensor_views(buf, list(pair))
    if not torch.equal(head, embedding.to(head.dtype)):
        raise InvalidRequestError(FIELD, f"{pair[0].name!r} equal to {pair[1].name!r} (the served model ties them: "
                                         "one parameter), got different tensors: push one of them")


def _tied_embedding(model: nn.Module) -> _Tied | None:
    """The parameter ``model``'s LM head shares with its embedding, if it has one; on a pipeline stage that holds
    the embedding but no head (the first of a tied model's: its loader writes a pushed head into the embedding, as
    the last stage's does into its own copy), the embedding; a middle stage holds neither (its loader skips it)."""
    heads = [module for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] == "lm_head" and isinstance(getattr(module, "weight", None), nn.Parameter)]
    if not heads:
        return _first_stage_embedding(model)
    for module in heads:
        tied = _tied_to(model, module)
        if tied is not None:
            return tied
    return None


def _first_stage_embedding(model: nn.Module) -> _Tied | None:
    for module in model.modules():
        embed = getattr(getattr(module, "model", None), "embed_tokens", None)
        if getattr(module, "tie_word_embeddings", False) and isinstance(getattr(embed, "weight", None), nn.Parameter):
            return _tied_to(model, embed)
    return None


def _tied_to(model: nn.Module, module: nn.Module) -> _Tied | None:
    """``module``'s weight as the tied parameter, if it is registered under a name other than the head's."""
    weight = module.weight
    names = [name for name, param in model.named_parameters(remove_duplicate=False) if param is weight]
    own = [name for name in names if not name.endswith(TIED_HEAD)]
    if not own:
        return None
    shape = [getattr(module, "vocab_size", weight.shape[0]), *weight.shape[1:]]
    checkpoint_names = [ckpt for name in own for ckpt in _checkpoint_names(name)]
    declared = getattr(model, "embedding_checkpoint_name", None)  # GPT-2's transformer.wte.weight, BLOOM's
    if declared:
        checkpoint_names.append(declared)
    return _Tied(weight, shape, checkpoint_names, {TIED_HEAD, *(name for name in names if name.endswith(TIED_HEAD))})


def _checkpoint_names(name: str) -> list[str]:
    """What checkpoints may call the parameter ``name`` (the loader says which it takes): an image-text model's
    decoder's under both layouts (transformers 5's ``model.language_model.*``, the original ``language_model.model.*``
    or, Qwen2-VL's, the bare decoder's ``model.*``)."""
    decoder = name.removeprefix("language_model.")
    if decoder == name:
        return [name]
    return [name, "model.language_model." + decoder.removeprefix("model."), decoder]


def _loads_into(model: Any, tied: _Tied, name: str) -> bool:
    """Whether ``model``'s loader writes a tensor named ``name`` into the tied parameter: a probe over a meta tensor,
    the parameter's ``weight_loader`` replaced by one that records the call. A name the loader does not take
    (its `ConfigError`) is not; any other error of the loader's refuses ``name``."""
    param, written = tied.param, []
    saved = param.__dict__.get("weight_loader")
    param.weight_loader = lambda target, *_: written.append(target is param)  # type: ignore[attr-defined]
    try:
        model.load_weights([(name, torch.empty(tied.shape, device="meta"))])
    except ConfigError:
        pass
    except Exception as exc:  # noqa: BLE001 - a loader that cannot take the tensor at all: refused, no worker stops
        raise InvalidRequestError(FIELD, f"weights the served model's loader takes; {name!r} failed in it "
                                         f"({type(exc).__name__}: {exc})") from exc
    finally:
        if saved is None:
            del param.weight_loader
        else:
            param.weight_loader = saved  # type: ignore[attr-defined]
    return any(written)


def _check_inv_freq(model: Any, tensors: list[protocol.WeightTensor]) -> None:
    shapes = {(module.rotary_dim // 2,) for module in model.modules() if isinstance(module, RotaryEmbedding)}
    refused = [f"{t.name!r} of shape {list(t.shape)}" for t in tensors
               if t.name.endswith("rotary_emb.inv_freq") and tuple(t.shape) not in shapes]
    if refused:
        served = " or ".join(str(list(shape)) for shape in sorted(shapes)) or "none: it has no rotary embedding"
        raise InvalidRequestError(FIELD, f"rotary inv_freq buffers of the served model's shape ({served}; ignored: "
                                         f"its rotary tables come from config.json), got {', '.join(refused)}")
