"""OpenAI Whisper (``WhisperForConditionalGeneration``: whisper-tiny ... large-v3, large-v3-turbo, distil-whisper):
speech to text, an encoder-decoder.

The encoder is Qwen2-Audio's (asyncllm/models/qwen2_audio.py) without its pooling and mask, as transformers'
``WhisperEncoder``: log-mel frames of ``chunk_length`` seconds (30: 3000 frames) -> ``max_source_positions`` rows
(1500), whole on every tensor-parallel rank. The decoder is a pre-LayerNorm transformer with learned positions
(``max_target_positions``: 448): self-attention over the paged KV cache as every decoder's, cross-attention over
the encoder's rows, a GELU MLP, the LM head tied to the embeddings; q is scaled by ``head_dim ** -0.5`` after its
projection and k has no bias, as transformers.

How a request meets its audio (docs/multimodal.md#whisper): the host processes the audio as an item that takes the
place of the prompt's ``<|startoftranscript|>`` token (its one placeholder, kept as that token), so the prompt stays
the decoder's text and the item's hash joins every prefix-cache block hash after it. When the request starts on a
worker (its first step there: a new request, or one resumed after preemption; the model runner hands its encoder
output in ``AttentionMetadata.encoder_outputs``), each layer's cross-attention keys and values are computed once and
kept by the request's worker row (`CrossStates`) for its life there; every later step attends over them through the
attention backend's paged kernels (row r's keys are blocks ``r * B ...``, every key visible).

LoRA adapters take the decoder's self- and cross-attention projections and its MLP (`_packed`); a request's
cross-attention keys and values take its adapter when they are computed (whisper_lora.py).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.gpt2 import GPT2LMHeadModel, LearnedPositionModel
from asyncllm.models.layers import LoadedWeight, TensorParallel, norm_in
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, DecoderFlags
from asyncllm.models.opt import OPTPreNormLayer
from asyncllm.models.phi import renamed
from asyncllm.models.qwen2_audio import Qwen2AudioEncoder
from asyncllm.models.row_states import StateRows
from asyncllm.models.starcoder2 import BiasLayerNorm
from asyncllm.models.vision_language import VisionLanguageModel, load_vision_language_weights
from asyncllm.models.whisper_lora import cross_adapters

__all__ = ["CrossStates", "WhisperForConditionalGeneration"]

_BLOCK = 16
"""Rows of a request's cross-attention keys per block of `CrossStates`."""

_DECODER_NAMES = (("model.decoder.embed_tokens.", "language_model.model.embed_tokens."),
                  ("model.decoder.embed_positions.", "language_model.model.embed_positions."),
                  ("model.decoder.layer_norm.", "language_model.model.norm."),
                  ("model.decoder.layers.", "language_model.model.layers."), ("proj_out.", "language_model.lm_head."),
                  ("model.encoder.", "audio_tower."))
_LAYER_NAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
                (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.c_fc."), (".fc2.", ".mlp.c_proj."),
                (".encoder_attn.q_proj.", ".encoder_attn.query."), (".encoder_attn.k_proj.", ".encoder_attn.key."),
                (".encoder_attn.v_proj.", ".encoder_attn.value."))


_CROSS_OUT = ".encoder_attn.out_proj."
"""The cross-attention's output projection (an adapter's name, written ``o_proj`` as every attention's, names it)."""


