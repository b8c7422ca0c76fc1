"""Live weight updates on one worker rank (docs/weight-updates.md).

Two phases, so that tensor-parallel ranks never end up with different weights:

1. Check, touching no parameter: the served model is one we can update, the new folder resolves, its
   config.json has the served architecture and shapes, and the model's own loader accepts every tensor
   (names, this rank's shard shapes, nothing missing) on a copy of the model built on the meta device,
   from the safetensors headers only.
2. Every rank (every pipeline stage's too) tells the others whether its check passed (one all-reduce). Only if all passed does each
   rank copy the weights in place (``param.data.copy_`` through the model's `load_weights`), so CUDA
   graphs captured over the parameters stay valid and no second copy of the model is allocated. New fp8
   KV-cache scales, which the graphs hold as constants, have them captured again (`recapture_if_changed`).

A failure in phase 2 (a file that became unreadable half-way, a device fault) is not an error reply: the
worker dies with a `WorkerError`, the core restarts its workers from the last weights that loaded whole
(workers/restart.py), so no rank is left half updated.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from safetensors import SafetensorError

from asyncllm import protocol
from asyncllm.engine.weight_tensors import FIELD, WEIGHT_DTYPES, tensor_views
from asyncllm.engine.weight_update import (
    OTHER_RANK_REFUSED,
    read_update_config,
    resolve_update_path,
    weights_error_reply,
)
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.models.checkpoint import apply_hf_overrides, checkpoint_quantization, hf_config_from_json, hf_config_json
from asyncllm.models.layers import LoadedWeight, weight_shape
from asyncllm.models.loader import build_model, load_checkpoint
from asyncllm.models.registry import text_config_of
from asyncllm.shm_segment import attach_untracked
from asyncllm.workers import cuda_graphs
from asyncllm.workers.pushed_weights import as_loaded, check_tied_head_equal

logger = logging.getLogger(__name__)

__all__ = ["update_weights", "check_update", "check_tensor_update", "refuse_unbuilt", "forget_weights",
           "unwritten_weights", "SHAPE_KEYS", "VISION_KEYS"]

SHAPE_KEYS = (
    "architectures", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok", "moe_k",
    "moe_topk", "top_k_experts", "tie_word_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "sliding_window", "quantization_config",
    "ffn_config.ffn_hidden_size", "ffn_config.moe_num_experts", "ffn_config.moe_top_k", "ffn_config.ffn_act_fn",
    "ffn_config.moe_normalize_expert_weights", "attn_config.kv_n_heads", "attn_config.clip_qkv",
    "attn_config.rope_theta",
    # what the layers compute with, besides shapes: activations, soft-caps, scalings and multipliers, norms' epsilon
    "hidden_act", "hidden_activation", "activation_function", "final_logit_softcapping", "attn_logit_softcapping",
    "query_pre_attn_scalar", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps",
    "partial_rotary_factor", "rotary_pct", "logit_scale", "logits_scaling", "embedding_multiplier",
    "residual_multiplier", "attention_multiplier", "attention_bias", "mlp_bias", "layer_types", "max_window_layers",
    "use_sliding_window",
)
"""config.json keys that must equal the served model's: the engine keeps the model it built (its shapes, rotary
tables, norms, activations, scalings), so only weights may change. ``outer.inner``: a key of a nested config
(DBRX's), whose other keys (its dtype, its training-only ``moe_loss_weight``) may differ."""
VISION_KEYS = ("image_token_index", "image_token_id", "vision_feature_layer", "vision_feature_select_strategy",
               "projector_hidden_act", "image_seq_length", "mm_tokens_per_image")
"""A multimodal model's config.json keys that must be equal too, with every key of its ``vision_config`` but
`_NOT_SHAPES`."""
_NOT_SHAPES = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures"}


def update_weights(runner: Any, command: protocol.UpdateWeights, rank: int | None = None) -> protocol.WeightsUpdated:
    """Check, agree with the other ranks, copy; the reply for the core (an error reply changed nothing), from
    ``rank`` (the worker's rank in the engine; default the runner's, which is its TP rank within a stage)."""
    rank = runner.rank if rank is None else rank
    segment = None
    try:
        if command.segment:
            segment, tensors = check_tensor_update(runner, command)
        else:
            path = check_update(runner, command.model_path, command.revision, command.hf_config_json)
        error: InvalidRequestError | NotBuiltError | None = None
    except (InvalidRequestError, NotBuiltError) as exc:
        error = exc
    try:
        if not _all_ranks_passed(error is None, runner.device):
            error = error or InvalidRequestError(_field(command), OTHER_RANK_REFUSED)
            return weights_error_reply(command.update_id, error, rank)
        host_values = cuda_graphs.captured_host_values(runner.model)  # KV-cache scales: the graphs' constants
        with _requantized(runner):  # online fp8: each layer's new float weights quantized into its fp8 ones
            if segment is not None:
                unwritten = _written(runner, _copy_tensors(runner, segment, tensors))
            else:  # in place: every loader copies into .data; a pipeline stage's model loads its own parts only
                load_checkpoint(_loading_model(runner), path, runner.config.kv_cache_dtype)
                unwritten = _written(runner, None)
        refresh = getattr(_loading_model(runner), "refresh_derived_weights", None)  # DeepSeek's absorbed expansions
        if refresh is not None:
            refresh()
        if getattr(runner, "mm_runner", None) is not None:
            runner.mm_runner.forget_encoder_outputs()  # computed by the old vision tower
    finally:
        if segment is not None:
            _close(segment)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)  # the host-to-device copies are done before the next step reads
    cuda_graphs.recapture_if_changed(runner, host_values)
    return protocol.WeightsUpdated(command.update_id, rank=rank, weights_unwritten=unwritten)


