"""Attention-free Mamba models: Mamba (``MambaForCausalLM``: state-spaces/mamba-*-hf), Falcon Mamba
(``FalconMambaForCausalLM``: tiiuae/falcon-mamba-7b) and Mamba2 (``Mamba2ForCausalLM``: mamba-codestral-7B,
mamba2-*-hf).

Every layer is ``x + mixer(norm(x))``: Mamba's selective-scan mixer (asyncllm/models/mamba1.py; Falcon Mamba norms its
``dt``, ``B`` and ``C`` without weights) or Mamba2's SSD mixer (asyncllm/models/mamba2.py), each request's states kept
by worker row (asyncllm/models/row_states.py), with no attention and no MLP; ``residual_in_fp32`` keeps the residual
stream in float32, as transformers does; a final RMSNorm (``norm_f``) and the LM head. The engine keeps no KV cache
for them: one token-sized cache layer backs the scheduler's block accounting (`kv_cache_spec_of`), and prefix caching
restores the states from checkpoint slots as for the hybrids (docs/hybrid-models.md).

Pipeline stages: a stage builds its own layers (and the embeddings, final norm, LM head where Llama's stages hold
them) and runs them itself (`MambaModel.run_stage`); LoRA adapters change the mixers' projections: Mamba's and
Falcon Mamba's ``in_proj``, ``x_proj``, ``dt_proj``, ``out_proj``, Mamba2's ``in_proj``, ``out_proj``
(`MambaForCausalLM.attach_lora`; docs/lora.md).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.models.hybrid import StateLayersMixin, renamed
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel
from asyncllm.models.llama import DecoderBuild, LlamaForCausalLM
from asyncllm.models.mamba1 import Mamba1Mixer
from asyncllm.models.mamba2 import Mamba2Mixer, Mamba2Shape
from asyncllm.models.pipeline import PipelineStage, PPMissingLayer
from asyncllm.models.row_states import StateRows

__all__ = ["MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM"]

_NAMES = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
          ("backbone.layers.", "model.layers."))


def jamba_names(cfg: Any) -> Any:
    """A Mamba config under the names Jamba's mixer reads (`Mamba1Mixer`)."""
    return types.SimpleNamespace(
        hidden_size=cfg.hidden_size, mamba_expand=cfg.intermediate_size / cfg.hidden_size,
        mamba_dt_rank=int(cfg.time_step_rank), mamba_d_state=cfg.state_size, mamba_d_conv=cfg.conv_kernel,
        mamba_proj_bias=bool(cfg.use_bias), mamba_conv_bias=bool(cfg.use_conv_bias),
        rms_norm_eps=getattr(cfg, "mixer_rms_eps", cfg.layer_norm_epsilon))


def mamba2_shape(cfg: Any) -> Mamba2Shape:
    """Mamba2's mixer shape from its config (``num_heads``, ``head_dim``, ``n_groups``, ...)."""
    return Mamba2Shape(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size, cfg.conv_kernel,
                       bool(cfg.use_conv_bias), bool(cfg.use_bias), cfg.layer_norm_epsilon,
                       tuple(getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))))


class MambaLayer(nn.Module):
    """``norm`` then the ``mixer``; the residual add is the model's."""

    is_linear = True
    uses_kv_cache = False

    def __init__(self, cfg: Any, mixer: nn.Module, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype, ops)
        self.mixer = mixer


