"""Multi-token prediction (MTP) layers as draft heads: speculative decoding with ``method="mtp"``
(docs/speculative.md). Qwen3-Next and Qwen3.5's layout: asyncllm/models/qwen_mtp.py.

DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7 and GLM-4.7-Flash checkpoints carry a multi-token-prediction layer after
their decoder (``model.layers.{L}`` with ``L = num_hidden_layers``; ``num_nextn_predict_layers`` of them), trained
to predict the token after next. At position ``p`` it reads the embedding of token ``p + 1`` (zero at position 0,
as vLLM) and the target's final hidden state at ``p``::

    x = eh_proj([enorm(embedding), hnorm(hidden)])
    out = the layer's decoder block (the target's own layer kind: its attention, its experts) over x
    logits = shared_head.head(shared_head.norm(out))

and the next draft reads ``out`` in place of the target's hidden state. The layer is built from the target's class
(`mtp_class`: the target's layer at index ``L``, so its kind of attention and MLP, with the extra modules on it)
and loaded from the target's own checkpoint, only the names under ``model.layers.{L}.`` read (its
``embed_tokens`` copy not: the target's embeddings are used).

The entry projection (``eh_proj``; Qwen's ``fc``) is a float linear under every pre-quantized format, as vLLM builds
it and the released fp8 checkpoints store it (`keep_float`); a checkpoint that stores it in fp8 with its scale has
it dequantized as it loads (`float_entry_weights`), one stored in another quantized format is refused by name.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.eagle import TargetReader
from asyncllm.models.embedding import ParallelLMHead
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.quantization import FP8_DTYPE, fp8_to_float
from asyncllm.models.quantized_layers import keep_float
from asyncllm.spec.config import SPEC_FIELD

__all__ = ["DEEPSEEK_MTP_ARCHITECTURES", "MTPLayerHead", "MTP_ARCHITECTURES", "QWEN_MTP_ARCHITECTURES",
           "float_entry_weights", "mtp_cache_config", "mtp_class", "mtp_layer_config", "mtp_target", "num_mtp_layers"]

DEEPSEEK_MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")
"""Targets whose checkpoints' MTP layers are read in DeepSeek's layout (``model.layers.{L}``)."""
QWEN_MTP_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                          "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
"""Targets whose checkpoints' MTP layers are read in Qwen's layout (``mtp.``; asyncllm/models/qwen_mtp.py); the
image-text checkpoints served as text."""
MTP_ARCHITECTURES = DEEPSEEK_MTP_ARCHITECTURES + QWEN_MTP_ARCHITECTURES


def num_mtp_layers(hf_config: Any) -> int:
    """The MTP layers a checkpoint's config declares (DeepSeek's ``num_nextn_predict_layers``, Qwen's
    ``mtp_num_hidden_layers``)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or getattr(hf_config, "mtp_num_hidden_layers", 0)
               or 0)


def mtp_target(hf_config: Any) -> tuple[type, Any]:
    """The target's text class and config the MTP layer is built from (an image-text Qwen3.5 checkpoint's language
    model)."""
    from asyncllm.models.registry import get_model_class

    arch = hf_config.architectures[0]
    if arch.endswith("ForConditionalGeneration"):
        text_arch = arch.replace("ForConditionalGeneration", "ForCausalLM")
        text_config = copy.copy(hf_config.text_config)
        text_config.architectures = [text_arch]
        return get_model_class(text_config), text_config
    return get_model_class(hf_config), hf_config


def mtp_layer_config(hf_config: Any) -> Any:
    """The target's config for its MTP layer: one more layer, per-layer lists extended by their last entry (GLM-4.7-
    Flash's ``mlp_layer_types``: the MTP layer has experts; a hybrid's: full attention)."""
    return _with_layers(hf_config, lambda kinds: kinds + [_layer_kind(kinds[-1])], hf_config.num_hidden_layers + 1)


def mtp_cache_config(hf_config: Any) -> Any:
    """The target's config for the MTP layer's KV cache: one layer, shaped as the target's last (full attention in
    a hybrid)."""
    return _with_layers(hf_config, lambda kinds: [_layer_kind(kinds[-1])], 1)


