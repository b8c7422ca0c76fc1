"""Llama 3.2 Vision (``MllamaForConditionalGeneration``): images in, through gated cross-attention layers.

The vision encoder (mllama_vision.py) turns each image into ``max_num_tiles * (patches + 1)`` rows, which the
projector maps to the decoder's width. The decoder is Llama's, but the layers listed in ``cross_attention_layers``
are cross-attention layers: no self-attention and no KV-cache layer (`kv_cache_layers` counts the others), q/k
RMS-normed per head, their attention and MLP outputs scaled by ``tanh`` of their gates. A prompt keeps one
``<|image|>`` token per image (embedded by the 8 rows the embedding table has past ``vocab_size``).

Which tokens see which images is transformers' ``cross_attention_mask`` (`image_spans`): an image from its token to
the next image's token, the last one (and a run of adjacent images) to the end of the prompt and every generated
token; an image's padding tiles are never seen. A token before the first image sees none: transformers then lets it
attend to every row of every image, tiles of padding included, and drops its cross-attention MLP
(``full_text_row_masked_out_mask``); so does this. A request without images skips the cross-attention layers, as
transformers' text-only path does.

How a request meets its images: each image is one item whose placeholder is its ``<|image|>`` token, and a first item
without data covers the tokens before the first image (`mm_prompt_items`), keyed by every image of the prompt: their
KV depends on all the images, so the prefix cache never lends them to a prompt with other images. When a request
starts on a worker, workers/mm_runner.py hands its images' encoder outputs over (`CrossImages`); each cross-attention
layer's keys and values are computed then, kept by the request's worker row (`CrossImageStates`) while it runs,
dropped when it finishes, is aborted or preempted (`free_cross_images`) or the workers sleep. The KV cache's budget
keeps room for them (`image_state_bytes` an image, `mm_default_image_limit` images a seat unless
``limit_mm_per_prompt`` says otherwise: workers/mm_runner.py `request_states_reserve`).

Tensor parallelism: the cross-attention layers split q / k / v / o by heads as Llama's self-attention does (a KV head
is never split: the size must divide ``num_key_value_heads``); the vision encoder and projector are whole on every
rank. LoRA adapters take the decoder's self-attention and MLP projections (`DecoderLoRA`); one naming a
cross-attention projection is refused by the host (asyncllm/lora.py adapts ``self_attn`` and ``mlp`` only). Not built
(refused by name): pipeline parallelism, CUDA graphs (the steps run eager).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, CrossImages
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.embedding import VocabParallelEmbedding
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, new_param, norm_in
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncllm.models.mllama_vision import MllamaVisionModel, num_tiles_of
from asyncllm.models.vision_language import VisionLanguageModel, load_vision_language_weights
from asyncllm.protocol import MultiModalItem

__all__ = ["CrossImageStates", "MllamaForConditionalGeneration", "image_spans", "image_state_bytes"]

_PREFIX = "mllama-prefix:"
"""The hash prefix of the item that covers the tokens before the first image (`mm_prompt_items`)."""
_EXTRA_EMBEDDINGS = 8
"""Rows of the embedding table past ``vocab_size`` (``<|image|>`` is the first): the LM head has none."""


def image_state_bytes(hf_config: Any, tp_size: int, dtype: torch.dtype) -> int:
    """Bytes one image's cross-attention states take on a rank: every cross-attention layer's keys and values of its
    ``max_num_tiles * (patches + 1)`` rows, this rank's KV heads (11B in bfloat16: 210 MB)."""
    vision, text = hf_config.vision_config, hf_config.text_config
    rows = vision.max_num_tiles * ((vision.image_size // vision.patch_size) ** 2 + 1)
    head_dim = text.hidden_size // text.num_attention_heads
    kv_width = text.num_key_value_heads // tp_size * head_dim
    return len(text.cross_attention_layers) * 2 * rows * kv_width * dtype.itemsize


def image_spans(offsets: list[int], prompt_len: int) -> list[tuple[int, int | None]]:
    """Each image's ``[start, end)`` of token positions that see it (transformers' ``get_cross_attention_token_mask``
    over a prompt whose ``<|image|>`` tokens sit at ``offsets``); end None: to the prompt's end and every token
    generated after it (transformers repeats the last prompt token's mask row for them)."""
    if len(offsets) == 1:
        return [(offsets[0], None)]
    spans = [[start, end] for start, end in zip(offsets, [*offsets[1:], prompt_len])]
    last_end = spans[-1][1]
    for span in reversed(spans):  # a run of adjacent images sees what the run's last one sees
        if span[0] == span[1] - 1:
            span[1] = last_end
        last_end = span[1]
    return [(start, None if end == prompt_len else end) for start, end in spans]


@dataclass
class _RequestImages:
    """One request's cross-attention keys and values (per cross-attention layer) and which tokens see which rows, all
    on the device (moved once, when the request starts: a step's masks are built there, `visible`)."""

    keys: list[torch.Tensor]
    """``[rows, kv_heads, head_dim]`` per cross-attention layer, k-normed."""
    values: list[torch.Tensor]
    starts: torch.Tensor
    """``[images]`` int64: the first position that sees each image."""
    ends: torch.Tensor
    """``[images]`` int64: the position past the last that sees it (int64 max: none)."""
    row_image: torch.Tensor
    """``[rows]`` int64: the image each row belongs to, -1 on its padding tiles' rows (which no token sees)."""

    def visible(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``[tokens, rows]`` bool: the rows each token attends to; ``[tokens]`` bool: whether it sees an image), on
        the device of ``positions`` (int64). A token that sees none attends to every row, as transformers' zeroed mask
        row does."""
        sees = (self.starts <= positions[:, None]) & (positions[:, None] < self.ends)
        seen = sees.any(dim=1)
        sees_none = torch.nn.functional.pad(sees, (0, 1))  # a last False column: what a padding row's -1 gathers
        return sees_none[:, self.row_image] | ~seen[:, None], seen


@dataclass
class _Step:
    """A step's cross-attention plan: each request with images by its flat token range."""

    spans: list[tuple[int, int, _RequestImages, torch.Tensor]]
    """(first flat token, past the last, the request's images, its ``[tokens, rows]`` attention mask)."""
    sees_image: torch.Tensor
    """``[T, 1]``: 1 for tokens that see an image, 0 for the others (their cross-attention MLP is dropped)."""


class CrossImageStates:
    """Each worker row's `_RequestImages` while its request runs (`free`d when it finishes, is aborted or preempted),
    and the step's plan (`begin`)."""

    def __init__(self, vision_config: Any) -> None:
        self.vision_config = vision_config
        self.rows: dict[int, _RequestImages] = {}
        self.step: _Step | None = None

    def start(self, row: int, items: list[MultiModalItem], prompt_len: int, keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> None:
        """A request starting at ``row`` with these image items and their layers' keys and values."""
        spans = image_spans([item.offset for item in items], prompt_len)
        per_image = keys[0].shape[0] // len(items)
        per_tile = per_image // self.vision_config.max_num_tiles
        row_image = np.full(keys[0].shape[0], -1, np.int64)
        for i, item in enumerate(items):
            tiles = num_tiles_of(self.vision_config, _aspect_ratio_id(item))
            row_image[i * per_image : i * per_image + tiles * per_tile] = i
        no_end = np.iinfo(np.int64).max
        bounds = np.array([[s for s, _ in spans], [no_end if e is None else e for _, e in spans]], np.int64)
        device = keys[0].device
        starts, ends = torch.from_numpy(bounds).to(device)
        self.rows[row] = _RequestImages(keys, values, starts, ends, torch.from_numpy(row_image).to(device))

    def free(self, rows: Iterable[int] | None) -> None:
        """Drop the states ``rows`` keep; None: every row's."""
        if rows is None:
            self.rows.clear()
        for row in rows or ():
            self.rows.pop(row, None)

    def begin(self, cross: CrossImages | None, num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        """The plan of a step whose requests with images are ``cross.spans``; None when it has none. Built on the
        device: no host work per image row."""
        self.step = None
        if cross is None or not cross.spans:
            return
        sees_image = torch.zeros(num_tokens, 1, device=device, dtype=dtype)
        spans = []
        for row, flat_offset, length, start in cross.spans:
            request = self.rows[row]
            mask, seen = request.visible(torch.arange(start, start + length, device=device))
            sees_image[flat_offset : flat_offset + length, 0] = seen
            spans.append((flat_offset, flat_offset + length, request, mask))
        self.step = _Step(spans, sees_image)


def _aspect_ratio_id(item: MultiModalItem) -> int:
    """An image item's aspect ratio id: its data's first value (`MllamaForConditionalGeneration.mm_pixel_values`)."""
    assert item.data is not None, "the core fills every item's data before the workers see it"
    return int(np.frombuffer(item.data, np.dtype(item.dtype), count=1)[0])


class MllamaCrossAttention(nn.Module):
    """Attention of the tokens over their request's image rows: q and k RMS-normed per head, no rope."""

    def __init__(self, b: DecoderBuild, index: int) -> None:
        super().__init__()
        cfg, tp, dtype = b.hf_config, b.tp, b.dtype
        self.index = index
        """This layer's place among the cross-attention layers (its keys in `_RequestImages`)."""
        if cfg.num_key_value_heads % tp.size:
            raise NotBuiltError("tensor_parallel_size", tp.size, f"replicating Mllama's {cfg.num_key_value_heads} "
                                f"cross-attention KV heads over {tp.size} ranks (a size that divides them works)")
        self.heads, self.kv_heads = tp.split(cfg.num_attention_heads), tp.split(cfg.num_key_value_heads)
        """This rank's query and KV heads (column-parallel q/k/v, row-parallel o, as Llama's self-attention)."""
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        width = cfg.num_attention_heads * self.head_dim
        kv_width = cfg.num_key_value_heads * self.head_dim
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, width, False, tp, dtype)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, kv_width, False, tp, dtype)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, kv_width, False, tp, dtype)
        self.o_proj = RowParallelLinear(width, cfg.hidden_size, False, tp, dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)

    def project(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Image rows ``[rows, hidden]`` -> (k-normed keys, values) ``[rows, kv_heads, head_dim]``."""
        shape = (encoded.shape[0], self.kv_heads, self.head_dim)
        key = self.k_norm(self.k_proj(encoded).reshape(-1, self.head_dim)).view(shape)
        return key, self.v_proj(encoded).view(shape)

    def forward(self, hidden: torch.Tensor, step: _Step) -> torch.Tensor:
        """``[T, hidden]`` -> the output projection of each request's tokens' attention, zero for the others."""
        query = self.q_norm(self.q_proj(hidden).reshape(-1, self.head_dim)).view(-1, self.heads, self.head_dim)
        out = torch.zeros_like(query)
        for lo, hi, request, mask in step.spans:
            out[lo:hi] = self._attend(query[lo:hi], request.keys[self.index], request.values[self.index], mask)
        return self.o_proj(out.reshape(hidden.shape[0], -1))

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads, head_dim]`` over ``[rows, kv_heads, head_dim]`` under ``mask`` ``[tokens, rows]``. The
        query heads sharing a KV head go in the batch dimension, over zero-stride views of the keys and values (no
        copy of them; ``enable_gqa`` with a mask falls back to CUDA's math kernel, which copies them itself)."""
        group = self.heads // self.kv_heads
        query = query.view(-1, self.kv_heads, group, self.head_dim).permute(2, 1, 0, 3)
        key, value = (t.transpose(0, 1)[None].expand(group, -1, -1, -1) for t in (key, value))
        attn = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None])
        return attn.permute(2, 1, 0, 3).reshape(-1, self.heads, self.head_dim)