class CrossStates:
    """Each decoder layer's cross-attention keys and values by worker row, as a paged KV cache
    ``[2, rows * blocks_per_row, block, heads, head_dim]`` whose row r owns blocks ``r * blocks_per_row`` on, and the
    step's attention metadata over them."""

    def __init__(self, num_layers: int, rows: int, length: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.length = length
        """The encoder's rows per audio (``max_source_positions``)."""
        self.blocks_per_row = -(-length // _BLOCK)
        _check_room(rows, num_layers * 2 * self.blocks_per_row * _BLOCK * heads * head_dim * dtype.itemsize)
        self.caches = [torch.zeros(2, rows * self.blocks_per_row, _BLOCK, heads, head_dim, dtype=dtype)
                       for _ in range(num_layers)]
        self.step: AttentionMetadata | None = None
        """This step's metadata for the cross-attention (`begin`)."""

    def begin(self, metadata: AttentionMetadata, num_rows: int, device: torch.device) -> None:
        """Ready this step's metadata: request i reads its row's blocks, ``length`` keys, all visible to every query
        (``attend_limit``; a decode-only step needs none: its one query sits at the last position)."""
        rows = metadata.request_rows
        assert rows is not None and metadata.request_rows_cpu is not None, "the model runner lists the step's rows"
        self._fit(max(metadata.request_rows_cpu, default=-1) + 1, device)
        qsl = metadata.query_start_loc_cpu
        decode_only = all(end - start == 1 for start, end in zip(qsl, qsl[1:]))
        blocks = rows[:, None] * self.blocks_per_row + torch.arange(self.blocks_per_row, device=device)
        self.step = AttentionMetadata(
            slot_mapping=metadata.slot_mapping, query_start_loc=metadata.query_start_loc,
            seq_lens=torch.full_like(metadata.seq_lens, self.length), block_tables=blocks.to(torch.int32),
            query_start_loc_cpu=qsl, seq_lens_cpu=[self.length] * metadata.num_reqs, block_size=_BLOCK,
            attend_limit=None if decode_only else torch.full((num_rows,), self.length - 1, dtype=torch.int32,
                                                              device=device))

    def write(self, layer: int, rows: list[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key`` / ``value`` ``[len(rows), length, heads, head_dim]`` as those rows' states."""
        offsets = torch.arange(self.length, device=key.device)
        slots = (torch.tensor(rows, device=key.device)[:, None] * self.blocks_per_row * _BLOCK + offsets).flatten()
        reference.write_kv_cache(key.flatten(0, 1), value.flatten(0, 1), self.caches[layer], slots)

    def _fit(self, num_rows: int, device: torch.device) -> None:
        """Move the caches to ``device`` and grow them to ``num_rows`` rows (rows seldom outnumber max_num_seqs)."""
        for i, cache in enumerate(self.caches):
            cache = cache.to(device)
            missing = num_rows * self.blocks_per_row - cache.shape[1]
            if missing > 0:
                cache = torch.cat([cache, cache.new_zeros(2, max(missing, cache.shape[1]), *cache.shape[2:])], 1)
            self.caches[i] = cache


def _check_room(rows: int, row_bytes: int) -> None:
    """`ConfigError` naming ``max_num_seqs`` when a row per seat would take over half the device's free memory
    (large-v3: 245 MB a row in bfloat16), before the allocation fails with a bare out-of-memory error."""
    device = torch.get_default_device()
    if device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    if rows * row_bytes > free // 2:
        raise ConfigError("max_num_seqs", rows, f"at most {max(1, free // 2 // row_bytes)} on this device: each "
                                                f"request's cross-attention states take {row_bytes / 2**20:.0f} MB, "
                                                f"preallocated per seat ({free / 2**30:.1f} GiB free)")


class WhisperCrossAttention(nn.Module):
    """Attention of the decoder's tokens over their request's encoder rows (`CrossStates`): q scaled after its
    projection, k without bias, heads split over TP ranks."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg, tp = b.hf_config, b.tp
        width = cfg.hidden_size
        self.layer_idx, self.backend = layer_idx, b.attn_backend
        self.heads, self.head_dim = tp.split(cfg.num_attention_heads), width // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.query = ColumnParallelLinear(width, width, True, tp, b.dtype)
        self.key = ColumnParallelLinear(width, width, False, tp, b.dtype)
        self.value = ColumnParallelLinear(width, width, True, tp, b.dtype)
        self.out_proj = RowParallelLinear(width, width, True, tp, b.dtype)
        self.states: CrossStates | None = None
        """Set by the model once built (shared by every layer)."""

    def project(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder rows ``[N, length, width]`` -> this rank's keys and values ``[N, length, heads, head_dim]`` (the
        rows flat through the projections, as their LoRA layers take them)."""
        shape, flat = (*encoded.shape[:2], self.heads, self.head_dim), encoded.flatten(0, 1)
        return self.key(flat).view(shape), self.value(flat).view(shape)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        states = self.states
        assert states is not None and states.step is not None, "the model readies the step's cross states first"
        query = (self.query(hidden) * self.scaling).view(hidden.shape[0], self.heads, self.head_dim)
        out = self.backend.forward(query, None, None, states.caches[self.layer_idx], states.step, 1.0)
        return self.out_proj(out.reshape(hidden.shape[0], -1))


class WhisperDecoderLayer(OPTPreNormLayer):
    """Self-attention, cross-attention, MLP; each after a LayerNorm, each joining the residual stream."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.encoder_attn_layer_norm = BiasLayerNorm(b.hf_config.hidden_size, b.hf_config.rms_norm_eps, b.dtype)
        self.encoder_attn = WhisperCrossAttention(b, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        hidden, residual = self.encoder_attn_layer_norm(self.self_attn(positions, hidden, kv_cache, metadata), residual)
        hidden, residual = self.post_attention_layernorm(self.encoder_attn(hidden), residual)
        return self.mlp(hidden), residual


class WhisperDecoderModel(LearnedPositionModel):
    layer_cls = WhisperDecoderLayer
    norm_cls = BiasLayerNorm


class WhisperDecoder(GPT2LMHeadModel):
    """The decoder as a causal LM over the config's decoder fields (`decoder_view`)."""

    model_cls = WhisperDecoderModel
    conv1d = fused_qkv = False
    embedding_checkpoint_name = None  # not GPT-2's: loaded through WhisperForConditionalGeneration's names

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True, o_bias=True, mlp_bias=True, attention_scale=1.0)

    @classmethod
    def gpt_names(cls, hf_config: Any) -> dict[str, Any]:
        """The decoder's fields (``num_hidden_layers`` and ``num_attention_heads`` name the encoder's in
        transformers' ``WhisperConfig``: set on the view, they change only the view)."""
        heads = hf_config.decoder_attention_heads
        return dict(num_hidden_layers=hf_config.decoder_layers, num_attention_heads=heads, num_key_value_heads=heads,
                    head_dim=hf_config.d_model // heads, max_position_embeddings=hf_config.max_target_positions,
                    intermediate_size=hf_config.decoder_ffn_dim, hidden_act=hf_config.activation_function,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super(GPT2LMHeadModel, self).load_weights(_with_key_bias(weights))


def _with_key_bias(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """The self-attention's k has no bias; the fused q/k/v projection's zero rows for it."""
    for name, weight in weights:
        yield name, weight
        if name.endswith(".self_attn.k_proj.weight"):
            rows = weight.shape[0] if isinstance(weight, torch.Tensor) else weight.get_shape()[0]
            yield name.replace(".weight", ".bias"), torch.zeros(rows)


class WhisperEncoder(Qwen2AudioEncoder):
    """transformers' ``WhisperEncoder``: no pooling, every frame attended."""

    pooled = False


class WhisperForConditionalGeneration(VisionLanguageModel):
    """The encoder (``audio_tower``), the decoder (``language_model``) and their cross-attention states."""

    mm_takes_images = False
    mm_cross_attention = True
    """The encoder's rows feed the decoder's cross-attention (asyncllm/mm/embeddings.py,
    workers/mm_runner.py), not its input embeddings; each request has exactly one audio."""
    takes_state_rows = True
    """The loader passes ``state_rows``: a cross-attention state per worker row, preallocated."""
    keeps_request_states = True
    """Each step's metadata lists its rows on the host too (``request_rows_cpu``: no device sync to size them)."""
    cuda_graphs_off = "Whisper's cross-attention states are read by worker row (capturing them is not built)"

    @staticmethod
    def kv_cache_layers(hf_config: Any) -> int:
        """The decoder's layers (the encoder keeps no cache)."""
        return hf_config.decoder_layers

    @staticmethod
    def kv_cache_shapes(hf_config: Any) -> list[tuple[int, int]]:
        heads = hf_config.decoder_attention_heads
        return [(heads, hf_config.d_model // heads)] * hf_config.decoder_layers

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, state_rows: StateRows = StateRows(), **decoder_options: Any) -> None:
        super().__init__()
        if hf_config.activation_function != "gelu":
            raise NotBuiltError("activation_function", hf_config.activation_function, "Whisper with 'gelu'")
        self.audio_tower = WhisperEncoder(hf_config, dtype)
        self.language_model = WhisperDecoder(hf_config, dtype=dtype, tp=tp, attn_backend=attn_backend,
                                             max_position=max_position, **decoder_options)
        layers = [layer.encoder_attn for layer in self.language_model.model.layers]
        self.cross = CrossStates(len(layers), state_rows.rows, hf_config.max_source_positions, layers[0].heads,
                                 layers[0].head_dim, dtype)
        for attn in layers:
            attn.states = self.cross

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        self.cross.begin(attn_metadata, input_ids.shape[0], input_ids.device)
        if attn_metadata.encoder_outputs:
            with cross_adapters(self.language_model.model.layers[0].encoder_attn.key, attn_metadata, self.cross.length):
                self._write_cross_states(attn_metadata.encoder_outputs)
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def _write_cross_states(self, outputs: list[tuple[int, torch.Tensor]]) -> None:
        """Each layer's keys and values of the requests starting on this worker, from their encoder rows."""
        encoded = torch.stack([rows for _, rows in outputs]).to(self.audio_tower.conv1.weight.dtype)
        for layer in self.language_model.model.layers:
            key, value = layer.encoder_attn.project(encoded)
            self.cross.write(layer.encoder_attn.layer_idx, [row for row, _ in outputs], key, value)

    # ---- LoRA (asyncllm/models/lora.py): the decoder's self- and cross-attention and MLP
    packed_modules = WhisperDecoder.packed_modules

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """An adapter's decoder name (``model.layers.N.encoder_attn.q_proj``, ``model.layers.N.mlp.c_fc``) -> (our
        parameter name, shard id or None)."""
        name = _decoder_layer_name("language_model." + ckpt_name.replace(".encoder_attn.o_proj.", _CROSS_OUT))
        if ".encoder_attn." in name:
            return name, None
        inner, shard_id = self.language_model._packed(name.removeprefix("language_model."))
        return "language_model." + inner, shard_id

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int:
        """An audio takes the place of the prompt's ``<|startoftranscript|>`` (the decoder's start token)."""
        return int(hf_config.decoder_start_token_id)

    mm_audio_extractor_kwargs: dict[str, Any] = {}
    """The feature extractor's own defaults: ``chunk_length`` seconds of frames, a longer audio cut there."""
    mm_prompt_special_tokens = False
    """The prompt is the decoder's tokens as written: the tokenizer adds no prefix or ``<|endoftext|>``."""

    @staticmethod
    def mm_audio_windows(waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        return [waveform]

    @staticmethod
    def mm_audio_values(processed: Any) -> np.ndarray:
        """``[1, mel, frames]`` float32 log-mel features."""
        return processed["input_features"].astype("float32", copy=False)

    @staticmethod
    def mm_placeholder_length_of(hf_config: Any, values: np.ndarray) -> int:
        return 1

    def encoder_output_spec(self) -> tuple[int, torch.dtype]:
        """(width, dtype) of `embed_multimodal`'s rows."""
        weight = self.audio_tower.conv1.weight
        return weight.shape[0], weight.dtype

    def embed_multimodal(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, 1, mel, frames]`` -> each audio's ``[max_source_positions, d_model]`` encoder rows."""
        return list(self.audio_tower(values[:, 0].to(self.audio_tower.conv1.weight.dtype)))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return load_vision_language_weights(self, renamed(weights, _DECODER_NAMES), _decoder_layer_name, "Whisper")


def _decoder_layer_name(name: str) -> str:
    """A decoder layer's sublayer names as the shared layers call them (the encoder's stay transformers')."""
    if name.startswith("language_model."):
        for old, new in _LAYER_NAMES:
            if old in name:
                return name.replace(old, new)
    return name
