"""PaliGemma (``PaliGemmaForConditionalGeneration``: paligemma-3b-*, paligemma2-3b/10b/28b-*): a SigLIP tower
(siglip.py), one linear projector, and a Gemma (1) or Gemma 2 decoder (gemma.py, gemma2.py).

PaliGemma is a prefix LM. ``PaliGemmaProcessor`` writes a prompt as its images' ``<image>`` rows first, then
``<bos>``, the text and a newline (`mm_prompt_text`), and marks every prompt token as the prefix
(``token_type_ids`` 0): in the prefill they all attend to each other both ways, in Gemma 2's sliding layers too
(transformers ORs the prefix block over the window); generated tokens are causal. A text prompt (no image) is a
prefix as well, as the processor would mark it (transformers' PaliGemma sets its decoder's
``use_bidirectional_attention``, so that even without ``token_type_ids`` its prefill sees the whole prompt both
ways; a checkpoint that sets it false has causal text prompts, here too). Here each prompt, with images or not,
carries a first item that holds no data and spans the whole prompt (`mm_prompt_items`, ``bidirectional``): the
scheduler prefills the prompt in one chunk, the attention backends give each prompt token the prompt's last
position as its limit, and the prefix cache keys each block of the prompt by all of it (asyncllm/kv/hashing.py),
since a block's KV depends on the later prompt tokens too. Positions start at 1 (transformers' ``position_ids +
1``; rotary attention sees only their differences, so the shift changes rounding alone). Image features enter the
decoder as the projector writes them (transformers 5 scales the text embeddings alone, by ``sqrt(hidden_size)``, in
the embedding).

Not built (refused by name): a Gemma 2 prompt longer than its sliding window (transformers lets the prefix see
past the window; the backends' window counts back from each token, docs/multimodal.md#paligemma); a prompt given as
embeddings (asyncllm/engine/prompt_tokens.py).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.gemma import Gemma1ForCausalLM
from asyncllm.models.gemma2 import Gemma2ForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import LlavaForConditionalGeneration, normalize_llava_name
from asyncllm.models.qwen2_audio import normalize_qwen2_audio_name
from asyncllm.models.siglip import SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights
from asyncllm.protocol import MultiModalItem

__all__ = ["PaliGemmaForConditionalGeneration", "prefix_window"]

_IMAGE = "<image>"
"""``PaliGemmaProcessor``'s image token, written once per image in the prompt text."""
_PREFIX = "paligemma-prefix"
"""The prefix span's item key (it holds no data; the prefix cache keys the span by its content)."""


def prefix_window(hf_config: Any) -> int | None:
    """The longest prompt whose prefix attention the backends match: a Gemma 2 decoder's sliding window (its
    sliding layers let transformers' prefix see past it), None for Gemma (1), whose layers are all global."""
    text = hf_config.text_config
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return None
    return getattr(text, "sliding_window", None)