class MllamaCrossAttentionLayer(nn.Module):
    """``h + tanh(attn_gate) * cross_attn(norm(h))``, then ``h + tanh(mlp_gate) * sees_image * mlp(norm(h))``."""

    def __init__(self, b: DecoderBuild, layer_idx: int, index: int) -> None:
        """``layer_idx``: its place in the decoder; ``index``: among the cross-attention layers."""
        super().__init__()
        cfg = b.hf_config
        self.cross_attn = MllamaCrossAttention(b, index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.cross_attn_attn_gate = new_param(1, dtype=b.dtype)
        self.mlp = b.make_mlp(b, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.cross_attn_mlp_gate = new_param(1, dtype=b.dtype)
        self.states: CrossImageStates | None = None
        """Set by the model once built (shared by every cross-attention layer)."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.states is not None, "the model shares its cross states with the layers"
        step = self.states.step
        if step is None:  # no request with images: transformers' text-only path skips the layer
            return hidden, residual
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        attn = self.cross_attn_attn_gate.tanh() * self.cross_attn(hidden, step)
        hidden, residual = self.post_attention_layernorm(attn, residual)
        return self.cross_attn_mlp_gate.tanh() * (step.sees_image * self.mlp(hidden)), residual


class MllamaTextModel(LlamaModel):
    """Llama's stack with cross-attention layers at ``cross_attention_layers``, which take no KV-cache layer."""

    class embedding_cls(VocabParallelEmbedding):  # noqa: N801 (LlamaModel's hook name)
        def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype) -> None:
            super().__init__(vocab_size + _EXTRA_EMBEDDINGS, hidden_size, tp, dtype)

    @classmethod
    def layer_class(cls, hf_config: Any) -> Any:
        """(build, index) -> a cross-attention layer at ``cross_attention_layers``, else Llama's."""
        cross = list(hf_config.cross_attention_layers)
        return lambda b, i: MllamaCrossAttentionLayer(b, i, cross.index(i)) if i in cross else LlamaDecoderLayer(b, i)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids, positions, inputs_embeds)
        residual, caches = None, iter(kv_caches)
        for layer in self.layers:
            cache = None if isinstance(layer, MllamaCrossAttentionLayer) else next(caches)
            hidden, residual = layer(positions, hidden, residual, cache, metadata)
        return self.final(hidden, residual)


