"""Multi-token prediction (MTP) layers as draft heads: speculative decoding with ``method="mtp"``
(docs/speculative.md).

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
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from asyncllm.errors import ConfigError
from asyncllm.models.eagle import TargetReader
from asyncllm.models.embedding import ParallelLMHead
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel
from asyncllm.models.linear import ColumnParallelLinear

__all__ = ["MTP_ARCHITECTURES", "mtp_cache_config", "mtp_class", "mtp_layer_config"]

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")
"""Targets whose checkpoints' MTP layers are read (DeepSeek's layout)."""


def mtp_layer_config(hf_config: Any) -> Any:
    """The target's config for its MTP layer: one more layer, per-layer lists extended by their last entry (GLM-4.7-
    Flash's ``mlp_layer_types``: the MTP layer has experts)."""
    return _with_layers(hf_config, lambda kinds: kinds + kinds[-1:], hf_config.num_hidden_layers + 1)


def mtp_cache_config(hf_config: Any) -> Any:
    """The target's config for the MTP layer's KV cache: one layer, shaped as the target's last."""
    return _with_layers(hf_config, lambda kinds: kinds[-1:], 1)


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
    """The MTP head class of a target class: `MTPHead`'s build and forward, the target class's weight loading."""
    return type(f"{target_cls.__name__}MTP", (MTPHead, target_cls), {})


class _SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, tp: TensorParallel, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps, dtype, ops)
        self.head = ParallelLMHead(vocab, hidden, tp, dtype)


class MTPHead(TargetReader, nn.Module):
    """Mixin before a target class: ``model.layers.0`` is the target's layer ``L`` with ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head`` on it (their checkpoint names, less the index)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int, expert_parallel: bool = False) -> None:
        nn.Module.__init__(self)
        self.mtp_index = hf_config.num_hidden_layers - 1  # built from `mtp_layer_config`: the last layer
        build = self.decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)  # type: ignore[attr-defined]
        self.pipeline = None
        self.tie_word_embeddings = False
        hidden, eps, ops = hf_config.hidden_size, hf_config.rms_norm_eps, attn_backend.ops
        layer = self.model_cls.layer_class(hf_config)(build, self.mtp_index)  # type: ignore[attr-defined]
        layer.enorm = RMSNorm(hidden, eps, dtype, ops)
        layer.hnorm = RMSNorm(hidden, eps, dtype, ops)
        layer.eh_proj = ColumnParallelLinear(2 * hidden, hidden, False, TensorParallel(), dtype)  # replicated
        layer.shared_head = _SharedHead(hidden, hf_config.vocab_size, eps, tp, dtype, ops)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])

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

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Only the MTP layer's names, as layer 0's; `ConfigError` for a checkpoint without them."""
        loaded = super().load_weights(self._mtp_names(weights))  # type: ignore[misc]
        if not loaded:
            raise ConfigError("speculative_config", "mtp", f"a checkpoint with its multi-token-prediction layer "
                                                            f"(model.layers.{self.mtp_index}.*); this one has none")
        return loaded

    def _mtp_names(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        prefix = f"model.layers.{self.mtp_index}."
        for name, weight in weights:
            if name.startswith(prefix) and not name.startswith(prefix + "embed_tokens."):
                yield "model.layers.0." + name.removeprefix(prefix), weight