def check_tensor_update(runner: Any, command: protocol.UpdateWeights) -> tuple[Any, list[protocol.WeightTensor]]:
    """The host's segment, mapped, and the tensors to load from it (`as_loaded`: a tied head as the embedding), once
    the served model can take ``command.tensors`` (names, this rank's shard shapes; any subset of the weights);
    `InvalidRequestError` naming ``named_tensors`` otherwise."""
    refuse_unbuilt(runner, "update_weights_from_tensors")
    refused = [f"{t.name!r} of {t.dtype}" for t in command.tensors if t.dtype not in WEIGHT_DTYPES]
    if refused:
        raise InvalidRequestError(FIELD, f"floating-point tensors, got {', '.join(refused)}")
    _refuse_unread(_loading_model(runner), [t.name for t in command.tensors])
    try:
        segment = attach_untracked(command.segment)
    except (OSError, ValueError) as exc:  # a core on another machine than the host (tcp://), or a cancelled call's
        raise InvalidRequestError(FIELD, "tensors in the host's shared memory, which this engine core cannot map "
                                         f"({type(exc).__name__}: {exc}): is it on another machine?") from exc
    try:
        _check_fits(segment.size, command.tensors)
        model = _meta_model(runner)
        tensors, tied_pair = as_loaded(model, command.tensors)
        if runner.rank == 0:  # the stage's ranks map the same bytes: one compares, the all-reduce tells the others
            check_tied_head_equal(segment.buf, tied_pair)
        meta = iter((t.name, torch.empty(t.shape, device="meta")) for t in tensors)
        headers = _HeadersOnly(model)
        try:
            model.load_weights(headers(meta))
        except Exception as exc:  # noqa: BLE001 - a name the model lacks, a shape: over meta tensors, nothing written
            reason = _loader_refusal(exc)
            where = f" (at {headers.last!r})" if headers.last is not None and "unexpected" not in reason else ""
            raise InvalidRequestError(FIELD, f"weights the served model has, in its shapes{where}: {reason}") from exc
    except BaseException:
        _close(segment)
        raise
    return segment, tensors


def _refuse_unread(model: Any, names: list[str]) -> None:
    """A pushed tensor the loader would leave unread (`unread_weight`: a layer past the last, as a checkpoint's
    multi-token-prediction layer is) would change nothing: refused by name. A checkpoint's files may hold them."""
    unread = getattr(model, "unread_weight", None)
    refused = [repr(name) for name in names if unread is not None and unread(name)]
    if refused:
        raise InvalidRequestError(FIELD, "weights the served model reads; it leaves unread "
                                         f"{', '.join(refused[:8])}{' and more' if len(refused) > 8 else ''} "
                                         "(a layer past the model's last, or an MTP draft's: drafts are never "
                                         "updated)")


def _close(segment: Any) -> None:
    """Unmap the host's segment (the host unlinks it); a view still alive keeps the mapping until it is freed."""
    try:
        segment.close()
    except BufferError:
        pass


def _check_fits(size: int, tensors: list[protocol.WeightTensor]) -> None:
    for spec in tensors:
        end = spec.offset + math.prod(spec.shape) * WEIGHT_DTYPES[spec.dtype].itemsize
        if spec.offset < 0 or end > size:
            raise InvalidRequestError(FIELD, f"{spec.name!r} at bytes {spec.offset}..{end} of a {size}-byte segment")


def _copy_tensors(runner: Any, segment: Any, tensors: list[protocol.WeightTensor]) -> set[str]:
    """Copy each tensor (this rank's shard) into its parameter; the checkpoint names written."""
    return _loading_model(runner).load_weights(zip([t.name for t in tensors], tensor_views(segment.buf, tensors)))