class MllamaTextForCausalLM(LlamaForCausalLM):
    """The decoder (`MllamaTextModel`) and its LM head over ``vocab_size`` (no row for ``<|image|>``)."""

    model_cls = MllamaTextModel

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """The cross-attention's q/k/v stay apart (the self-attention's are fused)."""
        return (ckpt_name, None) if ".cross_attn." in ckpt_name else super()._packed(ckpt_name)


class MllamaForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """The vision encoder, the projector, and the decoder with its cross-attention states; LoRA adapters on the
    decoder's self-attention and MLPs (the cross-attention layers' MLPs too; their attention takes none)."""

    mm_cross_images = True
    """Image rows feed the cross-attention layers (workers/mm_runner.py), not the input embeddings."""
    cuda_graphs_off = "Mllama's cross-attention states are read by worker row (capturing them is not built)"
    mm_default_image_limit = 1
    """``limit_mm_per_prompt["image"]`` when it is not set: the KV cache's budget leaves every worker row room for
    this many images' cross-attention states (workers/mm_runner.py `request_states_reserve`)."""

    @staticmethod
    def kv_cache_layers(text_config: Any) -> int:
        """The self-attention layers (the cross-attention layers keep no cache)."""
        return text_config.num_hidden_layers - len(text_config.cross_attention_layers)

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, **decoder_options: Any) -> None:
        super().__init__()
        text = hf_config.text_config
        self.vision_model = MllamaVisionModel(hf_config.vision_config, dtype)
        self.multi_modal_projector = nn.Linear(hf_config.vision_config.vision_output_dim, text.hidden_size,
                                               dtype=dtype)
        self.language_model = MllamaTextForCausalLM(text, dtype=dtype, tp=tp, attn_backend=attn_backend,
                                                    max_position=max_position, **decoder_options)
        self.cross_states = CrossImageStates(hf_config.vision_config)
        self.image_state_bytes = image_state_bytes(hf_config, tp.size, dtype)
        """One image's cross-attention states on this rank (kept while its request runs, not preallocated)."""
        for layer in self._cross_layers():
            layer.states = self.cross_states

    def _cross_layers(self) -> list[MllamaCrossAttentionLayer]:
        return [layer for layer in self.language_model.model.layers if isinstance(layer, MllamaCrossAttentionLayer)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        cross = attn_metadata.cross_images
        for row, items, outputs, prompt_len in (cross.starts if cross is not None else ()):
            self._start(row, items, outputs, prompt_len)
        self.cross_states.begin(cross, input_ids.shape[0], input_ids.device, self.multi_modal_projector.weight.dtype)
        try:
            return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)
        finally:
            self.cross_states.step = None  # holds its requests' states: a freed row's go with it

    def free_cross_images(self, rows: list[int] | None) -> None:
        """Drop the cross-attention states ``rows`` keep (their requests finished, were aborted or preempted:
        workers/mm_runner.py); None: every row's (a sleep or new weights: the core recomputes the running requests)."""
        self.cross_states.free(rows)

    def _start(self, row: int, items: list[MultiModalItem], outputs: list[torch.Tensor], prompt_len: int) -> None:
        """Each cross-attention layer's keys and values of a request's images, kept by its row (a stale entry of the
        row dropped first, so the two never take memory at once)."""
        self.cross_states.free([row])
        encoded = torch.cat(outputs).to(self.multi_modal_projector.weight.dtype)
        keys, values = zip(*(layer.cross_attn.project(encoded) for layer in self._cross_layers()))
        self.cross_states.start(row, items, prompt_len, list(keys), list(values))

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """``<|image|>``: one token per image, kept in the prompt."""
        return int(hf_config.image_token_index)

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's processor output -> float32 ``[1 + tiles * C * S * S]``: its aspect ratio id, then its tiles
        (padded to ``max_image_tiles``)."""
        ratio = processed["aspect_ratio_ids"].reshape(-1)[:1].astype("float32")
        return np.concatenate([ratio, processed["pixel_values"][0, 0].astype("float32", copy=False).reshape(-1)])

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        return 1

    @staticmethod
    def mm_prompt_items(hf_config: Any, token_ids: list[int], items: list[MultiModalItem]) -> list[MultiModalItem]:
        """The images' items after one (no data) over the tokens before the first image, keyed by every image: those
        tokens attend to all the images (prefix caching, asyncllm/kv/hashing.py)."""
        if not items or items[0].offset == 0:
            return items
        digest = hashlib.sha256(" ".join(item.mm_hash for item in items).encode()).hexdigest()
        return [MultiModalItem(_PREFIX + digest, 0, items[0].offset, b"", [0]), *items]

    @staticmethod
    def mm_cross_item(item: MultiModalItem) -> bool:
        """Whether ``item`` is an image (not the item over the tokens before the first one)."""
        return not item.mm_hash.startswith(_PREFIX)

    def encoder_output_spec(self) -> tuple[int, torch.dtype]:
        weight = self.multi_modal_projector.weight
        return weight.shape[0], weight.dtype

    def embed_multimodal(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, 1 + tiles * C * S * S]`` (`mm_pixel_values`) -> each image's ``[tiles * (patches + 1), hidden]``
        rows, projected."""
        vision = self.vision_model.cfg
        size = vision.image_size
        pixels = values[:, 1:].reshape(values.shape[0], vision.max_num_tiles, vision.num_channels, size, size)
        rows = self.multi_modal_projector(self.vision_model(pixels, values[:, 0].long()))
        return list(rows.flatten(1, 2))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return load_vision_language_weights(self, weights, _normalize, "Mllama")


def _normalize(name: str) -> str:
    """Both layouts (transformers 4's ``language_model.model.*``, 5's ``model.language_model.*``) -> ours."""
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    name = name.removeprefix("model.")
    if name.startswith("language_model.") and not name.startswith(("language_model.model.", "language_model.lm_head.")):
        return "language_model.model." + name.removeprefix("language_model.")
    return name
