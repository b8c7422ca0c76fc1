"""BigScience BLOOM (bloom-560m ... bloom-176b, bloomz, and their fine-tunes): ``BloomForCausalLM``.

ALiBi positions (asyncllm/models/alibi.py: BLOOM's slopes, any head count) in pre-LayerNorm layers with biases
(StarCoder2's: asyncllm/models/starcoder2.py), a LayerNorm after the token embeddings
(``word_embeddings_layernorm``), a tanh-GELU MLP four times as wide as the model, and an LM head tied to the
embeddings. The checkpoint's fused ``query_key_value`` holds each head's q, k and v rows together, GPT-NeoX's
layout: it is cut as GPT-NeoX's is (asyncllm/models/gpt_neox.py), at load and for LoRA adapters. Checkpoints
written without the ``transformer.`` prefix (the bigscience releases) load as well.

``pretraining_tp`` only sliced Megatron's products; ``slow_but_exact`` (those slices' rounding order) and
``apply_residual_connection_post_layernorm`` (the residual taken after the norm) are `NotBuiltError`s, as are
pre-quantized checkpoints (their fused matrix is cut at load).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.errors import NotBuiltError
from asyncllm.models.alibi import AlibiAttention, alibi_build, bloom_alibi_slopes
from asyncllm.models.gpt2 import gpt_config_view
from asyncllm.models.gpt_neox import GPTNeoXForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import DecoderBuild, LlamaModel
from asyncllm.models.phi import renamed
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.pipeline import PPMissingLayer
from asyncllm.models.starcoder2 import BiasLayerNorm, Starcoder2DecoderLayer

__all__ = ["BloomForCausalLM", "BloomModel"]

_BLOOM_NAMES = (("transformer.word_embeddings_layernorm.", "model.embed_norm."),
                ("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                ("transformer.h.", "model.layers."))
_ATTENTION_NAME = ((".self_attention.", ".attention."),)
"""BLOOM's attention under GPT-NeoX's name, whose loader cuts its q/k/v and renames its output projection."""


class BloomDecoderLayer(Starcoder2DecoderLayer):
    attention_cls = AlibiAttention


class BloomModel(LlamaModel):
    """`LlamaModel` whose token embeddings are LayerNormed (``embed_norm``, on a pipeline's first stage)."""

    layer_cls = BloomDecoderLayer
    norm_cls = BiasLayerNorm

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        cfg = b.hf_config
        first = b.pipeline is None or b.pipeline.is_first
        self.embed_norm = BiasLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype) if first else PPMissingLayer()

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed_norm(super().embed(input_ids, positions, inputs_embeds))


class BloomForCausalLM(GPTNeoXForCausalLM):
    """ALiBi attention with biases, LayerNorms (one after the embeddings), a GELU MLP, the LM head tied."""
    hf_decoder_prefix = "transformer."

    model_cls = BloomModel
    embedding_checkpoint_name = "transformer.word_embeddings.weight"
    """The token embedding's name in checkpoints: a pushed tied ``lm_head.weight`` is written under it
    (workers/pushed_weights.py)."""

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        """No rotary embedding: ALiBi's slopes instead, every head's (each rank takes its own)."""
        slopes = bloom_alibi_slopes(hf_config.n_head)
        return alibi_build(cls, hf_config, dtype, tp, attn_backend, expert_parallel, slopes)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "BLOOM")  # the fused q/k/v is cut at load
        for field in ("slow_but_exact", "apply_residual_connection_post_layernorm"):
            if getattr(hf_config, field, False):
                raise NotBuiltError(field, True, f"BLOOM with {field} (the released checkpoints have it off)")
        config = gpt_config_view(hf_config, intermediate_size=4 * hf_config.hidden_size,
                                 hidden_act="gelu_pytorch_tanh", layer_norm_eps=hf_config.layer_norm_epsilon)
        super().__init__(config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(renamed(renamed(_prefixed(weights), _BLOOM_NAMES), _ATTENTION_NAME))


def _prefixed(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """Names under ``transformer.`` (the bigscience checkpoints were written from the bare model, without it)."""
    for name, weight in weights:
        yield (name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name), weight