def _written(runner: Any, names: set[str] | None) -> int:
    """Record that ``names`` (None: every weight, a whole checkpoint) now hold real values; how many of this rank's
    weights still do not."""
    unwritten = unwritten_weights(runner)
    if names is None:
        unwritten.clear()
    else:
        unwritten -= names
        if unwritten:
            unwritten -= _renamed(_loading_model(runner), names)
    return len(unwritten)


def _renamed(model: Any, names: set[str]) -> set[str]:
    """The checkpoint's names of the parameters among ``names`` (a parameter pushed under its own name: Mixtral's
    router ``mlp.gate``, the checkpoint's ``block_sparse_moe.gate``)."""
    unpacked = getattr(model, "_unpacked", None)
    if unpacked is None:
        return set()
    own = names & {name for name, _ in model.named_parameters()}
    return {ckpt for name in own for ckpt, shard in unpacked(name) if shard is None}


def unwritten_weights(runner: Any) -> set[str]:
    """The checkpoint names of this rank's weights that hold no real values (dummy weights; after a level-2 sleep,
    `forget_weights`), kept on the runner."""
    unwritten = getattr(runner, "unwritten_weights", None)
    if unwritten is None:
        dummy = runner.config.load_format == "dummy"
        unwritten = set(_loading_model(runner).checkpoint_weight_names()) if dummy else set()
        runner.unwritten_weights = unwritten
    return unwritten


def forget_weights(runner: Any) -> None:
    """The weights were discarded (a level-2 sleep): none holds real values until updates write them."""
    runner.unwritten_weights = set(_loading_model(runner).checkpoint_weight_names())


def _loading_model(runner: Any) -> Any:
    """The model whose `load_weights` takes checkpoint names (a pipeline stage's: its own parts only)."""
    return getattr(runner.model, "causal_lm", runner.model)


def _requantized(runner: Any) -> Any:
    """`requantizing` the model when it was quantized online (``quantization="fp8"``); else nothing to do."""
    if runner.config.quantization != "fp8":
        return nullcontext()
    from asyncllm.models.fp8_reload import requantizing

    return requantizing(_loading_model(runner))


def _field(command: protocol.UpdateWeights) -> str:
    return FIELD if command.segment else "model_path"


