"""The rotary BERTs' configs (asyncllm/models/rotary_bert.py), read on the host without torch.

NomicBERT's (nomic-embed-text): the checkpoints on the hub keep the original remote code's GPT-2-style names (``n_embd``, ``n_head``, ``n_layer``, ``n_inner``, ``rotary_emb_base``,
``layer_norm_epsilon``, ``max_trained_positions``), which transformers' own ``NomicBertConfig`` does not read (it
keeps its defaults beside them). `nomic_bert_config` copies them onto transformers' names, so the host and the
workers read one set, and refuses by name what asyncllm does not build (vLLM's checks for the architecture).
GTE's (transformers' ``gte``, Alibaba's remote-code ``new``): its remote code's options other than the ones its
published checkpoints use are refused by name (`rotary_bert_config`)."""

from __future__ import annotations

from typing import Any

from asyncllm.errors import NotBuiltError

__all__ = ["rotary_bert_config", "nomic_bert_config"]

_ORIGINAL_NAMES = (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"),
                   ("n_inner", "intermediate_size"), ("layer_norm_epsilon", "layer_norm_eps"),
                   ("max_trained_positions", "max_position_embeddings"))
"""The remote code's names -> transformers'. The positions served are the trained ones (2048), not ``n_positions``
(8192): vLLM's default too, which leaves context extension to an explicit rope override."""
_REFUSED = (("prenorm", False, "pre-LN layers"), ("qkv_proj_bias", False, "projection biases"),
            ("mlp_fc1_bias", False, "MLP biases"), ("mlp_fc2_bias", False, "MLP biases"),
            ("rotary_emb_fraction", 1.0, "partial rotary embeddings"),
            ("rotary_emb_interleaved", False, "interleaved rotary embeddings"),
            ("rotary_emb_scale_base", None, "xPos rotary scaling"), ("moe_every_n_layers", 0, "expert layers"),
            ("parallel_block", False, "parallel attention and MLP blocks"), ("use_rms_norm", False, "RMSNorm"))
"""(key, the one value built, what another value means): nomic-embed-text v1 / v1.5 use the built ones."""


_GTE_BUILT = (("position_embedding_type", "rope"), ("layer_norm_type", "layer_norm"), ("logn_attention_scale", False),
              ("pack_qkv", True))
"""GTE's remote-code options (key, the value built): what gte-multilingual-base and gte-*-en-v1.5 set."""


def rotary_bert_config(config: Any) -> Any:
    """`nomic_bert_config` of a NomicBERT config; a GTE config (``gte``, ``new``) checked against `_GTE_BUILT`; any
    other config unchanged."""
    model_type = getattr(config, "model_type", None)
    if model_type in ("gte", "new"):
        for key, built in _GTE_BUILT:
            value = getattr(config, key, built)
            if value != built:
                raise NotBuiltError("model", {key: value}, f"GTE with {key}={value!r} (built: {built!r})")
    return nomic_bert_config(config)


def nomic_bert_config(config: Any) -> Any:
    """A ``nomic_bert`` config with its remote-code names copied onto transformers' (in place), the activation
    (``activation_function: swiglu``) as ``hidden_act`` ``silu`` and ``rotary_emb_base`` as the rope theta; a
    `NotBuiltError` naming a setting asyncllm does not build. Any other config unchanged."""
    if getattr(config, "model_type", None) != "nomic_bert":
        return config
    for key, built, what in _REFUSED:
        value = getattr(config, key, built)
        if value != built and not (key == "moe_every_n_layers" and not value):
            raise NotBuiltError("model", {key: value}, f"NomicBERT with {what} ({key}={value!r}; built: {built!r})")
    activation = getattr(config, "activation_function", None)
    if activation is not None and activation != "swiglu":
        raise NotBuiltError("model", {"activation_function": activation}, "NomicBERT with a non-gated MLP (built: "
                                                                          "activation_function='swiglu')")
    for original, name in _ORIGINAL_NAMES:
        if getattr(config, original, None) is not None:
            setattr(config, name, getattr(config, original))
    if activation == "swiglu":
        config.hidden_act = "silu"
    config.head_dim = config.hidden_size // config.num_attention_heads
    base = getattr(config, "rotary_emb_base", None)
    if base is not None:
        config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), "rope_theta": float(base)}
    return config
