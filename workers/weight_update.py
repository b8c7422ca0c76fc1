"""Live weight updates on one worker rank (docs/weight-updates.md).

Two phases, so that tensor-parallel ranks never end up with different weights:

1. Check, touching no parameter: the served model is one we can update, the new folder resolves, its
   config.json has the served architecture and shapes, and the model's own loader accepts every tensor
   (names, this rank's shard shapes, nothing missing) on a copy of the model built on the meta device,
   from the safetensors headers only.
2. Every rank (every pipeline stage's too) tells the others whether its check passed (one all-reduce). Only if all passed does each
   rank copy the weights in place (``param.data.copy_`` through the model's `load_weights`), so CUDA
   graphs captured over the parameters stay valid and no second copy of the model is allocated.

A failure in phase 2 (a file that became unreadable half-way, a device fault) is not an error reply: the
worker dies with a `WorkerError`, the core restarts its workers from the last weights that loaded whole
(workers/restart.py), so no rank is left half updated.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from safetensors import SafetensorError

from asyncllm import protocol
from asyncllm.engine.weight_update import (
    OTHER_RANK_REFUSED,
    read_update_config,
    resolve_update_path,
    weights_error_reply,
)
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.models.checkpoint import checkpoint_quantization, hf_config_from_json, hf_config_json
from asyncllm.models.layers import LoadedWeight, weight_shape
from asyncllm.models.loader import build_model, load_checkpoint
from asyncllm.models.registry import text_config_of
from asyncllm.workers.mm_runner import is_multimodal

__all__ = ["update_weights", "check_update", "refuse_unbuilt", "SHAPE_KEYS"]

SHAPE_KEYS = (
    "architectures", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "num_local_experts", "num_experts", "num_experts_per_tok", "tie_word_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "sliding_window", "quantization_config",
)
"""config.json keys that must equal the served model's: the engine keeps the model it built (its shapes, rotary
tables, norms), so only weights may change."""


def update_weights(runner: Any, command: protocol.UpdateWeights, rank: int | None = None) -> protocol.WeightsUpdated:
    """Check, agree with the other ranks, copy; the reply for the core (an error reply changed nothing), from
    ``rank`` (the worker's rank in the engine; default the runner's, which is its TP rank within a stage)."""
    rank = runner.rank if rank is None else rank
    try:
        path = check_update(runner, command.model_path, command.revision, command.hf_config_json)
        error: InvalidRequestError | NotBuiltError | None = None
    except (InvalidRequestError, NotBuiltError) as exc:
        error = exc
    if not _all_ranks_passed(error is None, runner.device):
        error = error or InvalidRequestError("model_path", OTHER_RANK_REFUSED)
        return weights_error_reply(command.update_id, error, rank)
    # in place: every loader copies into .data; a pipeline stage's model loads its own parts' tensors only
    load_checkpoint(getattr(runner.model, "causal_lm", runner.model), path, runner.config.kv_cache_dtype)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)  # the host-to-device copies are done before the next step reads
    return protocol.WeightsUpdated(command.update_id, rank=rank)


def check_update(runner: Any, model_path: str, revision: str | None, config_json: str = "") -> str:
    """The new checkpoint's folder, once everything but reading its tensors' data has been checked (its config
    as the host read it: `config_json`; empty: read here, which imports the architecture's config class)."""
    refuse_unbuilt(runner)
    path = resolve_update_path(model_path, revision)
    _check_config(runner.hf_config, hf_config_from_json(config_json or read_update_config(path)))
    headers = _HeadersOnly()
    try:
        load_checkpoint(_meta_model(runner), path, runner.config.kv_cache_dtype, weights_filter=headers)
    except (OSError, SafetensorError) as exc:  # a file that is not safetensors, a cut one
        raise InvalidRequestError("model_path", f"{path} could not be read ({type(exc).__name__}: {exc})") from exc
    except (ConfigError, ValueError, RuntimeError) as exc:  # names missing or unexpected, a shape (narrow or copy)
        where = f" (at {headers.last})" if headers.last is not None and not isinstance(exc, ConfigError) else ""
        raise InvalidRequestError("model_path", f"{path} does not fit the served model{where}: {exc}") from exc
    return path


def refuse_unbuilt(runner: Any, feature: str = "update_weights") -> None:
    """What the in-place copy (and sleep mode's moves, `feature` "sleep mode") does not cover: weights transformed
    after loading, a vision tower."""
    config = runner.config
    if config.quantization is not None:
        raise NotBuiltError("quantization", config.quantization, f"{feature} of a quantized model")
    method = checkpoint_quantization(runner.hf_config)
    if method is not None or config.model.lower().endswith(".gguf"):
        raise NotBuiltError("model", config.model, f"{feature} of a pre-quantized checkpoint ({method or 'gguf'})")
    if is_multimodal(runner.model):
        raise NotBuiltError("model", config.model, f"{feature} of a multimodal model (its vision tower)")


def _check_config(served: Any, new: Any) -> None:
    """`InvalidRequestError` naming every key of `SHAPE_KEYS` whose value differs."""
    old_dict, new_dict = _plain_dict(served), _plain_dict(new)
    differ = [f"{key}={new_dict.get(key)!r} (served: {old_dict.get(key)!r})"
              for key in SHAPE_KEYS if old_dict.get(key) != new_dict.get(key)]
    if differ:
        raise InvalidRequestError("model_path", "a checkpoint of the served model's architecture and shapes; its "
                                                "config.json differs: " + ", ".join(differ))


def _plain_dict(hf_config: Any) -> dict[str, Any]:
    """The decoder's config as the workers get it from the host (`hf_config_from_json`), so that a config read
    by the architecture's class and one rebuilt from JSON compare equal; with the checkpoint's architectures."""
    values = text_config_of(hf_config_from_json(hf_config_json(hf_config))).to_dict()
    values["architectures"] = getattr(hf_config, "architectures", None)
    return values


def _meta_model(runner: Any) -> Any:
    """The served model again (a pipeline stage's parts only), its parameters on the meta device (no memory), to
    run the loader over shapes only."""
    try:
        with _parameters_on_meta():
            return build_model(runner.config, runner.hf_config, runner.device, runner.dtype, runner.rank,
                               runner.tp_size, tensor_device=torch.device("cpu"), pipeline=getattr(runner, "stage", None))
    except Exception as exc:  # noqa: BLE001 - an architecture whose layers need real tensors to be built
        raise NotBuiltError("model", runner.config.model,
                            f"update_weights of this architecture (it cannot be built on the meta device: {exc})") \
            from exc


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device as they are registered, loader attributes and all;
    buffers (rotary tables) stay on the CPU: small, and on meta their first ``arange`` imports torch's
    decompositions (seconds). A parameter's CPU storage is never written, so it costs no page."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # weight_loader and the attributes loaders read
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class _HeadersOnly:
    """A `load_checkpoint` filter: each tensor as a meta tensor of its shape (the loaders slice and check it,
    nothing is read); `last` names the tensor a loader failed on (the loaders consume them one at a time)."""

    def __init__(self) -> None:
        self.last: str | None = None

    def __call__(self, weights: Iterator[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        for name, weight in weights:
            self.last = name
            yield name, torch.empty(weight_shape(weight), device="meta")


def _all_ranks_passed(passed: bool, device: torch.device) -> bool:
    """Whether every rank's check passed (the minimum over all the engine's ranks: every stage's TP ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return passed
    flag = torch.tensor([1 if passed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
