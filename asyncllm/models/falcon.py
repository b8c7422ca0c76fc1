"""TII Falcon (falcon-7b / 40b / 180b and their -instruct, Falcon2-11B, falcon-rw-1b / 7b: ``FalconForCausalLM``).

Rotary attention (full heads, half-split) with LayerNorms that have biases, a GELU MLP (``dense_h_to_4h`` /
``dense_4h_to_h``) and an LM head tied to the embeddings, in one of three layer shapes:

- ``new_decoder_architecture`` (40B, 180B, Falcon2): attention and the MLP side by side, each after its own
  LayerNorm (``ln_attn``, ``ln_mlp``; one shared when ``num_ln_in_parallel_attn`` is 1), grouped KV heads
  (``num_kv_heads``) whose fused ``query_key_value`` holds, per KV head, its queries, then its key and value;
- ``parallel_attn`` (7B): one LayerNorm before both, multi-query attention (``multi_query``: the queries' rows,
  then the one key and value);
- neither: Llama's sequential layers.

The fused q/k/v is cut into q, k and v at load (asyncllm/models/parallel_residual.py runs the parallel layers).
``alibi`` (falcon-rw): ALiBi instead of rotary positions (asyncllm/models/alibi.py), BLOOM's slopes rounded to bfloat16
and divided by ``sqrt(head_dim)``, since Falcon adds the bias before scaling the scores; built in falcon-rw's layout
(sequential layers, a KV head per head), a `NotBuiltError` in the others (no checkpoint has them).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.alibi import AlibiAttention, alibi_build, falcon_alibi_slopes
from asyncllm.models.gpt2 import gpt_config_view
from asyncllm.models.layers import LoadedWeight, TensorParallel, head_dim_of
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaModel
from asyncllm.models.parallel_residual import ParallelResidualLayer
from asyncllm.models.phi import renamed
from asyncllm.models.family_config import falcon_kv_heads
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.starcoder2 import BiasLayerNorm, GatelessMLP, Starcoder2DecoderLayer

__all__ = ["FalconForCausalLM"]

_FALCON_NAMES = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                 ("transformer.h.", "model.layers."))
_LAYER_NAMES = ((".self_attention.dense.", ".self_attn.o_proj."),
                (".self_attention.query_key_value.", ".self_attn.query_key_value."),
                (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
                (".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".post_attention_layernorm."))


class FalconOneNormLayer(ParallelResidualLayer):
    pass


class FalconTwoNormLayer(ParallelResidualLayer):
    two_norms = True


class FalconAlibiLayer(Starcoder2DecoderLayer):
    attention_cls = AlibiAttention


class FalconModel(LlamaModel):
    norm_cls = BiasLayerNorm

    @classmethod
    def layer_class(cls, hf_config: Any) -> type[nn.Module]:
        two = hf_config.new_decoder_architecture and (getattr(hf_config, "num_ln_in_parallel_attn", None) or 2) == 2
        if not (hf_config.parallel_attn or hf_config.new_decoder_architecture):
            return FalconAlibiLayer if hf_config.alibi else Starcoder2DecoderLayer
        return FalconTwoNormLayer if two else FalconOneNormLayer


class FalconForCausalLM(LlamaForCausalLM):
    """Falcon's three layer shapes over LayerNorms, a GELU MLP, fused q/k/v cut at load."""
    hf_decoder_prefix = "transformer."

    model_cls = FalconModel
    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(hf_config.bias)
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GatelessMLP(b)

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        return [(falcon_kv_heads(hf_config), head_dim_of(hf_config))] * hf_config.num_hidden_layers

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        """Rotary's, or with ``alibi`` Falcon's slopes for every head (each rank takes its own)."""
        if not hf_config.alibi:
            return super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        slopes = falcon_alibi_slopes(hf_config.num_attention_heads, head_dim_of(hf_config))
        return alibi_build(cls, hf_config, dtype, tp, attn_backend, expert_parallel, slopes)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        layout = [f for f in ("new_decoder_architecture", "parallel_attn", "multi_query") if getattr(hf_config, f)]
        if hf_config.alibi and layout:
            raise NotBuiltError(layout[0], True, "Falcon with ALiBi in falcon-rw's layout (sequential layers, a KV "
                                                 "head per head)")
        check_phi3(hf_config, "Falcon")  # the fused q/k/v is cut at load
        config = gpt_config_view(hf_config, intermediate_size=getattr(hf_config, "ffn_hidden_size", None)
                                 or 4 * hf_config.hidden_size, hidden_act=hf_config.activation,
                                 rms_norm_eps=hf_config.layer_norm_epsilon,
                                 num_key_value_heads=falcon_kv_heads(hf_config))
        super().__init__(config, **kwargs)
        self.head_dim, self.kv_heads = head_dim_of(config), config.num_key_value_heads
        self.per_kv_head = config.num_attention_heads // self.kv_heads + 2 if config.new_decoder_architecture else 0
        q_rows, kv_rows = config.num_attention_heads * self.head_dim, self.kv_heads * self.head_dim
        self.fused_parts: dict[str, list[tuple[object, int]]] = {"qkv_proj": [("q", q_rows), ("k", kv_rows),
                                                                              ("v", kv_rows)]}
        """A LoRA adapter's ``query_key_value`` (one A, one B over the fused rows; asyncllm/models/lora.py), its B
        rows put in q, k, v order by `lora_b_rows`."""

    def lora_b_rows(self, name: str, weight: LoadedWeight) -> LoadedWeight:
        """An adapter's ``query_key_value`` B as q's rows, k's, then v's (`_qkv_rows`: each of the three layouts)."""
        if ".self_attn.qkv_proj." not in name:
            return weight
        return torch.cat(self._qkv_rows(weight if isinstance(weight, torch.Tensor) else weight[:]))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        named = renamed(renamed(weights, _FALCON_NAMES), _LAYER_NAMES)
        return super().load_weights(self._split_qkv(named))

    def _split_qkv(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        for name, weight in weights:
            if ".self_attn.query_key_value." not in name:
                yield name, weight
                continue
            full = weight if isinstance(weight, torch.Tensor) else weight[:]
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), self._qkv_rows(full)):
                yield name.replace(".query_key_value.", f".{part}."), rows

    def _qkv_rows(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused rows (weight or bias) as q, k, v in Llama's order (all queries, then keys, then values)."""
        rest = full.shape[1:]
        if self.per_kv_head:  # per KV head: its queries, its key, its value
            groups = full.view(self.kv_heads, self.per_kv_head, self.head_dim, *rest)
            return (groups[:, :-2].reshape(-1, *rest), groups[:, -2].reshape(-1, *rest),
                    groups[:, -1].reshape(-1, *rest))
        if self.kv_heads == 1:  # multi-query: the queries, then the key and the value
            kv = self.head_dim
            return full.split([full.shape[0] - 2 * kv, kv, kv])
        heads = full.view(-1, 3, self.head_dim, *rest)  # one KV head per head: each head's q, k, v together
        return tuple(heads[:, i].reshape(-1, *rest) for i in range(3))
