"""Rhymes AI's Aria (``AriaForConditionalGeneration``: rhymes-ai/Aria, Aria-Chat): Idefics3's SigLIP tower, a
projector of learned queries cross-attending to its patches, and a fine-grained mixture-of-experts decoder.

transformers' ``AriaProcessor`` resizes each image (crop) so its longest side is ``max_image_size`` (980 unless the
request says 490; short sides at least ``min_image_size``), pads it to a square and writes a ``pixel_mask`` of the
pixels that are the image's. ``split_image`` (off unless asked) first cuts the image into crops of the best of
``split_resolutions``. Each crop is ``max_image_size`` pixels a side; the prompt's image token becomes
``projector_patch_to_query_dict[patches]`` image tokens a crop, all crops' in one run (no text between).

The tower (Idefics3's: transformers' ``idefics3_vision``) sees a crop's patches, those with no pixel of the image
masked out of its attention, its positions bucketized over the patches that are the image's; the features are the
``vision_feature_layer``'s hidden states (-1: the last layer's, before ``post_layernorm``). The projector's first
``queries`` learned queries attend (``nn.MultiheadAttention`` over LayerNormed, projected queries and patches, the
masked patches left out) and a GELU (tanh) MLP maps them into the decoder's width.

The decoder (``aria_text``) is Llama's with an MoE MLP in every layer: the router's top ``moe_topk`` logits, their
softmax (the renormalised top-k of the whole softmax) weighting SiLU-gated experts, plus ``moe_num_shared_experts``
shared experts every token runs (one MLP of ``intermediate_size * moe_num_shared_experts``, the config's
``hidden_act``). The checkpoints stack the experts' matrices ``[E, hidden, 2I]`` (``experts.fc1.weight``, gate
columns then up) and ``[E, I, hidden]`` (``fc2.weight``; transformers 5 names them ``gate_up_proj`` /
``down_proj``, same layout), cut here per expert onto the fused experts (tensor and expert parallel as Qwen-MoE's).

One item an image: its crops ``(crops, 4, S, S)``, the pixel mask as a fourth channel (`mm_pixel_values`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel, weight_narrow, weight_shape
from asyncllm.models.llama import DecoderBuild, LlamaForCausalLM, LlamaMLP
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec, ReplicatedLinear, select_experts_by_spec
from asyncllm.models.siglip import MaskedSiglipVisionEmbeddings, SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["AriaForConditionalGeneration", "AriaTextForCausalLM", "queries_of"]


# ---- decoder
class AriaMoE(nn.Module):
    """Routed experts (softmax over the top k logits) plus the shared experts every token runs."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        self.spec = spec
        self.router = ReplicatedLinear(spec.num_experts, b.hf_config.hidden_size, b.dtype)
        self.experts = FusedMoE(spec, b.hf_config.hidden_size, b)
        self.shared_experts = LlamaMLP(b, spec.shared_expert_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_by_spec(self.spec, self.router(x), x.dtype)
        return self.experts(x, weights, ids) + self.shared_experts(x)


_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(fc1\.weight|fc2\.weight|gate_up_proj|down_proj)$")


class AriaTextForCausalLM(MoECausalLM, LlamaForCausalLM):
    """Llama's layers, `AriaMoE` in every one."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return MoESpec(int(hf_config.moe_num_experts), int(hf_config.moe_topk), int(hf_config.intermediate_size),
                       renormalize=True, weights_in_model_dtype=True,
                       shared_expert_size=int(hf_config.intermediate_size) * int(hf_config.moe_num_shared_experts))

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return AriaMoE(cls.moe_spec(b.hf_config, layer_idx), b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.expert_shape = (int(hf_config.moe_num_experts), int(hf_config.hidden_size),
                             int(hf_config.intermediate_size))
        """(E, hidden, I): the stacked experts' shapes."""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._aria_experts(weights))

    def _aria_experts(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """``weights`` with each stacked experts tensor (``[E, hidden, 2I]`` / ``[E, I, hidden]``) as its experts'
        per-expert matrices (``gate_proj`` / ``up_proj`` ``[I, hidden]``, ``down_proj`` ``[hidden, I]``); an expert
        another rank holds is not read."""
        experts, hidden, inter = self.expert_shape
        for name, weight in weights:
            match = _STACKED.match(name)
            if match is None:
                yield name, weight
                continue
            gate_up = match.group(2) in ("fc1.weight", "gate_up_proj")
            expected = (experts, hidden, 2 * inter) if gate_up else (experts, inter, hidden)
            if weight_shape(weight) != expected:
                raise ConfigError("model", name, f"Aria's stacked experts of shape {list(expected)}, got "
                                                 f"{list(weight_shape(weight))}")
            prefix = match.group(1)
            for expert in range(experts):
                if not self._on_this_rank(f"{prefix}.{expert}.down_proj.weight"):
                    continue
                matrix = weight_narrow(weight, 0, expert, 1)[0].t()
                if gate_up:
                    yield f"{prefix}.{expert}.gate_proj.weight", matrix[:inter]
                    yield f"{prefix}.{expert}.up_proj.weight", matrix[inter:]
                else:
                    yield f"{prefix}.{expert}.down_proj.weight", matrix


# ---- vision
PROCESSOR_DEFAULTS = {"max_image_size": 980, "split_image": False}
"""What transformers' ``AriaProcessor`` passes its image processor unless the call says otherwise (they win over the
checkpoint's preprocessor_config.json)."""


class AriaImages:
    """The checkpoint's image processor as ``AriaProcessor`` calls it: `PROCESSOR_DEFAULTS` over its saved settings,
    a request's ``mm_processor_kwargs`` over both (so ``split_image=True`` or ``max_image_size=490`` per request)."""

    @staticmethod
    def from_pretrained(path: str, **overrides: Any) -> Any:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path, **{**PROCESSOR_DEFAULTS, **overrides})


def queries_of(hf_config: Any, side: int) -> int:
    """The projector's queries (image tokens) for one crop of ``side`` pixels: ``projector_patch_to_query_dict``
    at its patch count; `ConfigError` for a crop size the checkpoint has no entry for."""
    patches = (side // int(hf_config.vision_config.patch_size)) ** 2
    table = {int(k): int(v) for k, v in dict(hf_config.projector_patch_to_query_dict).items()}
    if patches not in table:
        raise ConfigError("max_image_size", side, f"a crop size whose patch count is in projector_patch_to_query_dict "
                                                  f"({sorted(table)} patches)")
    return table[patches]


class AriaCrossAttention(nn.Module):
    """transformers' ``AriaCrossAttention`` (its names): LayerNormed queries and patches, projected, through
    ``nn.MultiheadAttention``, then a biased linear."""

    def __init__(self, width: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width, bias=False, dtype=dtype) for _ in range(3))
        self.multihead_attn = nn.MultiheadAttention(width, heads, batch_first=True, dtype=dtype)
        self.linear = nn.Linear(width, width, dtype=dtype)
        self.layer_norm = nn.LayerNorm(width, dtype=dtype)
        self.layer_norm_kv = nn.LayerNorm(width, dtype=dtype)

    def forward(self, patches: torch.Tensor, queries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kv = self.layer_norm_kv(patches)
        out, _ = self.multihead_attn(self.q_proj(self.layer_norm(queries)), self.k_proj(kv), self.v_proj(kv),
                                     attn_mask=mask, need_weights=False)
        return self.linear(out)


class AriaProjector(nn.Module):
    """A crop's patch features ``[N, P, D]`` -> ``[N, queries, text hidden]``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, heads = hf_config.vision_config.hidden_size, hf_config.vision_config.num_attention_heads
        out = hf_config.text_config.hidden_size
        self.heads = heads
        most = max(int(v) for v in dict(hf_config.projector_patch_to_query_dict).values())
        self.query = nn.Parameter(torch.zeros(most, width, dtype=dtype))
        self.cross_attn = AriaCrossAttention(width, heads, dtype)
        self.layer_norm = nn.LayerNorm(width, dtype=dtype)
        self.feed_forward = nn.Module()
        self.feed_forward.linear_in = nn.Linear(width, out, bias=False, dtype=dtype)
        self.feed_forward.linear_out = nn.Linear(out, out, bias=False, dtype=dtype)

    def forward(self, patches: torch.Tensor, valid: torch.Tensor, queries: int) -> torch.Tensor:
        """``valid`` ``[N, P]``: the patches that are the image's (the others take no attention)."""
        n = patches.shape[0]
        query = self.query[:queries].unsqueeze(0).expand(n, -1, -1)
        mask = (~valid).repeat_interleave(self.heads, 0).unsqueeze(1).expand(-1, queries, -1)
        hidden = self.layer_norm(self.cross_attn(patches, query, mask))
        ff = self.feed_forward
        return ff.linear_out(F.gelu(ff.linear_in(hidden), approximate="tanh"))


class AriaForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features (each crop's projected queries) replace the image tokens' embeddings; the rest is the MoE
    decoder."""

    supports_encoder_data_parallel = True
    """The tower and projector are whole on every rank in either mode, so "data" splits a step's images."""
    is_moe = True
    mm_image_processor_class = AriaImages

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        vision = hf_config.vision_config
        if vision.model_type != "idefics3_vision":
            raise NotBuiltError("vision_config.model_type", vision.model_type, "Aria's Idefics3 vision tower")
        layer = getattr(hf_config, "vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise NotBuiltError("vision_feature_layer", layer, "one layer's features (an int)")
        self.language_model = build_decoder(hf_config, {"aria_text": AriaTextForCausalLM}, "Aria", mm_encoder_tp_mode,
                                            dtype=dtype, tp=tp, attn_backend=attn_backend, max_position=max_position,
                                            **decoder_options)
        self.vision_tower = SiglipVisionTower(vision, TensorParallel(), dtype, feature_layer=layer,
                                              embeddings=MaskedSiglipVisionEmbeddings(vision))
        self.multi_modal_projector = AriaProjector(hf_config, dtype)
        self.hf_config = hf_config

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        """The decoder's MoE (``hf_config``: the text config, as the registry's checks pass it)."""
        return AriaTextForCausalLM.moe_spec(getattr(hf_config, "text_config", hf_config), layer_idx)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image and each of its placeholders (``<|img|>``)."""
        return int(getattr(hf_config, "image_token_id", None) or hf_config.image_token_index)

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's ``(crops, 4, S, S)`` float32 crops: the three colour channels and the pixel mask (1: the
        image's pixel, 0: padding)."""
        pixels = np.asarray(processed["pixel_values"], dtype=np.float32)
        mask = np.asarray(processed["pixel_mask"], dtype=np.float32)
        return np.concatenate([pixels, mask[:, None]], axis=1)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Crops times the queries of a crop of that size."""
        return int(pixel_shape[0]) * queries_of(hf_config, int(pixel_shape[-1]))

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, crops, 4, S, S]`` images (one shape) -> ``[N, crops * queries, text hidden]``."""
        n, crops, _, side, _ = pixel_values.shape
        flat = pixel_values.flatten(0, 1)
        patch = int(self.hf_config.vision_config.patch_size)
        per_side = side // patch
        mask = flat[:, 3, : per_side * patch, : per_side * patch] > 0.5
        patch_mask = mask.reshape(-1, per_side, patch, per_side, patch).any(dim=4).any(dim=2)
        features = self.vision_tower(flat[:, :3], patch_mask)  # padding patches left out of the attention
        out = self.multi_modal_projector(features, patch_mask.flatten(1), queries_of(self.hf_config, side))
        return out.reshape(n, crops * out.shape[1], out.shape[2])

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The released layout (``vision_tower.*``, ``multi_modal_projector.*``, ``language_model.model.*``,
        ``language_model.lm_head``) and transformers 5's (``model.*``, ``lm_head``)."""
        return load_vision_language_weights(self, weights, _normalize, "Aria")


def _normalize(name: str) -> str:
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    return name.removeprefix("model.")