class PaliGemmaMultiModalProjector(nn.Module):
    """Patch features ``[N, P, vision]`` -> ``[N, P, projection_dim]``: one biased linear layer."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision = hf_config.vision_config
        self.linear = nn.Linear(vision.hidden_size, vision.projection_dim, bias=True, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.linear(patches)


def _decoder_config(hf_config: Any) -> Any:
    """``hf_config`` with a text config the Gemma decoders build: PaliGemma's config sets
    ``use_bidirectional_attention`` on its decoder, which here is the prefix span's work, not the layers'."""
    config = copy.copy(hf_config)
    config.text_config = copy.copy(hf_config.text_config)
    config.text_config.use_bidirectional_attention = False
    return config


class PaliGemmaForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the ``<image>`` rows' embeddings; the rest is the Gemma decoder at positions + 1."""

    mm_string_placeholder = False
    """A "string" chat's media parts are refused: vLLM's placeholder text differs from the marker token
    (`MultiModalProcessor.placeholder_text`)."""

    supports_encoder_data_parallel = True
    """The tower and projector are whole on every rank in either mode, so "data" splits a step's images."""
    position_offset = 1
    """Positions count from 1 (transformers' ``position_ids + 1``); pipeline stages add it too
    (asyncllm/models/pipeline.py)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.text_config
        if vision.model_type != "siglip_vision_model":
            raise NotBuiltError("vision_config.model_type", vision.model_type, "a PaliGemma tower other than SigLIP")
        if vision.projection_dim != text.hidden_size:
            raise NotBuiltError("projection_dim", vision.projection_dim,
                                f"a PaliGemma projector to another width than the decoder's {text.hidden_size}")
        self.language_model = build_decoder(
            _decoder_config(hf_config), {"gemma": Gemma1ForCausalLM, "gemma2": Gemma2ForCausalLM}, "PaliGemma",
            mm_encoder_tp_mode, dtype=dtype, tp=tp, attn_backend=attn_backend, max_position=max_position + 1,
            **decoder_options)
        self.vision_tower = SiglipVisionTower(vision, TensorParallel(), dtype)
        self.multi_modal_projector = PaliGemmaMultiModalProjector(hf_config, dtype)
        self.vocab_size = text.vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder at positions counted from 1, as transformers' PaliGemma counts them."""
        return self.language_model(input_ids, positions + self.position_offset, kv_caches, attn_metadata,
                                   inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; an image token outside the vocabulary embeds as token 0 (its row is replaced)."""
        return self.language_model.embed_input_ids(input_ids.masked_fill(input_ids >= self.vocab_size, 0))

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """``<image>``: the prompt's mark of an image and each of its feature rows."""
        return int(hf_config.image_token_index)

    @staticmethod
    def mm_prompt_text(tokenizer: Any, text: str, num_images: int) -> str:
        """``PaliGemmaProcessor``'s text of a prompt: ``<image>`` per image first when the text has none, ``<bos>``
        after the last ``<image>``, and a closing newline."""
        if _IMAGE not in text:
            text = _IMAGE * num_images + text
        last = text.rfind(_IMAGE)
        end = 0 if last < 0 else last + len(_IMAGE)  # a text prompt (no image): <bos> first
        return f"{text[:end]}{tokenizer.bos_token}{text[end:]}\n"

    @staticmethod
    def mm_prompt_items(hf_config: Any, token_ids: list[int], items: list[MultiModalItem]) -> list[MultiModalItem]:
        """The prompt's items (its images', or none for a text prompt) after one that is the prompt's prefix span
        alone: no rows, ``bidirectional`` over every prompt token. `InvalidRequestError` for a prompt past a Gemma 2
        decoder's sliding window (not built)."""
        window = prefix_window(hf_config)
        if window is not None and len(token_ids) > window:
            raise InvalidRequestError("prompt", f"{len(token_ids)} tokens (image rows included), over the decoder's "
                                                f"sliding_window={window}: PaliGemma 2's prefix attention past its "
                                                "sliding window is not built yet in asyncllm")
        if not items and getattr(hf_config.text_config, "use_bidirectional_attention", None) is False:
            return items  # a checkpoint that turns it off: its text prompts are causal, as transformers runs them
        prefix = MultiModalItem(_PREFIX, 0, 0, b"", [0], bidirectional=[0, len(token_ids)])
        return [prefix, *items]

    normalize_name = staticmethod(normalize_qwen2_audio_name)
    """`_packed` reads a checkpoint name as well as an adapter's decoder name (``model.layers...``)."""

    mm_pixel_values = staticmethod(LlavaForConditionalGeneration.mm_pixel_values)
    """One image's processor output -> its ``[3, S, S]`` float32 pixels."""

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """One row per patch: ``(image_size / patch_size) ** 2`` (the processor's ``image_seq_length``)."""
        vision = hf_config.vision_config
        return (vision.image_size // vision.patch_size) ** 2

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, S, S]`` images -> ``[N, patches, text hidden]``: the tower's normed patches, projected."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Both layouts (``model.vision_tower.vision_model.*`` / ``vision_tower.vision_model.*``, ...) as LLaVA's."""
        return load_vision_language_weights(self, weights, normalize_llava_name, "PaliGemma", ("position_ids",))
