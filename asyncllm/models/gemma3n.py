"""Gemma 3n text (transformers' ``Gemma3nForCausalLM``; the language model of ``Gemma3nForConditionalGeneration``
checkpoints, gemma-3n-E2B / E4B and their -it, served for text prompts): Gemma 4's attention, KV sharing and
per-layer inputs (gemma4.py) under Gemma 3n's layer, in transformers' order of operations:

- AltUp: the hidden state is ``altup_num_inputs`` streams; the first is the token embedding, each other its own
  projection rescaled to the embedding's RMS. Each layer *predicts* every stream as a mix of all of them
  (coefficients from a tanh router over the active stream), runs on the active prediction, and *corrects* every
  stream by the layer's innovation (coefficients from the router over the layer's output, plus one). At the end
  the streams are projected back (the first as it is), rescaled to the first's RMS, averaged and normed.
- LAuReL: a low-rank branch (``linear_left`` -> ``linear_right`` -> norm) beside the attention, the two summed
  with the residual and scaled by ``2 ** -0.5``.
- Activation sparsity (``activation_sparsity_pattern``, the first ten layers of the releases): the MLP's gate keeps
  only what lies above its mean plus ``icdf(p)`` standard deviations (over the whole intermediate width, all-reduced
  across tensor-parallel ranks), shifted down by that cutoff.
- The per-layer input gates the corrected active stream (times ``correct_output_scale``) and is added to every
  stream but the first; token ids past ``vocab_size_per_layer_input`` take id 0's per-layer embedding.
- Per-layer MLP widths (``intermediate_size`` a list), logits capped by ``final_logit_softcapping``.

Pipeline stages: gemma4_stages.py (the four streams cross a boundary side by side). Audio: gemma3n_mm.py (images
are not built: a `NotBuiltError` names the vision tower).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.gemma import GemmaMLP
from asyncllm.models.gemma4 import (
    Gemma4Attention, Gemma4Build, Gemma4ForCausalLM, Gemma4Model, Gemma4RMSNorm, LanguageModelOnly,
)
from asyncllm.models.layers import new_param
from asyncllm.models.moe import ReplicatedLinear
from asyncllm.models.pipeline import PPMissingLayer

__all__ = ["Gemma3nForCausalLM", "Gemma3nTextOnly", "mlp_sizes"]


def mlp_sizes(cfg: Any) -> list[int]:
    """Each layer's MLP width: ``intermediate_size`` per layer (a list) or one for all."""
    size = cfg.intermediate_size
    return [int(s) for s in size] if isinstance(size, (list, tuple)) else [int(size)] * cfg.num_hidden_layers


def _rescaled(x: torch.Tensor, target_rms: torch.Tensor) -> torch.Tensor:
    """``x`` scaled to ``target_rms`` per token (its own RMS floored at ``sqrt(1e-5)``), as transformers."""
    rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target_rms / rms


class AltUp(nn.Module):
    """One layer's prediction and correction of the streams (transformers' ``Gemma3nTextAltUp``)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        n, hidden = cfg.altup_num_inputs, cfg.hidden_size
        self.num_streams, self.active = n, cfg.altup_active_idx
        self.correct_output_scale = new_param(hidden, dtype=dtype)
        self.correction_coefs = ReplicatedLinear(n, n, dtype)
        self.prediction_coefs = ReplicatedLinear(n * n, n, dtype)
        self.modality_router = ReplicatedLinear(n, hidden, dtype)
        self.router_norm = Gemma4RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.register_buffer("router_input_scale", torch.tensor(hidden**-1.0).to(dtype), persistent=False)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """``[n, T, H]`` -> each stream plus its mix of all of them."""
        n, tokens = self.num_streams, streams.shape[1]
        coefs = self.prediction_coefs(self._modalities(streams[self.active])).view(tokens, n, n).transpose(1, 2)
        mixed = torch.matmul(streams.permute(1, 2, 0), coefs).permute(2, 0, 1)  # [n, T, H]
        return (mixed + streams).type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Every predicted stream plus its share of the layer's innovation (``activated`` less the active one)."""
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0  # [T, n]
        innovation = activated - predictions[self.active]
        return (innovation.unsqueeze(0) * coefs.t().unsqueeze(-1) + predictions).type_as(activated)


