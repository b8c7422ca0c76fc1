"""OpenAI GPT-2 (gpt2 ... gpt2-xl, DistilGPT2 and fine-tunes: ``GPT2LMHeadModel``) and BigCode GPTBigCode
(StarCoder / StarCoderBase, SantaCoder, WizardCoder: ``GPTBigCodeForCausalLM``).

Learned absolute positions added to the token embeddings (`LearnedPositionModel`; the attention turns q and k by
the identity rotary, exact), pre-LayerNorm layers with biases (StarCoder2's: asyncllm/models/starcoder2.py), a GELU
MLP and an LM head tied to the embeddings. GPT-2 stores its projections as ``Conv1D`` (``[in, out]``: transposed at
load) and its q, k, v as one ``c_attn`` (q rows, then k, then v); GPTBigCode stores ``nn.Linear`` and, with
``multi_query``, one KV head after the queries (multi-query attention), else each head's q, k, v together.
Their flags for a float32 softmax (``reorder_and_upcast_attn``, ``attention_softmax_in_fp32``) are not read: the
attention backends' softmax is float32 always (the triton kernels' scores too; the torch backend's scores are in the
model dtype, as transformers' default), so in bfloat16 they may round the scores differently.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import LoadedWeight, TensorParallel, head_dim_of, new_param
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaModel
from asyncllm.models.phi import renamed
from asyncllm.models.pipeline import PPMissingLayer
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.rotary import identity_rotary
from asyncllm.models.starcoder2 import BiasLayerNorm, GatelessMLP, Starcoder2DecoderLayer

__all__ = ["GPT2LMHeadModel", "GPTBigCodeForCausalLM", "LearnedPositionModel", "gpt_config_view"]

_GPT_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.embed_positions."),
              ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."))
_LAYER_INDEX = re.compile(r"transformer\.h\.(\d+)\.")
_LAYER_NAMES = ((".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                (".attn.c_proj.", ".self_attn.o_proj."), (".attn.c_attn.", ".self_attn.c_attn."))


def gpt_config_view(hf_config: Any, **fields: Any) -> Any:
    """The config under the Llama names the shared layers read (from GPT-2's ``n_inner``, ``activation_function``,
    ``layer_norm_epsilon``; one KV head per head), ``fields`` overriding them."""
    config = copy.copy(hf_config)
    names = dict(intermediate_size=getattr(hf_config, "n_inner", None) or 4 * hf_config.hidden_size,
                 hidden_act=getattr(hf_config, "activation_function", None),
                 rms_norm_eps=getattr(hf_config, "layer_norm_epsilon", 1e-5),
                 num_key_value_heads=hf_config.num_attention_heads)
    for name, value in {**names, **fields}.items():
        setattr(config, name, value)
    return config


class LearnedPositions(nn.Module):
    """A learned embedding per position (``weight [positions, width]``, whole on every rank)."""

    def __init__(self, num_positions: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(num_positions, width, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)


class LearnedPositionModel(LlamaModel):
    """`LlamaModel` whose token embeddings get a learned embedding of each position added (``embed_positions``,
    whole on every rank, on a pipeline's first stage only; ``position_offset`` rows before position 0: OPT's 2)."""

    position_offset = 0

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        cfg = b.hf_config
        first = b.pipeline is None or b.pipeline.is_first
        self.embed_positions = (LearnedPositions(cfg.max_position_embeddings + self.position_offset,
                                                 cfg.hidden_size, b.dtype) if first else PPMissingLayer())

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        tokens = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return tokens + self.embed_positions(positions + self.position_offset)


class GPT2Model(LearnedPositionModel):
    layer_cls = Starcoder2DecoderLayer
    norm_cls = BiasLayerNorm


class GPT2LMHeadModel(LlamaForCausalLM):
    """GPT-2: learned positions, pre-LayerNorm layers with biases, a GELU MLP, the LM head tied."""
    hf_decoder_prefix = "transformer."

    model_cls = GPT2Model
    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }
    conv1d = True
    """Whether the checkpoint's projections are ``Conv1D`` (``[in, out]``)."""
    fused_qkv = True
    """Whether the checkpoint's q, k and v are one ``c_attn`` (cut at load: no pre-quantized checkpoints)."""
    embedding_checkpoint_name = "transformer.wte.weight"
    """The token embedding's name in checkpoints (its loader takes no other): a pushed tied ``lm_head.weight`` is
    written under it (workers/pushed_weights.py)."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        scale = None if getattr(hf_config, "scale_attn_weights", True) else 1.0
        return DecoderFlags(qkv_bias=True, o_bias=True, mlp_bias=True, attention_scale=scale)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GatelessMLP(b)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return dataclasses.replace(build, rotary_emb=identity_rotary(hf_config, head_dim_of(hf_config), max_position))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            raise NotBuiltError("scale_attn_by_inverse_layer_idx", True, "GPT-2 with scores scaled per layer")
        if self.fused_qkv:
            check_phi3(hf_config, type(self).__name__.removesuffix("ForCausalLM"))  # c_attn is cut at load
        config = self.config_view(hf_config)
        super().__init__(config, **kwargs)
        self.head_dim, self.kv_size = head_dim_of(config), config.num_key_value_heads * head_dim_of(config)
        q_size = config.num_attention_heads * self.head_dim
        self.fused_parts: dict[str, list[tuple[object, int]]] = {
            "qkv_proj": [("q", q_size), ("k", self.kv_size), ("v", self.kv_size)]} if self.fused_qkv else {}
        """A LoRA adapter's ``c_attn`` (one A, one B over the fused rows; asyncllm/models/lora.py), its B rows put in
        q, k, v order by `lora_b_rows`; none for OPT (separate q, k, v)."""

    def lora_b_rows(self, name: str, weight: LoadedWeight) -> LoadedWeight:
        """An adapter's ``c_attn`` B as q's rows, k's, then v's (`qkv_rows`: GPTBigCode's per-head layout too)."""
        if ".self_attn.qkv_proj." not in name:
            return weight
        return torch.cat(self.qkv_rows(weight if isinstance(weight, torch.Tensor) else weight[:]))

    @classmethod
    def config_view(cls, hf_config: Any) -> Any:
        return gpt_config_view(hf_config, **cls.gpt_names(hf_config))

    @classmethod
    def gpt_names(cls, hf_config: Any) -> dict[str, Any]:
        """Config fields under the shared layers' names where the family's differ from GPT-2's."""
        return {}

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._split_qkv(renamed(renamed(self._gpt_weights(weights), _GPT_NAMES),
                                                            _LAYER_NAMES)))

    def _gpt_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """Names under ``transformer.`` (the older GPT-2 checkpoints have none), Conv1D matrices transposed, the
        causal-mask buffers of old checkpoints (``attn.bias``, ``attn.masked_bias``) dropped, and on a pipeline
        stage the other stages' layers (before the transposition and the q/k/v split would read them)."""
        for name, weight in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name
            layer = _LAYER_INDEX.match(name)
            if layer is not None and self.pipeline is not None and not self.pipeline.owns_layer(int(layer.group(1))):
                continue
            if self.conv1d and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
                full = weight if isinstance(weight, torch.Tensor) else weight[:]
                weight = full.t().contiguous()
            yield name, weight

    def _split_qkv(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """``self_attn.c_attn`` as ``q_proj`` / ``k_proj`` / ``v_proj``."""
        for name, weight in weights:
            if ".self_attn.c_attn." not in name:
                yield name, weight
                continue
            full = weight if isinstance(weight, torch.Tensor) else weight[:]
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), self.qkv_rows(full)):
                yield name.replace(".c_attn.", f".{part}."), rows

    def qkv_rows(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused q/k/v rows (weight or bias) as q, k and v: GPT-2's are q's, then k's, then v's."""
        return full.split([full.shape[0] - 2 * self.kv_size, self.kv_size, self.kv_size])


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPT-2's layers with ``nn.Linear`` projections and multi-query attention (one KV head)."""

    conv1d = False

    @classmethod
    def gpt_names(cls, hf_config: Any) -> dict[str, Any]:
        return dict(num_key_value_heads=1 if hf_config.multi_query else hf_config.num_attention_heads)

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """One KV head with ``multi_query`` (every layer alike)."""
        heads = 1 if hf_config.multi_query else hf_config.num_attention_heads
        return [(heads, head_dim_of(hf_config))] * hf_config.num_hidden_layers

    def qkv_rows(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Multi-query: the queries' rows, then the KV head's k and v rows; else each head's q, k, v together."""
        if self.kv_size < full.shape[0] // 3:
            return super().qkv_rows(full)
        per_head = full.view(-1, 3, self.head_dim, *full.shape[1:])
        return tuple(per_head[:, i].reshape(-1, *full.shape[1:]) for i in range(3))
