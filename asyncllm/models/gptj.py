"""EleutherAI GPT-J (gpt-j-6b and fine-tunes: ``GPTJForCausalLM``).

Phi's parallel layers (asyncllm/models/parallel_residual.py: one LayerNorm, ``(attn + mlp) + x``) with q, k, v and
the output projection without biases, a GELU MLP (``fc_in`` / ``fc_out``) with biases, an LM head with a bias, and a
rotary over the first ``rotary_dim`` dims of each head on interleaved pairs, run as half-split by reordering the q
and k rows at load (`InterleavedRotaryLoading`, as GLM's). The ``transformer.`` names are mapped at load.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from asyncllm.models.glm4 import InterleavedRotaryLoading
from asyncllm.models.gpt2 import gpt_config_view
from asyncllm.models.layers import LoadedWeight, head_dim_of
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM
from asyncllm.models.phi import PhiModel, renamed
from asyncllm.models.starcoder2 import GatelessMLP

__all__ = ["GPTJForCausalLM"]

_GPTJ_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
               ("transformer.h.", "model.layers."))
_LAYER_NAMES = ((".ln_1.", ".input_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."),
                (".mlp.fc_in.", ".mlp.c_fc."), (".mlp.fc_out.", ".mlp.c_proj."))


class GPTJForCausalLM(InterleavedRotaryLoading, LlamaForCausalLM):
    """Parallel layers, an interleaved partial rotary (reordered at load), a GELU MLP, a biased LM head."""
    hf_decoder_prefix = "transformer."

    model_cls = PhiModel
    lm_head_bias = True

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(mlp_bias=True)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GatelessMLP(b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        head_dim = head_dim_of(hf_config)
        rotary = getattr(hf_config, "rotary_dim", None) or head_dim
        config = gpt_config_view(hf_config, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                             "partial_rotary_factor": rotary / head_dim})
        super().__init__(config, **kwargs)
        self.reorder_rotary_rows(config)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        kept = ((name, w) for name, w in weights if not name.endswith((".attn.bias", ".attn.masked_bias")))
        return super().load_weights(renamed(renamed(kept, _GPTJ_NAMES), _LAYER_NAMES))
