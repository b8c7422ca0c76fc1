"""CLIP as an embedding model (``CLIPModel``: openai/clip-vit-*, LAION's CLIP ViTs): a prompt's text or its image
as one point of the shared space, as vLLM's ``CLIPEmbeddingModel`` serves it.

A prompt is text or one image, not both (vLLM's rule). Text runs through CLIP's text transformer, a causal decoder
with learned positions (GPT-2's layers under CLIP's names, on the paged KV cache like any decoder: chunked prefill
and prefix caching apply), its final LayerNorm and ``text_projection``; the pooled row is the last (the EOS the
tokenizer appends, what transformers' ``get_text_features`` reads). An image prompt is one placeholder row (vLLM's
token 0, written by the host: `mm_image_prompt`) whose encoder output is the
image's embedding: the vision tower (asyncllm/models/clip.py), ``post_layernorm`` of the CLS row and
``visual_projection`` (``get_image_features``). The image rows bypass the text transformer: the encoder output
carries a marker column (1 on image rows, 0 on the text rows `embed_input_ids` gives) that `forward` reads to take
those rows as they are. Both outputs are ``projection_dim`` wide, normalized by the pooler (vLLM's default).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.models.clip import CLIPVisionTower, check_encoder_split
from asyncllm.models.gpt2 import GPT2LMHeadModel, gpt_config_view
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import DecoderFlags
from asyncllm.models.phi import renamed
from asyncllm.models.vision_language import VisionLanguageModel, load_vision_language_weights

__all__ = ["CLIPEmbeddingModel", "CLIPTextDecoder"]

_TEXT_NAMES = (("embeddings.token_embedding.", "model.embed_tokens."),
               ("embeddings.position_embedding.", "model.embed_positions."),
               ("final_layer_norm.", "model.norm."), ("encoder.layers.", "model.layers."))
_LAYER_NAMES = ((".layer_norm1.", ".input_layernorm."), (".layer_norm2.", ".post_attention_layernorm."),
                (".self_attn.out_proj.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.c_fc."),
                (".mlp.fc2.", ".mlp.c_proj."))


class CLIPTextDecoder(GPT2LMHeadModel):
    """CLIP's text transformer: GPT-2's pre-LayerNorm layers with separate biased q, k, v (``nn.Linear``), a
    quick-GELU MLP, learned positions and the final LayerNorm; no LM head."""

    has_lm_head = False
    conv1d = fused_qkv = False

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True, o_bias=True, mlp_bias=True)

    @classmethod
    def config_view(cls, hf_config: Any) -> Any:
        config = gpt_config_view(hf_config, intermediate_size=hf_config.intermediate_size,
                                 hidden_act=hf_config.hidden_act, rms_norm_eps=hf_config.layer_norm_eps)
        config.tie_word_embeddings = False
        return config

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """``text_model.*`` names without that prefix (``embeddings.position_ids``, a buffer, skipped)."""
        kept = ((name, w) for name, w in weights if not name.endswith("position_ids"))
        return super(GPT2LMHeadModel, self).load_weights(renamed(renamed(kept, _TEXT_NAMES), _LAYER_NAMES))


class CLIPEmbeddingModel(VisionLanguageModel):
    """``CLIPModel``: text prompts through the text transformer and ``text_projection``, image prompts (one row)
    through the vision tower and ``visual_projection``; ``projection_dim``-wide rows either way."""

    supports_encoder_data_parallel = True
    """``mm_encoder_tp_mode="data"``: the tower whole on every rank, a step's images split across them."""
    mm_default_image_limit = 1
    text_decoder_cls: type[CLIPTextDecoder] = CLIPTextDecoder
    text_head_bias = False
    """Whether ``text_projection`` has a bias (SigLIP's text head does)."""
    family = "CLIP"
    """The family's name in request errors."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, mm_encoder_tp_mode: str = "weights",
                 **decoder_options: Any) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.text_config
        self.width = self.embedding_width(hf_config)
        self.vocab_size = int(text.vocab_size)
        if mm_encoder_tp_mode not in ("weights", "data"):
            raise ConfigError("mm_encoder_tp_mode", mm_encoder_tp_mode, "'weights' or 'data'")
        encoder_tp = tp if mm_encoder_tp_mode == "weights" else TensorParallel()
        check_encoder_split(encoder_tp.size, {"vision_config.num_attention_heads": vision.num_attention_heads,
                                              "vision_config.intermediate_size": vision.intermediate_size})
        self.language_model = self.text_decoder_cls(text, dtype=dtype, tp=tp, **decoder_options)
        self.text_projection = nn.Linear(text.hidden_size, self.width, bias=self.text_head_bias, dtype=dtype)
        self.build_vision(hf_config, encoder_tp, dtype)

    @staticmethod
    def embedding_width(hf_config: Any) -> int:
        """The rows' width, text's and images' alike: ``projection_dim``."""
        return int(hf_config.projection_dim)

    def build_vision(self, hf_config: Any, encoder_tp: TensorParallel, dtype: torch.dtype) -> None:
        """The tower (every layer) and ``visual_projection``."""
        vision = hf_config.vision_config
        self.vision_tower = CLIPVisionTower(vision, -1, encoder_tp, dtype)
        self.visual_projection = nn.Linear(vision.hidden_size, self.width, bias=False, dtype=dtype)

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, width]``: ``post_layernorm`` of the CLS row, projected (``get_image_features``)."""
        return self.visual_projection(self.vision_tower.post_layernorm(self.vision_tower(pixel_values)[:, 0]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, width]``: the text rows' projected final hidden states, the image rows' embeddings (the
        marked rows of ``inputs_embeds``) in their place."""
        text = self.text_projection(self.language_model(input_ids, positions, kv_caches, attn_metadata))
        if inputs_embeds is None:
            return text
        image_rows = inputs_embeds[:, -1:] > 0.5
        return torch.where(image_rows, inputs_embeds[:, :-1].to(text.dtype), text)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Zeros: the token an embedding request samples is dropped."""
        return hidden.new_zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, width + 1]`` zeros: the rows image embeddings are written into, unmarked (text)."""
        return self.text_projection.weight.new_zeros(input_ids.shape[0], self.width + 1)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` images -> ``[N, 1, width + 1]``: each image's embedding, marked."""
        features = self.image_embeddings(pixel_values)
        return torch.cat([features, features.new_ones(features.shape[0], 1)], dim=-1).unsqueeze(1)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The row an image prompt is (vLLM's dummy token 0; never read: the image's embedding replaces it)."""
        return 0

    @classmethod
    def mm_image_prompt(cls, tokenizer: Any, token_ids: list[int], images: Any) -> list[int]:
        """An image prompt as its one placeholder row; the text given with the image may hold special tokens only
        (vLLM's rule: an empty prompt), else `InvalidRequestError`, as for more than one image (``images`` not a
        list: the processor's check says so)."""
        if isinstance(images, (list, tuple)) and len(images) > 1:
            raise InvalidRequestError("prompt.images", f"{len(images)} images: {cls.family} embeds one image per "
                                                       "prompt")
        special = set(tokenizer.all_special_ids)
        if any(token not in special for token in token_ids):
            raise InvalidRequestError("prompt", f"text with an image: {cls.family} embeds a prompt's text or its one "
                                                "image, not both (give the image with an empty prompt)")
        return [cls.mm_placeholder_token_id(None)]

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        return processed["pixel_values"][0].astype("float32", copy=False)

    @classmethod
    def mm_placeholder_length(cls, hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """One row; the image processor's pixels must be the tower's square (its position embeddings are fixed), else
        `InvalidRequestError` naming ``mm_processor_kwargs`` (a ``size`` or ``do_center_crop`` that changes them)."""
        side = int(hf_config.vision_config.image_size)
        if tuple(pixel_shape[-2:]) != (side, side):
            raise InvalidRequestError("mm_processor_kwargs", f"the image processor made {pixel_shape[-2]}x"
                                                             f"{pixel_shape[-1]} pixels; {cls.family} takes {side}x"
                                                             f"{side} (vision_config.image_size): leave out the "
                                                             "settings that change them (size, crop_size, "
                                                             "do_center_crop, do_resize)")
        return 1

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The text model's to its loader, the tower's and the projections to their parameters; ``logit_scale``
        (the contrastive loss's temperature) unread."""
        return load_vision_language_weights(self, weights, self.checkpoint_name, type(self).__name__,
                                            ("position_ids", "logit_scale", "logit_bias"))

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint name as ours: the text model's under ``language_model.``, the tower's under
        ``vision_tower.``, the projections as they are."""
        if name.startswith("text_model."):
            return "language_model." + name.removeprefix("text_model.")
        if name.startswith("vision_model."):
            return "vision_tower." + name.removeprefix("vision_model.")
        return name
