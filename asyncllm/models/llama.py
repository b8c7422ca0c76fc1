"""The Llama-style decoder shared by Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

The families differ only by a few flags (`DecoderFlags`: attention biases, MLP
bias, per-head q/k RMSNorm, Granite's attention scale and residual multiplier),
all read from the HF config; qwen2.py, qwen3.py and granite.py just set them.
Module and parameter names mirror transformers' so checkpoint names map one to
one, except the fused ``qkv_proj`` and ``gate_up_proj``
(see ``packed_modules``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from asyncllm import envs
from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.models.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.models.layers import Attention, RMSNorm, TensorParallel, head_dim_of, norm_in
from asyncllm.models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.models.llama_weights import LlamaWeights
from asyncllm.models.pipeline import PipelineStage, PPMissingLayer
from asyncllm.models.rotary import RotaryEmbedding, identity_rotary

__all__ = ["DecoderBuild", "DecoderFlags", "LlamaForCausalLM", "LlamaMLP", "check_silu", "sliding_window_of",
           "with_rope_only_in"]


@dataclass(frozen=True)
class DecoderFlags:
    """What distinguishes one Llama-style family from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attention_scale: float | None = None
    """The attention scores' scale (Granite's ``attention_multiplier``); None: ``head_dim ** -0.5``."""
    residual_multiplier: float = 1.0
    """Each attention and MLP output is scaled by it before it joins the residual stream (Granite)."""


def sliding_window_of(hf_config: Any, layer_idx: int) -> int | None:
    """The layer's attention window: per layer via ``layer_types`` (Qwen2/3), else the
    model-wide ``sliding_window`` (Mistral), else None (full attention)."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def check_silu(hf_config: Any) -> None:
    """`NotBuiltError` unless the MLPs' activation is SiLU (the gated SiLU MLP is the one built)."""
    if hf_config.hidden_act != "silu":
        raise NotBuiltError("hidden_act", hf_config.hidden_act,
                            f"the {hf_config.hidden_act!r} MLP activation (only 'silu')")


@dataclass(frozen=True)
class DecoderBuild:
    """Everything a layer needs to build itself besides the HF config."""

    hf_config: Any
    flags: DecoderFlags
    dtype: torch.dtype
    tp: TensorParallel
    attn_backend: AttentionBackend
    rotary_emb: RotaryEmbedding
    make_mlp: Callable[[DecoderBuild, int], nn.Module]
    """The layer's MLP from (this build, layer index): `LlamaForCausalLM.make_mlp`, a mixture of experts in
    MoE families (asyncllm/models/moe.py)."""
    expert_parallel: bool = False
    """MoE layers split their experts over the TP ranks instead of each expert's intermediate dim."""
    pipeline: PipelineStage | None = dataclasses.field(default=None, kw_only=True)
    """This rank's pipeline stage: the decoder builds only its parts (asyncllm/models/pipeline.py); None: all."""
    layer_rotary: tuple[RotaryEmbedding, ...] | None = dataclasses.field(default=None, kw_only=True)
    """Each layer's rotary embedding where layers differ (SmolLM3's layers without rope, OLMo 3's rope per layer
    type); None: `rotary_emb` in every layer."""


def with_rope_only_in(build: DecoderBuild, uses_rope: Iterable[bool], max_position: int) -> DecoderBuild:
    """``build`` whose layers with ``uses_rope[i]`` false turn q and k by nothing (`identity_rotary`, exact): layers
    without positions (SmolLM3's NoPE layers, EXAONE 4's and Cohere2's full layers, Hunyuan's, which rotate
    themselves), through the same backends, kernels and CUDA graphs."""
    nope = identity_rotary(build.hf_config, head_dim_of(build.hf_config), max_position)
    return dataclasses.replace(build, layer_rotary=tuple(build.rotary_emb if use else nope for use in uses_rope))


