"""MosaicML MPT (mpt-7b / 30b and their -instruct, -chat, -storywriter fine-tunes): ``MptForCausalLM``.

ALiBi positions (asyncllm/models/alibi.py: MPT's slopes, ``attn_config.alibi_bias_max``) in pre-LayerNorm layers
without biases (``no_bias``; LayerNorms with a weight only, DBRX's: asyncllm/models/dbrx.py), the fused ``Wqkv``
(q's rows, then k's, then v's) clamped to ``[-clip_qkv, clip_qkv]`` when set, the scores scaled by
``attn_config.softmax_scale`` (default ``head_dim ** -0.5``), an exact-GELU MLP ``expansion_ratio`` times as wide
as the model, and an LM head tied to the embeddings. ``Wqkv`` is cut into q, k and v at load; a LoRA adapter's
``Wqkv`` keeps that order (one A, one B over the fused rows). The longest sequence is ``max_seq_len``
(asyncllm/models/architectures.py `max_positions`). ``alibi_bias_max`` is read as MPT's own code and vLLM read it
(transformers' MPT keeps the default 8 whatever the config says; the released checkpoints all have 8).

What the engine does not build is refused by name (`NotBuiltError`): learned positions instead of ALiBi
(``attn_config.alibi`` false), ``qk_ln``, ``prefix_lm``, attention types other than multi-head, biases
(``no_bias`` false), ``logit_scale``, norms other than LayerNorm, pre-quantized checkpoints (``Wqkv`` is cut at
load). Read and without effect at inference:
``learned_pos_emb`` (MPT builds no position table beside ALiBi), ``embedding_fraction`` (scales gradients only),
``attn_impl`` and ``attn_uses_sequence_id`` (packed training sequences).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.alibi import alibi_build, mpt_alibi_slopes
from asyncllm.models.bloom import BloomDecoderLayer
from asyncllm.models.dbrx import WeightLayerNorm
from asyncllm.models.gpt2 import gpt_config_view
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaModel
from asyncllm.models.phi import renamed
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.starcoder2 import GatelessMLP

__all__ = ["MptForCausalLM", "check_mpt"]

_TOP_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
              ("transformer.blocks.", "model.layers."))
_LAYER_NAMES = ((".norm_1.", ".input_layernorm."), (".norm_2.", ".post_attention_layernorm."),
                (".attn.out_proj.", ".self_attn.o_proj."), (".attn.Wqkv.", ".self_attn.Wqkv."),
                (".ffn.up_proj.", ".mlp.c_fc."), (".ffn.down_proj.", ".mlp.c_proj."))
_REFUSED = (("alibi", False, "MPT with learned positions instead of ALiBi"), ("qk_ln", True, "MPT's q/k LayerNorms"),
            ("prefix_lm", True, "MPT as a prefix LM (bidirectional prefixes)"))
"""attn_config fields (name, the value refused, what it would take)."""


class MptDecoderLayer(BloomDecoderLayer):
    """BLOOM's layer under LayerNorms without a bias."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.input_layernorm = WeightLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.post_attention_layernorm = WeightLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)


class MptModel(LlamaModel):
    layer_cls = MptDecoderLayer
    norm_cls = WeightLayerNorm


class MptForCausalLM(LlamaForCausalLM):
    """ALiBi attention without biases, a clamped fused q/k/v, bias-free LayerNorms, a GELU MLP, the LM head tied."""
    hf_decoder_prefix = "transformer."

    model_cls = MptModel
    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(attention_scale=hf_config.attn_config.softmax_scale)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GatelessMLP(b)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        """No rotary embedding: ALiBi's slopes instead, every head's (each rank takes its own)."""
        attn = hf_config.attn_config
        slopes = mpt_alibi_slopes(hf_config.num_attention_heads, float(attn.alibi_bias_max))
        return alibi_build(cls, hf_config, dtype, tp, attn_backend, expert_parallel, slopes, attn.clip_qkv or None)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "MPT")  # Wqkv is cut at load
        check_mpt(hf_config)
        config = gpt_config_view(hf_config, intermediate_size=int(hf_config.expansion_ratio * hf_config.hidden_size),
                                 hidden_act="gelu")
        super().__init__(config, **kwargs)
        rows = config.hidden_size
        self.fused_parts: dict[str, list[tuple[object, int]]] = {"qkv_proj": [("q", rows), ("k", rows), ("v", rows)]}
        """A LoRA adapter's ``Wqkv`` (one A, one B over q's, k's, then v's rows; asyncllm/models/lora.py)."""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(_split_wqkv(renamed(renamed(weights, _TOP_NAMES), _LAYER_NAMES)))


def check_mpt(hf_config: Any) -> None:
    """`NotBuiltError` naming the first MPT variant the engine does not build."""
    attn = hf_config.attn_config
    for field, refused, what in _REFUSED:
        if bool(getattr(attn, field, not refused)) == refused:
            raise NotBuiltError(f"attn_config.{field}", refused, what)
    if getattr(attn, "attn_type", "multihead_attention") != "multihead_attention":
        raise NotBuiltError("attn_config.attn_type", attn.attn_type, "MPT with multi-head attention only")
    if not getattr(hf_config, "no_bias", True):
        raise NotBuiltError("no_bias", False, "MPT with biases (transformers' MPT has none either)")
    if getattr(hf_config, "logit_scale", None) is not None:
        raise NotBuiltError("logit_scale", hf_config.logit_scale, "MPT with scaled logits")
    if getattr(hf_config, "norm_type", "low_precision_layernorm") not in ("low_precision_layernorm", "layernorm"):
        raise NotBuiltError("norm_type", hf_config.norm_type, "MPT with LayerNorms ('low_precision_layernorm')")


def _split_wqkv(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """``self_attn.Wqkv`` (q's rows, then k's, then v's: one KV head per head) as ``q_proj`` / ``k_proj`` /
    ``v_proj``."""
    for name, weight in weights:
        if ".self_attn.Wqkv." not in name:
            yield name, weight
            continue
        full = weight if isinstance(weight, torch.Tensor) else weight[:]
        for part, rows in zip(("q_proj", "k_proj", "v_proj"), full.chunk(3)):
            yield name.replace(".Wqkv.", f".{part}."), rows
