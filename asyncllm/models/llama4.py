"""Meta Llama 4: text (``Llama4ForCausalLM``) and image-text (``Llama4ForConditionalGeneration``: Llama-4-Scout-17B-16E
/ Maverick-17B-128E, the vision model in llama4_vision.py; or their language model alone, `Llama4TextOnly`).

- Attention: rotary layers (``no_rope_layers[i]`` = 1) rotate interleaved pairs (de-interleaved before the backends'
  half-split rotation, which turns the same pairs: q . k is unchanged), L2-norm q and k without weights
  (``use_qk_norm``; rotations keep the norm, so it runs before the rotation here), and attend within chunks of
  ``attention_chunk_size`` positions (``layer_types`` "chunked_attention"); the other layers use no positions and
  scale q by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` (``attn_temperature_tuning``).
- MLPs: dense (``intermediate_size_mlp``) or, in ``moe_layers``, one routed expert of ``num_local_experts``
  chosen by the router's largest logit, its input scaled by that logit's sigmoid, plus a shared expert. The
  checkpoints' experts are fused (``experts.gate_up_proj`` ``[E, hidden, 2I]``, ``down_proj``) and cut per
  expert at load; ``feed_forward`` is read as ``mlp``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.deepseek import pairs_to_halves
from asyncllm.models.layers import Attention, LoadedWeight, TensorParallel
from asyncllm.models.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.models.llama import (
    DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, with_rope_only_in,
)
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.qwen3_vl_moe import split_fused_experts
from asyncllm.mm.llama4_images import Llama4Image, Llama4Images
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.models.llama4_vision import Llama4MultiModalProjector, Llama4VisionModel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.vision_language import (
    VisionLanguageModel, build_decoder, load_vision_language_weights, text_only_class,
)

__all__ = ["Llama4ForCausalLM", "Llama4ForConditionalGeneration", "Llama4TextOnly"]


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Llama4TextL2Norm``: RMS-normed in float32, no weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(nn.Module):
    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        head_dim, bias = cfg.head_dim, bool(cfg.attention_bias)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias, b.tp, b.dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size, bias, b.tp, b.dtype)
        self.use_rope = bool(cfg.no_rope_layers[layer_idx])
        self.qk_norm = bool(cfg.use_qk_norm) and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.temperature = (bool(cfg.attn_temperature_tuning) and not self.use_rope,
                            float(cfg.floor_scale), float(cfg.attn_scale))
        self.rotary_emb = b.layer_rotary[layer_idx] if b.layer_rotary is not None else b.rotary_emb
        chunked = cfg.layer_types[layer_idx] == "chunked_attention"
        qkv = self.qkv_proj
        self.attn = Attention(qkv.num_heads, qkv.num_kv_heads, head_dim, b.attn_backend,
                              attention_chunk_size=cfg.attention_chunk_size if chunked else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        query, key, value = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        if self.use_rope:
            query, key = pairs_to_halves(query), pairs_to_halves(key)
        if self.qk_norm:
            query, key = _l2_norm(query, self.eps), _l2_norm(key, self.eps)
        tuned, floor_scale, attn_scale = self.temperature
        if tuned:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            query = (query * scales[:, None, None]).to(query.dtype)
        rotary = RotaryInputs(positions, self.rotary_emb.cos_sin_cache)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata, rotary))


class Llama4MoE(nn.Module):
    """The top-1 expert on its input scaled by the sigmoid of the router's logit, plus the shared expert."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        self.router = ColumnParallelLinear(cfg.hidden_size, spec.num_experts, False, TensorParallel(), b.dtype)
        self.experts = FusedMoE(spec, cfg.hidden_size, b)
        self.shared_expert = LlamaMLP(b, spec.shared_expert_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = self.router(x).topk(1, dim=-1)
        scaled = x * torch.sigmoid(top.float()).to(x.dtype)
        routed = self.experts(scaled, torch.ones_like(top, dtype=torch.float32), ids)
        return self.shared_expert(x) + routed


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Llama4Attention  # type: ignore[assignment]

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.fused_decode_rows = 0  # the fused decode products read a plain attention's projections


class Llama4Model(LlamaModel):
    layer_cls = Llama4DecoderLayer


class Llama4ForCausalLM(MoECausalLM, LlamaForCausalLM):
    model_cls = Llama4Model
    lora_experts = True  # its adapters' feed_forward.* read as mlp.* (asyncllm/lora_experts.py)
    lora_experts_transposed = True
    """PEFT stores its stacked experts' adapters with A and B each in the other's place (``[E, in, out]``)."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if layer_idx not in hf_config.moe_layers:
            return None
        return MoESpec(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=False, weights_in_model_dtype=False,
                       shared_expert_size=hf_config.intermediate_size)  # `Llama4MoE`'s shared expert

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b, b.hf_config.intermediate_size_mlp) if spec is None else Llama4MoE(spec, b)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        """Llama's build, the layers without positions turning by the identity table."""
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return with_rope_only_in(build, [bool(r) for r in hf_config.no_rope_layers], max_position)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Llama 4")
        if hf_config.num_experts_per_tok != 1:
            raise NotBuiltError("num_experts_per_tok", hf_config.num_experts_per_tok,
                                "Llama 4 with one routed expert per token (its input is scaled by the expert's score)")
        super().__init__(hf_config, **kwargs)
        self.expert_sizes = (int(hf_config.hidden_size), int(hf_config.intermediate_size))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        renamed = ((name.replace(".feed_forward.", ".mlp."), w) for name, w in weights)
        return super().load_weights(split_fused_experts(renamed, *self.expert_sizes))


Llama4TextOnly = text_only_class(Llama4ForCausalLM, ("vision_model.", "multi_modal_projector."))
"""A ``Llama4ForConditionalGeneration`` checkpoint's language model, for text prompts (the vision model and its
projector are not read: ``limit_mm_per_prompt={"image": 0}``)."""

START, END, IMAGE = "<|image_start|>", "<|image_end|>", "<|image|>"
X_SEPARATOR, Y_SEPARATOR = "<|tile_x_separator|>", "<|tile_y_separator|>"


class Llama4ForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Llama 4's vision model and projector (llama4_vision.py) before its text decoder; each tile one item.

    An image is cut into tiles (asyncllm/mm/llama4_images.py); in the prompt its ``<|image|>`` becomes what
    transformers' ``Llama4Processor`` writes: ``<|image_start|>``, the tiles' ``<|patch|>`` runs row by row, a
    ``<|tile_x_separator|>`` between a row's tiles and ``<|tile_y_separator|>`` after each row, then ``<|image|>``
    and the global view's run, ``<|image_end|>`` (an image of one tile: only ``<|image|>`` and its run between the
    two). Each tile is one item (`mm_image_pieces`, as Aya Vision's)."""

    supports_encoder_data_parallel = True
    mm_image_processor_class = Llama4Images
    """transformers' ``Llama4ImageProcessor`` needs torchvision: this stands in for it (asyncllm/mm/)."""
    lora_experts = Llama4ForCausalLM.lora_experts
    lora_experts_transposed = Llama4ForCausalLM.lora_experts_transposed
    moe_spec = Llama4ForCausalLM.moe_spec
    decoder_classes = {"llama4_text": Llama4ForCausalLM}
    """By ``text_config.model_type`` (the decoder an EAGLE head reads: asyncllm/models/eagle_targets.py)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        self.language_model = build_decoder(hf_config, self.decoder_classes, "Llama 4",
                                            mm_encoder_tp_mode, dtype=dtype, tp=tp, attn_backend=attn_backend,
                                            max_position=max_position, **decoder_options)
        self.vision_model = Llama4VisionModel(hf_config.vision_config, dtype)
        self.multi_modal_projector = Llama4MultiModalProjector(hf_config, dtype)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_of(hf_config: Any, tokenizer: Any) -> int:
        """The prompt token that marks an image: the tokenizer's ``<|image|>`` (the chat template's); a tokenizer
        without the processor's tokens is a `ConfigError`."""
        ids = [tokenizer.convert_tokens_to_ids(text) for text in (IMAGE, START, END, X_SEPARATOR, Y_SEPARATOR)]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ConfigError("model", type(tokenizer).__name__, "a Llama 4 tokenizer with the image tokens "
                                                                  f"{IMAGE}, {START}, {END}, {X_SEPARATOR}, {Y_SEPARATOR}")
        return int(ids[0])

    @staticmethod
    def mm_pixel_values(processed: Llama4Image) -> Any:
        """One image's ``(tiles, 3, S, S)`` float32 tiles (the global view last)."""
        return processed.tiles

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Rows of one tile: its patches over the pixel shuffle's ``1 / ratio ** 2``."""
        vision = hf_config.vision_config
        return round((vision.image_size // vision.patch_size) ** 2 * float(vision.pixel_shuffle_ratio) ** 2)

    @staticmethod
    def mm_image_placeholder_id(hf_config: Any) -> int:
        """``<|patch|>`` (``image_token_id``), once per row."""
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_image_pieces(hf_config: Any, tokenizer: Any, processed: Llama4Image) -> list[VideoPiece]:
        """One piece per tile, the global view last, with the separators of transformers' processor."""
        def ids(*texts: str) -> list[int]:
            return [int(tokenizer.convert_tokens_to_ids(text)) for text in texts]

        tiled = processed.rows * processed.cols > 1
        pieces = [VideoPiece(ids(START) if r == c == 0 else [], slice(0, 0),
                             ids(X_SEPARATOR if c < processed.cols - 1 else Y_SEPARATOR))
                  for r in range(processed.rows) for c in range(processed.cols)] if tiled else []
        pieces.append(VideoPiece(ids(IMAGE) if tiled else ids(START, IMAGE), slice(0, 0), ids(END)))
        return [VideoPiece(p.before, slice(i, i + 1), p.after) for i, p in enumerate(pieces)]

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, 3, S, S]`` tiles -> ``[N, tile rows, text hidden]``."""
        return self.multi_modal_projector(self.vision_model(pixel_values.flatten(0, 1)))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' names (``vision_model.*``, ``multi_modal_projector.*``, ``language_model.model.*``,
        ``language_model.lm_head``; or under ``model.``)."""
        return load_vision_language_weights(self, weights, normalize_llava_name, "Llama 4")