class LlamaAttention(nn.Module):
    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, b.flags.qkv_bias, b.tp, b.dtype
        )
        o_input_size = cfg.num_attention_heads * head_dim
        self.o_proj = RowParallelLinear(o_input_size, cfg.hidden_size, b.flags.o_bias, b.tp, b.dtype)
        if b.flags.qk_norm:  # per-head norms: their weights ride in RotaryInputs, the backend runs them
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)
        self.qk_norm = b.flags.qk_norm
        self.rotary_emb = b.rotary_emb if b.layer_rotary is None else b.layer_rotary[layer_idx]
        qkv = self.qkv_proj
        window = sliding_window_of(cfg, layer_idx)
        self.attn = Attention(qkv.num_heads, qkv.num_kv_heads, head_dim, b.attn_backend, window,
                              scale=b.flags.attention_scale)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), kv_cache, metadata)

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Attention and the output projection, from the QKV projection's output."""
        return self.o_proj(self.attention_values(positions, qkv, kv_cache, metadata))

    def attention_values(
        self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`attend` before the output projection: the heads' values ``[T, Hq * D]``."""
        query, key, value = self.qkv_proj.split_qkv(qkv)
        query, key = self.norm_qk(query, key)
        return self.attn(query, key, value, kv_cache, metadata, self._rotary_inputs(positions))

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as the backend takes them: as projected here; a family whose q/k norms the backend's fused
        per-head norm cannot run (OLMo 2's span every head) norms them in an override."""
        return query, key

    def _rotary_inputs(self, positions: torch.Tensor) -> RotaryInputs:
        """The backend norms (Qwen3) and rotates q and k itself, fused with the KV write on the triton
        backend: one launch instead of three."""
        if not self.qk_norm:
            return RotaryInputs(positions, self.rotary_emb.cos_sin_cache)
        return RotaryInputs(positions, self.rotary_emb.cos_sin_cache, self.q_norm.weight, self.k_norm.weight,
                            self.q_norm.eps)


class LlamaMLP(nn.Module):
    def __init__(self, b: DecoderBuild, intermediate_size: int | None = None) -> None:
        super().__init__()
        cfg = b.hf_config
        check_silu(cfg)
        size = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], b.flags.mlp_bias, b.tp, b.dtype)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, b.flags.mlp_bias, b.tp, b.dtype)
        self.silu_and_mul = b.attn_backend.ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    """What a family may swap (gpt-oss: attention sinks), same constructor arguments."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.self_attn = self.attention_cls(b, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.mlp = b.make_mlp(b, layer_idx)
        self.residual_multiplier = b.flags.residual_multiplier
        self.fused_decode_rows = 0
        """Steps of at most this many tokens run `forward_fused_decode` (0: none; ASYNCLLM_DECODE_LINEAR)."""
        dense = isinstance(self.mlp, LlamaMLP)
        if dense and b.attn_backend.name == "triton" and b.tp.size == 1 and envs.DECODE_LINEAR.get():
            from asyncllm.kernels import decode_linear  # imported only then: it imports triton

            self.fused_decode_rows = decode_linear.FUSED_ROWS
            self.decode_linear = decode_linear.decode_linear

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it): the next norm adds them."""
        if hidden.shape[0] <= self.fused_decode_rows:
            return self.forward_fused_decode(positions, hidden, residual, kv_cache, metadata)
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        hidden = self.to_residual(self.self_attn(positions, hidden, kv_cache, metadata))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.to_residual(self.mlp(hidden)), residual

    def to_residual(self, out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream: times Granite's ``residual_multiplier`` (rounded
        to the dtype, as transformers' ``residual + out * m``) before the next norm's fused add takes it."""
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    def forward_fused_decode(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a few rows: each norm and the SiLU-and-mul run inside the product after them, and the
        output projection too unless the attention changes `attend`. The first layer (``residual`` None: no add)
        runs its input norm on its own before a plain QKV product."""
        attn, mlp, norm, decode_linear = self.self_attn, self.mlp, self.input_layernorm, self.decode_linear
        if residual is None:
            hidden, residual = norm_in(norm, hidden, residual)
            qkv = decode_linear(hidden, attn.qkv_proj.weight, attn.qkv_proj.bias)
        else:
            qkv, residual = decode_linear(hidden, attn.qkv_proj.weight, attn.qkv_proj.bias, "add_rms_norm",
                                          residual, norm.weight, norm.eps)
        if type(attn).attend is LlamaAttention.attend:
            values = attn.attention_values(positions, qkv, kv_cache, metadata)
            hidden = self.to_residual(decode_linear(values, attn.o_proj.weight, attn.o_proj.bias))
        else:
            hidden = self.to_residual(attn.attend(positions, qkv, kv_cache, metadata))
        norm = self.post_attention_layernorm
        gate_up, residual = decode_linear(hidden, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, "add_rms_norm",
                                          residual, norm.weight, norm.eps)
        out = decode_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, "silu_and_mul")
        return self.to_residual(out), residual