class MambaModel(nn.Module):
    """The embeddings, the layers, the final norm; a pipeline stage builds only its own (`PPMissingLayer` for the
    others') and runs them (`run_stage`), the float32 stream crossing each boundary bit for bit."""

    def __init__(self, b: DecoderBuild, mixer: Any) -> None:
        super().__init__()
        cfg, stage = b.hf_config, b.pipeline
        embeds = stage is None or stage.holds_embeddings(bool(getattr(cfg, "tie_word_embeddings", True)))
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, b.tp, b.dtype) if embeds
                             else PPMissingLayer())
        self.layers = nn.ModuleList(MambaLayer(cfg, mixer(b), b.dtype, b.attn_backend.ops)
                                    if stage is None or stage.owns_layer(i) else PPMissingLayer()
                                    for i in range(cfg.num_hidden_layers))
        self.norm = (RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, b.dtype, b.attn_backend.ops)
                     if stage is None or stage.is_last else PPMissingLayer())
        self.residual_in_fp32 = bool(getattr(cfg, "residual_in_fp32", True))
        self.hidden_size = cfg.hidden_size
        self.dtype = b.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.norm(self.run_layers(range(len(self.layers)), hidden, positions, metadata)).to(self.dtype)

    def run_layers(self, layers: range, hidden: torch.Tensor, positions: torch.Tensor,
                   metadata: AttentionMetadata) -> torch.Tensor:
        """transformers' order: each layer's residual (float32 with ``residual_in_fp32``) plus its mixer's output of
        the normed stream (cast to the norm's dtype first); the final norm, the caller's, on the stream as it is."""
        for index in layers:
            layer = self.layers[index]
            residual = hidden.float() if self.residual_in_fp32 else hidden
            hidden = residual + layer.mixer(positions, layer.norm(hidden.to(self.dtype)), None, metadata)
        return hidden

    def stage_widths(self, stage: PipelineStage) -> tuple[int, int]:
        """A boundary carries the stream alone: a float32 one as its bytes in the model dtype (twice as wide in
        bfloat16), so the next stage adds to it exactly what the unsplit model would."""
        width = self.hidden_size * 4 // self.dtype.itemsize if self.residual_in_fp32 else self.hidden_size
        return width, 0

    def run_stage(self, stage: PipelineStage, received: tuple[torch.Tensor, torch.Tensor] | None,
                  input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                  metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A stage's layers (`StageModel`; ``kv_caches``: the stage's one token-sized layer, unread): the final
        hidden states on the last, else (the stream in the model dtype's bytes, nothing)."""
        if received is None:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        else:
            hidden = received[0].view(torch.float32) if self.residual_in_fp32 else received[0]
        hidden = self.run_layers(range(stage.start_layer, stage.end_layer), hidden, positions, metadata)
        if stage.is_last:
            return self.norm(hidden).to(self.dtype)
        return hidden.contiguous().view(self.dtype), hidden.new_empty(hidden.shape[0], 0, dtype=self.dtype)


class MambaForCausalLM(StateLayersMixin, LlamaForCausalLM):
    """Mamba: the selective-scan mixer in every layer (``inner_norms`` as the family has them)."""

    inner_norms = "none"
    packed_modules: dict[str, list[tuple[str, object]]] = {}
    """Nothing fused: the mixers load as the checkpoint names them."""

    @staticmethod
    def kv_cache_layers(hf_config: Any) -> int:
        return 1  # one token-sized layer backs the block accounting; the model reads none

    @staticmethod
    def kv_cache_spec_of(hf_config: Any, tp_size: int) -> Any:
        """One layer of one 16-wide head: the scheduler's blocks cost next to nothing, and nothing reads them."""
        from asyncllm.models.registry import KVCacheSpec

        return KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=16)

    lora_targets = ("in_proj", "x_proj", "dt_proj", "out_proj")
    """The mixers' projections adapters may change (PEFT's and vLLM's for Mamba; asyncllm/lora.py checks them)."""

    def mixer(self, b: Any) -> nn.Module:
        return Mamba1Mixer(jamba_names(b.hf_config), b.dtype, b.state_rows, b.attn_backend.ops, self.inner_norms)

    def attach_lora(self, num_slots: int, max_rank: int, context: Any) -> dict[str, nn.Module]:
        """A `LoRALayer` on each of this rank's mixers' ``lora_targets`` (asyncllm/models/lora.py)."""
        from asyncllm.models.lora import LoRALayer

        layers = {}
        for i, layer in enumerate(self.model.layers):
            for target in self.lora_targets if isinstance(layer, MambaLayer) else ():
                proj = getattr(layer.mixer, target)
                proj.lora = layers[f"model.layers.{i}.mixer.{target}"] = LoRALayer(proj, [None], num_slots, max_rank,
                                                                                    context)
        return layers

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int, pipeline: PipelineStage | None = None, **kwargs: Any) -> None:
        """``pipeline``: this rank's stage, which builds only its parts (asyncllm/models/pipeline.py)."""
        nn.Module.__init__(self)
        self.state_rows = kwargs.get("state_rows") or StateRows()
        build = self.decoder_build(hf_config, dtype, tp, attn_backend, max_position, False)
        self.pipeline = pipeline
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.model = MambaModel(dataclasses.replace(build, pipeline=pipeline), self.mixer)
        if pipeline is not None and not pipeline.is_last:
            self.lm_head = PPMissingLayer()
            return
        tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, dtype, tied_to)

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> Any:
        from asyncllm.models.llama import DecoderFlags

        return DecoderFlags()

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> Any:
        """The hybrid build (its state rows) with no rotary embedding: Mamba uses no positions."""
        from asyncllm.models.hybrid import HybridBuild

        return HybridBuild(hf_config, self.decoder_flags(hf_config), dtype, tp, attn_backend, None, self.make_mlp,
                           expert_parallel, state_rows=self.state_rows)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((renamed(name, _NAMES), w) for name, w in weights)


class FalconMambaForCausalLM(MambaForCausalLM):
    """Falcon Mamba: Mamba with ``dt``, ``B`` and ``C`` normed without weights (``mixer_rms_eps``)."""

    inner_norms = "weightless"


class Mamba2ForCausalLM(MambaForCausalLM):
    """Mamba2: the SSD mixer (multi-head states, a gated RMSNorm before the output projection) in every layer."""

    lora_targets = ("in_proj", "out_proj")

    def mixer(self, b: Any) -> nn.Module:
        return Mamba2Mixer(mamba2_shape(b.hf_config), b.dtype, b.state_rows, b.attn_backend.ops)
