"""IBM Bamba (``BambaForCausalLM``: Bamba-9B v1 / v2): Granite 4.0's Mamba2 layers beside Llama attention (at
``attn_layer_indices``, rotating half of each head), each followed by a SwiGLU MLP, on the hybrid stack of
asyncllm/models/hybrid.py. Checkpoint names map to Llama's at load (``feed_forward`` -> ``mlp``,
``pre_ff_layernorm`` -> ``post_attention_layernorm``, ``final_layernorm`` -> ``norm``)."""

from __future__ import annotations

from typing import Any, Iterable

from asyncllm.models.hybrid import HybridBuild, HybridLayer, HybridModel, StateLayersMixin, renamed
from asyncllm.models.layers import LoadedWeight, RMSNorm
from asyncllm.models.llama import LlamaAttention, LlamaForCausalLM
from asyncllm.models.mamba2 import Mamba2Mixer, granite_mamba
from asyncllm.models.phi3 import check_phi3

__all__ = ["BambaForCausalLM"]

_NAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
          ("model.final_layernorm.", "model.norm."))


class BambaLayer(HybridLayer):
    state_name = "mamba"

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        cfg = b.hf_config
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)  # noqa: E731
        mixer = lambda: Mamba2Mixer(granite_mamba(cfg), b.dtype, b.state_rows, b.attn_backend.ops)  # noqa: E731
        super().__init__(b, layer_idx, norm, mixer, lambda: LlamaAttention(b, layer_idx))


class BambaModel(HybridModel):
    layer_cls = BambaLayer


class BambaForCausalLM(StateLayersMixin, LlamaForCausalLM):
    model_cls = BambaModel

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Bamba")
        super().__init__(hf_config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((renamed(name, _NAMES), w) for name, w in weights)
