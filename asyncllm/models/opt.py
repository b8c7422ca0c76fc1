"""Meta OPT (opt-125m ... opt-66b, Galactica, OPT-IML: ``OPTForCausalLM``).

Learned positions offset by two rows (`LearnedPositionModel`, asyncllm/models/gpt2.py), LayerNorms with biases, q
scaled by ``head_dim ** -0.5`` right after its projection (as transformers, so attention itself scales by 1), a
gateless ReLU MLP (``fc1`` / ``fc2``), biases by ``enable_bias``, the LM head tied to the embeddings. The layers
norm before each sublayer (``do_layer_norm_before``) or, as opt-350m, after its output joins the stream; opt-350m
also embeds in a narrower ``word_embed_proj_dim`` (``project_in`` / ``project_out`` around the layers).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError
from asyncllm.models.embedding import VocabParallelEmbedding
from asyncllm.models.gpt2 import GPT2LMHeadModel, LearnedPositionModel
from asyncllm.models.layers import LoadedWeight, head_dim_of, new_param
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaAttention
from asyncllm.models.phi import renamed
from asyncllm.models.pipeline import PPMissingLayer
from asyncllm.models.starcoder2 import BiasLayerNorm, Starcoder2DecoderLayer

__all__ = ["OPTForCausalLM"]

_OPT_NAMES = (("model.decoder.embed_tokens.", "model.embed_tokens."),
              ("model.decoder.embed_positions.", "model.embed_positions."),
              ("model.decoder.final_layer_norm.", "model.norm."), ("model.decoder.layers.", "model.layers."),
              ("model.decoder.project_", "model.project_"))
_LAYER_NAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
                (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.c_fc."),
                (".fc2.", ".mlp.c_proj."))


class OPTAttention(LlamaAttention):
    """Llama's attention with the query scaled after its projection (attention's own scale is 1)."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.scaling = head_dim_of(b.hf_config) ** -0.5

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return query * self.scaling, key


class OPTPreNormLayer(Starcoder2DecoderLayer):
    attention_cls = OPTAttention


class OPTPostNormLayer(OPTPreNormLayer):
    """``h = ln1(x + attn(x))``, then ``ln2(h + mlp(h))``: the stream leaves each layer normed (opt-350m)."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, None]:
        stream = hidden if residual is None else hidden + residual
        stream = self.input_layernorm(stream + self.self_attn(positions, stream, kv_cache, metadata))
        return self.post_attention_layernorm(stream + self.mlp(stream)), None


class Projection(nn.Module):
    """A bias-free projection, whole on every rank (opt-350m's ``project_in`` / ``project_out``)."""

    def __init__(self, in_size: int, out_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(out_size, in_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class OPTModel(LearnedPositionModel):
    position_offset = 2
    norm_cls = BiasLayerNorm

    @classmethod
    def layer_class(cls, hf_config: Any) -> type[nn.Module]:
        return OPTPreNormLayer if hf_config.do_layer_norm_before else OPTPostNormLayer

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        cfg = b.hf_config
        if not cfg.do_layer_norm_before or getattr(cfg, "_remove_final_layer_norm", False):
            self.norm = None
        width = cfg.word_embed_proj_dim
        self.project_in = self.project_out = None
        if width != cfg.hidden_size:  # on a pipeline stage: in on the first, out on the last
            stage = b.pipeline
            if not isinstance(self.embed_tokens, PPMissingLayer):
                self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, width, b.tp, b.dtype)
            self.project_in = Projection(width, cfg.hidden_size, b.dtype) if stage is None or stage.is_first \
                else PPMissingLayer()
            self.project_out = Projection(cfg.hidden_size, width, b.dtype) if stage is None or stage.is_last \
                else PPMissingLayer()

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        tokens = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.project_in is not None:
            tokens = self.project_in(tokens)
        return tokens + self.embed_positions(positions + self.position_offset)

    def final(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The stream joined (post-norm layers leave it joined), the final norm if any, the projection out."""
        if residual is not None:
            hidden = residual + hidden
        if self.norm is not None:
            hidden = self.norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTForCausalLM(GPT2LMHeadModel):
    """OPT: learned positions (offset 2), pre- or post-norm layers, a ReLU MLP, the LM head tied."""
    hf_decoder_prefix = "model."

    model_cls = OPTModel
    conv1d = fused_qkv = False
    embedding_checkpoint_name = "model.decoder.embed_tokens.weight"  # not GPT-2's (its loader takes both)

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "enable_bias", True))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bias, attention_scale=1.0)

    @classmethod
    def config_view(cls, hf_config: Any) -> Any:
        if not getattr(hf_config, "layer_norm_elementwise_affine", True):
            raise NotBuiltError("layer_norm_elementwise_affine", False, "OPT with LayerNorms without weights")
        config = super().config_view(hf_config)
        config.word_embed_proj_dim = getattr(hf_config, "word_embed_proj_dim", None) or hf_config.hidden_size
        return config

    @classmethod
    def gpt_names(cls, hf_config: Any) -> dict[str, Any]:
        return dict(intermediate_size=hf_config.ffn_dim, hidden_act=hf_config.activation_function,
                    rms_norm_eps=1e-5)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        prefixed = ((name if name.startswith(("model.", "lm_head.")) else "model." + name, w) for name, w in weights)
        return super(GPT2LMHeadModel, self).load_weights(renamed(renamed(prefixed, _OPT_NAMES), _LAYER_NAMES))