class LlamaModel(nn.Module):
    # what a family may swap (asyncllm/models/gemma.py): same constructor arguments
    embedding_cls: type[VocabParallelEmbedding] = VocabParallelEmbedding
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    aux_layers: tuple[int, ...] = ()
    """Layers whose inputs each forward keeps in ``aux_hidden`` (by layer index; an EAGLE-3 head reads them:
    workers/eagle_runner.py); none by default."""

    @classmethod
    def layer_class(cls, hf_config: Any) -> type[nn.Module]:
        """The layers' class: ``layer_cls``, or one a config flag picks (GPT-NeoX's, StableLM's parallel
        residual; Falcon's and OPT's layer shapes)."""
        return cls.layer_cls

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__()
        cfg, stage = b.hf_config, b.pipeline  # a pipeline stage: placeholders for the parts other stages hold
        embeds = stage is None or stage.holds_embeddings(bool(getattr(cfg, "tie_word_embeddings", False)))
        last = stage is None or stage.is_last
        self.embed_tokens = (self.embedding_cls(cfg.vocab_size, cfg.hidden_size, b.tp, b.dtype) if embeds
                             else PPMissingLayer())
        layer_cls = self.layer_class(cfg)
        self.layers = nn.ModuleList(layer_cls(b, i) if stage is None or stage.owns_layer(i) else PPMissingLayer()
                                    for i in range(cfg.num_hidden_layers))
        self.norm = (self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops) if last
                     else PPMissingLayer())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids, positions, inputs_embeds)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if self.aux_layers:  # an EAGLE-3 head reads some layers' inputs
                self.keep_aux(i, hidden, residual)
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        return self.final(hidden, residual)

    def keep_aux(self, i: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Keep the residual stream entering layer ``i`` where it is one of ``aux_layers`` (a layer loop calls this
        before each layer when there are any)."""
        if i == 0:
            self.aux_hidden: dict[int, torch.Tensor] = {}
        if i in self.aux_layers:
            self.aux_hidden[i] = hidden.clone() if residual is None else hidden + residual  # not updated in place

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input: the tokens' embeddings (GPT-2's add their positions'; a pipeline's first stage
        runs this alone)."""
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    def final(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's output and the stream joined, then the final norm (a pipeline's last stage)."""
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def layer_positions(self, positions: torch.Tensor) -> ContextManager[torch.Tensor]:
        """The positions the layers rotate at, for a step at ``positions``: these (Qwen2-VL's decoder swaps in
        the step's M-RoPE table for ``[3, T]`` ones); a pipeline stage runs its layers inside it."""
        return contextlib.nullcontext(positions)


class LlamaForCausalLM(LlamaWeights, nn.Module):
    """Llama-style causal LM over a paged KV cache (one cache tensor per layer)."""

    has_lm_head = True
    is_moe = False
    """True for mixture-of-experts families (asyncllm/models/moe.py): they take ``expert_parallel``."""
    """False for a bare decoder's checkpoint (``LlamaModel`` & co.: names without ``model.``, no ``lm_head``):
    its LM head stays zero, and the host refuses generation (`headless`)."""
    lm_head_bias = False
    """Whether the LM head has a bias (Phi's; `has_lm_head_bias` where the config says)."""
    model_cls: type[LlamaModel] = LlamaModel
    """The decoder stack (embeddings, layers, final norm) under ``model.``."""
    hf_decoder_prefix = "model."
    """The decoder's names' prefix in a causal LM checkpoint (GPT-2's ``transformer.``, GPT-NeoX's ``gpt_neox.``): a
    bare decoder's checkpoint lacks it (`asyncllm.models.registry.headless` puts it back)."""

    # fused parameter -> the checkpoint matrices stacked in it, with their shard ids
    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    @classmethod
    def has_lm_head_bias(cls, hf_config: Any) -> bool:
        """Whether the LM head has a bias: ``lm_head_bias`` (Phi-3.5-MoE: its config's)."""
        return cls.lm_head_bias

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s MLP: the dense gated SiLU MLP in every layer."""
        return LlamaMLP(b)

    @classmethod
    def decoder_build(
        cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend, max_position: int,
        expert_parallel: bool,
    ) -> DecoderBuild:
        """What every layer is built from (a family with more to hand its layers returns a subclass)."""
        rotary_emb = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_position)
        return DecoderBuild(hf_config, cls.decoder_flags(hf_config), dtype, tp, attn_backend, rotary_emb,
                            cls.make_mlp, expert_parallel)

    def __init__(
        self,
        hf_config: Any,
        *,
        dtype: torch.dtype,
        tp: TensorParallel,
        attn_backend: AttentionBackend,
        max_position: int,
        expert_parallel: bool = False,
        pipeline: PipelineStage | None = None,
    ) -> None:
        """``pipeline``: this rank's stage, which builds only its parts (asyncllm/models/pipeline.py)."""
        super().__init__()
        build = self.decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        if pipeline is not None:
            build = dataclasses.replace(build, pipeline=pipeline)
        self.pipeline = pipeline
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = self.model_cls(build)
        if pipeline is not None and not pipeline.is_last:
            self.lm_head = PPMissingLayer()
            return
        tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, dtype, tied_to,
                                      bias=self.has_lm_head_bias(hf_config))
        if not self.has_lm_head and tied_to is None:
            nn.init.zeros_(self.lm_head.weight)  # never loaded: finite logits for the embedding path's dropped token

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T]`` token ids at ``[T]`` positions -> final hidden states ``[T, hidden]``.

        ``inputs_embeds`` (``[T, hidden]``) replaces the token embeddings: a multimodal
        model passes its text embeddings with encoder outputs scattered in (asyncllm/mm/)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` embeddings (what `forward` starts from)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits over the full vocabulary (on every rank)."""
        return self.lm_head(hidden).float()