def _layer_kind(last: str) -> str:
    from asyncllm.models.hybrid import STATE_LAYER_TYPES

    return "full_attention" if last in STATE_LAYER_TYPES else last


def _with_layers(hf_config: Any, lists: Any, num_layers: int) -> Any:
    cfg = copy.deepcopy(hf_config)
    for key in ("mlp_layer_types", "layer_types"):
        kinds = getattr(cfg, key, None)
        if isinstance(kinds, list) and len(kinds) == hf_config.num_hidden_layers:
            setattr(cfg, key, lists(kinds))
    cfg.num_hidden_layers = num_layers
    return cfg


@functools.lru_cache(maxsize=None)
def mtp_class(target_cls: type) -> type:
    """The MTP head class of a target class: `MTPHead`'s build and forward (Qwen's: `QwenMTPHead`), the target
    class's weight loading."""
    from asyncllm.models.qwen3_5 import Qwen3_5ForCausalLM
    from asyncllm.models.qwen_mtp import QwenMTPHead

    head = QwenMTPHead if issubclass(target_cls, Qwen3_5ForCausalLM) else MTPHead
    return type(f"{target_cls.__name__}MTP", (head, target_cls), {})


class _SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, tp: TensorParallel, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps, dtype, ops)
        self.head = ParallelLMHead(vocab, hidden, tp, dtype)


