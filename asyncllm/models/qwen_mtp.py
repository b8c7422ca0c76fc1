"""Qwen3-Next and Qwen3.5's multi-token-prediction layer as a draft head (``method="mtp"``; docs/speculative.md).

Their checkpoints carry it under ``mtp.`` (``mtp_num_hidden_layers: 1``): a full-attention decoder layer of the
model's own kind (gated attention, the model's MLP or experts) after ``fc`` over the normed embedding of token
``p + 1`` and the normed target hidden state at ``p``, then a final norm, every norm zero-centred; the target's LM
head gives the draft, and the next draft reads the normed output in place of the target's hidden state, as vLLM's
``qwen3_next_mtp`` / ``qwen3_5_mtp``. Nothing is masked at position 0 (DeepSeek's layer masks its embedding there).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from asyncllm.models.gemma import GemmaRMSNorm
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.mtp import MTPLayerHead
from asyncllm.models.quantized_layers import keep_float
from asyncllm.models.row_states import StateRows

__all__ = ["QwenMTPHead"]

_RENAMES = (("mtp.layers.0.", "model.layers.0."), ("mtp.fc.", "model.layers.0.fc."),
            ("mtp.pre_fc_norm_embedding.", "model.layers.0.pre_fc_norm_embedding."),
            ("mtp.pre_fc_norm_hidden.", "model.layers.0.pre_fc_norm_hidden."),
            ("mtp.norm.", "model.layers.0.mtp_norm."))
"""The checkpoint's ``mtp.`` names as this head's modules (all on its one layer)."""


class QwenMTPHead(MTPLayerHead):
    """Qwen's layout: ``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``mtp_norm`` on the layer."""

    entry_proj = "fc"
    state_rows = StateRows(rows=0)
    """The layer keeps no recurrent states (the hybrid build asks)."""

    def layer_modules(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, ops: Any) -> dict[str, nn.Module]:
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        return {"fc": keep_float(ColumnParallelLinear(2 * hidden, hidden, False, TensorParallel(), dtype)),
                **{name: GemmaRMSNorm(hidden, eps, dtype, ops)
                   for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "mtp_norm")}}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's normed output for the logits, the same for the next draft to read)."""
        layer = self.model.layers[0]
        joined = torch.cat([layer.pre_fc_norm_embedding(self.embed(input_ids)), layer.pre_fc_norm_hidden(hidden)], -1)
        out, residual = layer(positions, layer.fc(joined), None, kv_caches[0], attn_metadata)
        out, _ = layer.mtp_norm(out, residual)
        return out, out

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy ids from the target's LM head."""
        return self.target[0].compute_logits(hidden).argmax(dim=-1)

    def mtp_names_hint(self) -> str:
        return "mtp.*"

    def mtp_names(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        for name, weight in weights:
            for old, new in _RENAMES:
                if name.startswith(old):
                    yield new + name.removeprefix(old), weight
                    break