class Laurel(nn.Module):
    """LAuReL: ``x + norm(right(left(x)))``."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_left = ReplicatedLinear(cfg.laurel_rank, cfg.hidden_size, dtype)
        self.linear_right = ReplicatedLinear(cfg.hidden_size, cfg.laurel_rank, dtype)
        self.post_laurel_norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nMLP(GemmaMLP):
    """Gemma's GeGLU MLP of this layer's width; with a sparsity target, the gate cut at its Gaussian quantile."""

    def __init__(self, b: Gemma4Build, size: int, sparsity: float) -> None:
        super().__init__(b, size)
        self.size, self.tp = size, b.tp
        # on the CPU when the model is built on the meta device (the roofline's count), whose tensors hold no value
        with torch.device("cpu") if torch.get_default_device().type == "meta" else contextlib.nullcontext():
            self.std_multiplier = float(torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity)))
        self.sparse = sparsity > 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sparse:
            return super().forward(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(self._gaussian_top_k(gate), approximate="tanh") * up)

    def _gaussian_top_k(self, gate: torch.Tensor) -> torch.Tensor:
        """``relu(gate - (mean + std * icdf(p)))`` over the whole width (population std, as transformers)."""
        if self.tp.size == 1:
            mean, std = gate.mean(-1, keepdim=True), gate.std(-1, keepdim=True, unbiased=False)
        else:
            mean = self.tp.all_reduce(gate.sum(-1, keepdim=True)) / self.size
            std = torch.sqrt(self.tp.all_reduce(((gate - mean) ** 2).sum(-1, keepdim=True)) / self.size)
        multiplier = torch.tensor(self.std_multiplier, dtype=torch.float32).to(gate.dtype)
        return F.relu(gate - (mean + std * multiplier))


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, b: Gemma4Build, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        hidden, eps, per_layer = cfg.hidden_size, cfg.rms_norm_eps, cfg.hidden_size_per_layer_input

        def norm() -> Gemma4RMSNorm:
            return Gemma4RMSNorm(hidden, eps, b.dtype)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(b, layer_idx)
        self.mlp = Gemma3nMLP(b, mlp_sizes(cfg)[layer_idx], float(cfg.activation_sparsity_pattern[layer_idx]))
        self.altup = AltUp(cfg, b.dtype)
        self.laurel = Laurel(cfg, b.dtype)
        self.per_layer_input_gate = ReplicatedLinear(per_layer, hidden, b.dtype)
        self.per_layer_projection = ReplicatedLinear(hidden, per_layer, b.dtype)
        self.post_per_layer_input_norm = norm()
        self.active, self.scales_correction = cfg.altup_active_idx, bool(cfg.altup_correct_scale)
        self.uses_kv_cache = not b.layout.shares[layer_idx]  # as Gemma 4's (a pipeline stage counts its caches)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, per_layer_input: torch.Tensor) -> torch.Tensor:
        predictions = self.altup.predict(streams)
        active = predictions[self.active]
        normed = self.input_layernorm(active)
        attn = self.post_attention_layernorm(self.self_attn(positions, normed, kv_cache, metadata))
        attended = (active + attn + self.laurel(normed)) / math.sqrt(2)
        out = attended + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(attended)))
        corrected = self.altup.correct(predictions, out)
        first = corrected[self.active]
        if self.scales_correction:
            first = first * self.altup.correct_output_scale
        gate = F.gelu(self.per_layer_input_gate(first), approximate="tanh") * per_layer_input
        corrected[1:] += self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return corrected


class Gemma3nModel(Gemma4Model):
    layer_cls = Gemma3nDecoderLayer

    def __init__(self, b: Gemma4Build) -> None:
        super().__init__(b)
        cfg, stage = b.hf_config, b.pipeline  # a pipeline stage: the streams spread on the first, merged on the last

        def projections(held: bool) -> nn.Module:
            return nn.ModuleList(ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, b.dtype)
                                 for _ in range(1, cfg.altup_num_inputs)) if held else PPMissingLayer()

        self.altup_projections = projections(stage is None or stage.is_first)
        self.altup_unembed_projections = projections(stage is None or stage.is_last)
        self.per_layer_vocab = int(cfg.vocab_size_per_layer_input)
        self.num_streams, self.stream_width = cfg.altup_num_inputs, cfg.altup_num_inputs * cfg.hidden_size
        self.embed_special: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """``Gemma3nForConditionalGeneration``'s: the ids of its towers' token ranges embedded by their embedders
        (gemma3n_mm.py), where no step's embeddings are given."""

    def embed_stream(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if inputs_embeds is None and self.embed_special is not None:
            inputs_embeds = self.embed_special(input_ids, self.embed_tokens(input_ids))
        return super().embed_stream(input_ids, inputs_embeds)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Gemma 4's, with ids past the per-layer table taking id 0's row (transformers' ``get_per_layer_inputs``)."""
        in_table = (input_ids >= 0) & (input_ids < self.per_layer_vocab)
        return super().per_layer_inputs(torch.where(in_table, input_ids, 0), embeds)

    def _spread(self, embeds: torch.Tensor) -> torch.Tensor:
        """The embedding and its projections, each at the embedding's RMS: ``[n, T, H]``."""
        rms = torch.mean(embeds**2, dim=-1, keepdim=True) ** 0.5
        return torch.stack([embeds, *(_rescaled(proj(embeds), rms) for proj in self.altup_projections)])

    def _merge(self, streams: torch.Tensor) -> torch.Tensor:
        """The first stream and the others projected back at its RMS, averaged."""
        rms = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        back = [_rescaled(proj(stream), rms) for proj, stream in zip(self.altup_unembed_projections, streams[1:])]
        return torch.stack([streams[0], *back]).mean(dim=0)

    def _pack(self, streams: torch.Tensor) -> torch.Tensor:
        """``[n, T, H]`` -> ``[T, n x H]``: what crosses a pipeline stage boundary."""
        return streams.permute(1, 0, 2).reshape(streams.shape[1], -1)

    def _unpack(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(flat.shape[0], self.num_streams, -1).permute(1, 0, 2).contiguous()


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text decoder: AltUp streams, LAuReL, sparse gates, per-layer inputs, KV sharing."""

    model_cls = Gemma3nModel  # type: ignore[assignment]

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> None:
        return None


class Gemma3nTextOnly(LanguageModelOnly, Gemma3nForCausalLM):
    """A ``Gemma3nForConditionalGeneration`` checkpoint's language model, for text prompts (its vision and audio
    towers are not read)."""