def check_update(runner: Any, model_path: str, revision: str | None, config_json: str = "") -> str:
    """The new checkpoint's folder, once everything but reading its tensors' data has been checked (its config
    as the host read it: `config_json`; empty: read here, which imports the architecture's config class)."""
    refuse_unbuilt(runner)
    path = resolve_update_path(model_path, revision, runner.config.download_dir)
    new_config = hf_config_from_json(config_json or read_update_config(path))
    _check_config(runner.hf_config, apply_hf_overrides(new_config, runner.config.hf_overrides))
    model = _meta_model(runner)
    headers = _HeadersOnly(model)
    try:
        load_checkpoint(model, path, runner.config.kv_cache_dtype, weights_filter=headers)
    except (OSError, SafetensorError) as exc:  # a file that is not safetensors, a cut one
        raise InvalidRequestError("model_path", f"{path} could not be read ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # noqa: BLE001 - names missing or unexpected, a shape: over meta tensors, nothing written
        where = f" (at {headers.last})" if headers.last is not None and not isinstance(exc, ConfigError) else ""
        reason = exc if isinstance(exc, ConfigError) else _loader_refusal(exc)
        raise InvalidRequestError("model_path", f"{path} does not fit the served model{where}: {reason}") from exc
    return path


def _loader_refusal(exc: Exception) -> str:
    """Why the model's loader refused a tensor: what a `ConfigError` allows, a `ValueError`'s message; another
    error (a tensor of the wrong rank: an `IndexError`) with its type, as a refusal too, so the worker keeps serving,
    its traceback logged (it may be the engine's own bug)."""
    if isinstance(exc, ConfigError):
        return exc.allowed
    if not isinstance(exc, (ValueError, InvalidRequestError)):
        logger.warning("a weight update's check failed with %s, refused as not fitting the served model",
                       type(exc).__name__, exc_info=exc)
    return str(exc) if isinstance(exc, (ValueError, RuntimeError)) else f"{type(exc).__name__}: {exc}"


def refuse_unbuilt(runner: Any, feature: str = "update_weights") -> None:
    """What the in-place copy (and sleep mode's moves, `feature` "sleep mode") does not cover: pre-quantized
    checkpoints, whose kernels keep layouts built from the checkpoint's tensors (online fp8 is requantized)."""
    config = runner.config
    method = checkpoint_quantization(runner.hf_config)
    if method is not None or config.model.lower().endswith(".gguf"):
        raise NotBuiltError("model", config.model, f"{feature} of a pre-quantized checkpoint ({method or 'gguf'})")


def _check_config(served: Any, new: Any) -> None:
    """`InvalidRequestError` naming every key of `SHAPE_KEYS` whose value differs."""
    old_dict, new_dict = _plain_dict(served), _plain_dict(new)
    vision = sorted(key for key in old_dict.keys() | new_dict.keys() if key.startswith("vision_config."))
    differ = [f"{key}={new_dict.get(key)!r} (served: {old_dict.get(key)!r})"
              for key in (*SHAPE_KEYS, *VISION_KEYS, *vision) if old_dict.get(key) != new_dict.get(key)]
    if differ:
        raise InvalidRequestError("model_path", "a checkpoint of the served model's architecture and shapes; its "
                                                "config.json differs: " + ", ".join(differ))


def _plain_dict(hf_config: Any) -> dict[str, Any]:
    """The decoder's config as the workers get it from the host (`hf_config_from_json`), so that a config read
    by the architecture's class and one rebuilt from JSON compare equal; with the checkpoint's architectures and,
    for a multimodal model, its vision tower's config and the keys that place its features (`VISION_KEYS`)."""
    plain = hf_config_from_json(hf_config_json(hf_config))
    values = text_config_of(plain).to_dict()
    values["architectures"] = getattr(hf_config, "architectures", None)
    for key in SHAPE_KEYS:
        outer, dot, inner = key.partition(".")
        nested = values.get(outer)
        if dot and isinstance(nested, dict):
            values[key] = nested.get(inner)
    vision = getattr(plain, "vision_config", None)
    if vision is not None:
        values.update({f"vision_config.{key}": value for key, value in vision.to_dict().items()
                       if key not in _NOT_SHAPES})
        values.update({key: getattr(plain, key, None) for key in VISION_KEYS})
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
    decompositions (seconds). A parameter's CPU storage is never written, so it costs no page. A parameter
    registered twice (tied embeddings: the LM head's weight is the embedding's) stays one parameter.

    Not `layers.params_on_meta`: that moves only `new_param`'s parameters, and the models make many others
    (``nn.Parameter`` / ``nn.Linear`` / ``nn.LayerNorm`` of towers, norms, routers), which this patch moves
    too; with both, two mechanisms would move the same parameters. `params_on_meta` cannot take this patch in
    turn: the patch is process-wide (every thread's modules), and a parameter it moves loses the values its
    ``__init__`` gave it, which a pre-quantized load (`loader.materialize_params`) would replace by zeros."""
    register = nn.Module.register_parameter
    made = WeakIdKeyDictionary()  # the parameter -> its meta copy, while the parameter lives (its CPU placeholder dies)

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            if param not in made:
                meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                meta.__dict__.update(param.__dict__)  # weight_loader and the attributes loaders read
                made[param] = meta
            param = made[param]
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class _HeadersOnly:
    """A `load_checkpoint` filter: each tensor as a meta tensor of its shape (the loaders slice and check it,
    nothing is read); `last` names the tensor a loader failed on (the loaders consume them one at a time). A name
    of one of ``model``'s parameters that the loader fills from parts (`_fused_parameters`) is refused by name
    before any loader sees it."""

    def __init__(self, model: Any) -> None:
        self.last: str | None = None
        self.built = _fused_parameters(model)

    def __call__(self, weights: Iterator[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        for name, weight in weights:
            self.last = name
            if name in self.built:
                raise ConfigError("model", name, "a checkpoint's weight name, not that of a parameter the served "
                                                 "model fuses from the checkpoint's weights")
            yield name, torch.empty(weight_shape(weight), device="meta")


def _fused_parameters(model: Any) -> set[str]:
    """The names of ``model``'s parameters that its loader fills from several checkpoint weights (a fused
    ``qkv_proj``, the stacked experts' ``w13_weight``), each with its shard id. A parameter only renamed from its
    checkpoint's (Mixtral's router ``mlp.gate``, the checkpoint's ``block_sparse_moe.gate``) loads under its own
    name too, so it is not among them. A model without `_unpacked`: every parameter that no checkpoint names."""
    unpacked = getattr(model, "_unpacked", None)
    if unpacked is not None:
        return {name for name, _ in model.named_parameters() if any(shard is not None for _, shard in unpacked(name))}
    decoder = getattr(model, "language_model", None)  # a vision-language model: its decoder's, prefixed
    if isinstance(decoder, nn.Module) and hasattr(decoder, "_unpacked"):
        return {f"language_model.{name}" for name in _fused_parameters(decoder)}
    return {name for name, _ in model.named_parameters()} - model.checkpoint_weight_names()


def _all_ranks_passed(passed: bool, device: torch.device) -> bool:
    """Whether every rank's check passed (the minimum over all the engine's ranks: every stage's TP ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return passed
    flag = torch.tensor([1 if passed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