_FP8_SCALES = ("weight_scale_inv", "weight_scale")


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, proj: str) -> torch.Tensor:
    """An fp8 weight times its scale: one per tensor, per output row, or per block (``block``; without one the
    released checkpoints' 128 x 128 if the scale's shape fits it, else the block the shape implies);
    `ConfigError` naming ``proj`` when the scale's shape fits none of them."""
    rows, cols = weight.shape
    scale = scale.float()
    if scale.numel() == 1 or tuple(scale.shape) in ((rows, 1), (rows,)):
        return fp8_to_float(weight) * scale.reshape(-1, 1)
    if block is None and scale.dim() == 2:
        implied = (-(-rows // scale.shape[0]), -(-cols // scale.shape[1]))
        block = (128, 128) if _block_grid(rows, cols, (128, 128)) == tuple(scale.shape) else implied
    if block is None or _block_grid(rows, cols, block) != tuple(scale.shape):
        raise ConfigError("model", proj, f"a weight scale of one value, one per row or one per block ({block}) of "
                                         f"its [{rows}, {cols}] fp8 weight; got shape {list(scale.shape)}")
    return reference.dequantize_fp8_blocks(weight, scale, block)


def _block_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def float_entry_weights(weights: Iterable[tuple[str, LoadedWeight]], proj: str,
                        block: tuple[int, int] | None) -> Iterator[tuple[str, LoadedWeight]]:
    """The stream with the float linear ``proj``'s weight float: as stored (bf16, the released checkpoints), or an
    fp8 one dequantized with its ``weight_scale_inv`` / ``weight_scale`` (yielded last); `NotBuiltError` for
    ``proj`` stored in another quantized format (AWQ / GPTQ ``qweight``, compressed-tensors ``weight_packed``)."""
    held: dict[str, torch.Tensor] = {}
    for name, weight in weights:
        if not name.startswith(proj + "."):
            yield name, weight
            continue
        part = name.removeprefix(proj + ".")
        if part not in ("weight", "input_scale", *_FP8_SCALES):
            raise NotBuiltError(SPEC_FIELD, "mtp", f"an MTP layer whose {proj} is stored quantized other "
                                                             f"than in fp8 ({name}; float or fp8 are served)")
        held[part] = weight if isinstance(weight, torch.Tensor) else weight[...]
    if "weight" not in held:
        return
    scales = [held[key] for key in _FP8_SCALES if key in held]
    weight = held["weight"]
    if weight.dtype == FP8_DTYPE and not scales:
        raise ConfigError("model", proj, "an fp8 weight with its weight_scale_inv or weight_scale")
    if weight.dtype != FP8_DTYPE and (not weight.dtype.is_floating_point or weight.dtype.itemsize == 1):
        raise NotBuiltError(SPEC_FIELD, "mtp", f"an MTP layer whose {proj} is stored as {weight.dtype} "
                                                         f"({proj}.weight; float or float8_e4m3fn are served)")
    yield proj + ".weight", _dequantized(weight, scales[0], block, proj) if weight.dtype == FP8_DTYPE else weight


def _weight_block(hf_config: Any) -> tuple[int, int] | None:
    section = getattr(hf_config, "quantization_config", None) or {}
    block = section.get("weight_block_size") if isinstance(section, dict) else None
    return tuple(block) if block else None  # type: ignore[return-value]


class MTPLayerHead(TargetReader, nn.Module):
    """What both layouts share (a mixin before a target class): ``model.layers.0`` is the target's layer ``L``, with
    the layout's own modules on it (`layer_modules`); only the checkpoint's MTP names are loaded (`mtp_names`), the
    entry projection (``entry_proj``) float (`float_entry_weights`)."""

    entry_proj = "eh_proj"

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int, expert_parallel: bool = False, **_: Any) -> None:
        nn.Module.__init__(self)
        self.mtp_index = hf_config.num_hidden_layers - 1  # built from `mtp_layer_config`: the last layer
        build = self.decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)  # type: ignore[attr-defined]
        self.pipeline = None
        self.tie_word_embeddings = False
        # what the target classes' own __init__ would set for their loading (fused experts' two layouts)
        self.expert_sizes = (int(hf_config.hidden_size), int(getattr(hf_config, "moe_intermediate_size", 0) or 0))
        layer = self.model_cls.layer_class(hf_config)(build, self.mtp_index)  # type: ignore[attr-defined]
        for name, module in self.layer_modules(hf_config, dtype, tp, attn_backend.ops).items():
            setattr(layer, name, module)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.weight_block = _weight_block(hf_config)

    def layer_modules(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, ops: Any) -> dict[str, nn.Module]:
        """The layout's modules beside the decoder block (none here)."""
        return {}

    def mtp_names(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """The checkpoint's MTP weights under this module's names (none here)."""
        return iter(())

    def mtp_names_hint(self) -> str:
        """The checkpoint names of the layer, for the error when there are none."""
        return ""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Only the MTP layer's names, as layer 0's; `ConfigError` for a checkpoint without them."""
        names = float_entry_weights(self.mtp_names(weights), f"model.layers.0.{self.entry_proj}", self.weight_block)
        loaded = super().load_weights(names)  # type: ignore[misc]
        if not loaded:
            raise ConfigError(SPEC_FIELD, "mtp", f"a checkpoint with its multi-token-prediction layer "
                                                            f"({self.mtp_names_hint()}); this one has none")
        return loaded


class MTPHead(MTPLayerHead):
    """DeepSeek's layout: ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head`` on the layer (their checkpoint names,
    less the index)."""

    def mtp_names_hint(self) -> str:
        return f"model.layers.{self.mtp_index}.*"

    def layer_modules(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, ops: Any) -> dict[str, nn.Module]:
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        return {"enorm": RMSNorm(hidden, eps, dtype, ops), "hnorm": RMSNorm(hidden, eps, dtype, ops),
                "eh_proj": keep_float(ColumnParallelLinear(2 * hidden, hidden, False, TensorParallel(), dtype)),
                "shared_head": _SharedHead(hidden, hf_config.vocab_size, eps, tp, dtype, ops)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output for the logits, the same for the next draft to read)."""
        layer = self.model.layers[0]
        embeds = self.embed(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        out, residual = layer(positions, x, None, kv_caches[0], attn_metadata)
        out = out + residual
        return out, out

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.layers[0].shared_head
        return head.head(head.norm(hidden)).argmax(dim=-1)

    def mtp_names(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        prefix = f"model.layers.{self.mtp_index}."
        for name, weight in weights:
            if name.startswith(prefix) and not name.startswith(prefix + "embed_tokens."):
                yield "model.layers.0." + name.removeprefix(prefix), weight
