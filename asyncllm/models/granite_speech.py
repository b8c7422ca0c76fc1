"""Granite Speech (``GraniteSpeechForConditionalGeneration``: ibm-granite/granite-speech-3.2-8b, -3.3-2b, -3.3-8b):
a Conformer audio encoder, a windowed BLIP-2 Q-Former projector and the Granite decoder of granite.py.

The host makes each audio's log-mel features without torchaudio (asyncllm/mm/granite_speech_audio.py): ``[frames,
2 * n_mels]`` float32, two 10 ms mel frames per row. The encoder (transformers' ``GraniteSpeechCTCEncoder``): a
linear layer, then Conformer blocks (half a SiLU feed-forward, attention, a convolution module, another half
feed-forward, a LayerNorm). The attention runs within blocks of ``context_size`` rows (the last block's padded keys
masked), its scores biased by Shaw's relative positions: each query's dot product with a learned embedding of its
clamped distance to each key. The convolution module: a pointwise convolution into a GLU, a depthwise convolution of
``conv_kernel_size`` (one more frame on the left than the right when even), batch normalization with its running
statistics, SiLU, a pointwise convolution. After the middle block, the CTC head's softmax is projected back and added
(``out`` then ``out_mid``). The projector cuts the rows into windows of ``window_size`` (zeros past the end) and
lets ``window_size / downsample_rate`` learned queries read each window through the Q-Former (self-attention over the
queries, cross-attention into the window every ``cross_attention_frequency`` layers, a GELU feed-forward, post-norm),
then a linear layer to the decoder's width. Those rows replace the prompt's ``<|audio|>`` placeholders, scaled by
the decoder's ``embedding_multiplier`` as its token embeddings are. The encoder and projector are whole on every
tensor-parallel rank; the decoder splits as Granite's and takes LoRA adapters (the checkpoints' own audio adapter is
passed as a `LoRARequest`: docs/multimodal.md#granite-speech).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.mm.granite_speech_audio import GraniteSpeechFeatures, granite_speech_rows
from asyncllm.models.granite import GraniteForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from asyncllm.models.vision_language import (
    VisionLanguageModel, build_decoder, load_vision_language_weights, text_config_of,
)

__all__ = ["GraniteSpeechEncoder", "GraniteSpeechForConditionalGeneration", "GraniteSpeechProjector"]


class ConformerFeedForward(nn.Module):
    def __init__(self, dim: int, mult: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(dim, dtype=dtype)
        self.up_proj = nn.Linear(dim, dim * mult, dtype=dtype)
        self.down_proj = nn.Linear(dim * mult, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(self.pre_norm(x))))


class ConformerAttention(nn.Module):
    """Attention within blocks of ``context_size`` rows, with Shaw's relative-position score bias."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if not 0 < cfg.context_size <= cfg.max_pos_emb:
            raise NotBuiltError("encoder_config.context_size", cfg.context_size,
                                f"between 1 and max_pos_emb ({cfg.max_pos_emb})")
        self.heads, self.head_dim, self.context = cfg.num_heads, cfg.dim_head, cfg.context_size
        self.max_pos_emb = cfg.max_pos_emb
        inner = cfg.num_heads * cfg.dim_head
        self.pre_norm = nn.LayerNorm(cfg.hidden_dim, dtype=dtype)
        self.to_q = nn.Linear(cfg.hidden_dim, inner, bias=False, dtype=dtype)
        self.to_kv = nn.Linear(cfg.hidden_dim, 2 * inner, bias=False, dtype=dtype)
        self.to_out = nn.Linear(inner, cfg.hidden_dim, dtype=dtype)
        self.rel_pos_emb = nn.Embedding(2 * cfg.max_pos_emb + 1, cfg.dim_head, dtype=dtype)

    def _position_bias(self, q: torch.Tensor) -> torch.Tensor:
        """``[blocks, heads, c, c]``: each query's product with the embedding of its distance to each key."""
        index = torch.arange(self.context, device=q.device)
        distance = (index[:, None] - index[None, :]).clamp(-self.context, self.context) + self.max_pos_emb
        return torch.einsum("bhqd,qkd->bhqk", q, self.rel_pos_emb(distance)) * self.head_dim ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        blocks = -(-length // self.context)
        x = F.pad(self.pre_norm(x), (0, 0, 0, blocks * self.context - length))

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch * blocks, self.context, self.heads, self.head_dim).transpose(1, 2)

        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = heads(self.to_q(x)), heads(k), heads(v)
        bias = self._position_bias(q)
        last = length - (blocks - 1) * self.context
        if last < self.context:  # the last block's padded keys
            padded = torch.arange(self.context, device=x.device) >= last
            bias.view(batch, blocks, *bias.shape[1:])[:, -1].masked_fill_(padded, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.head_dim ** -0.5)
        out = out.transpose(1, 2).reshape(batch, blocks * self.context, -1)
        return self.to_out(out[:, :length])


class DepthwiseConv(nn.Module):
    """A per-channel convolution padded to keep the length (one more frame on the left for an even kernel)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.padding = (kernel // 2, kernel // 2 - (kernel + 1) % 2)
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding))


class FrozenBatchNorm(nn.Module):
    """Batch normalization by its saved running statistics (held as parameters, so they load as weights; the
    variances floored at 0, which a checkpoint's are: `load_format="dummy"` draws some below)."""

    def __init__(self, channels: int, dtype: torch.dtype, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            setattr(self, name, nn.Parameter(torch.full((channels,), value, dtype=dtype), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = self.running_var.clamp(min=0.0)
        return F.batch_norm(x, self.running_mean, variance, self.weight, self.bias, False, 0.0, self.eps)


class ConformerConvModule(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim, inner = cfg.hidden_dim, cfg.hidden_dim * cfg.conv_expansion_factor
        self.norm = nn.LayerNorm(dim, dtype=dtype)
        self.up_conv = nn.Conv1d(dim, 2 * inner, 1, dtype=dtype)
        self.depth_conv = DepthwiseConv(inner, cfg.conv_kernel_size, dtype)
        self.batch_norm = FrozenBatchNorm(inner, dtype)
        self.down_conv = nn.Conv1d(inner, dim, 1, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.glu(self.up_conv(self.norm(x).transpose(1, 2)), dim=1)
        x = F.silu(self.batch_norm(self.depth_conv(x)))
        return self.down_conv(x).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.ff1 = ConformerFeedForward(cfg.hidden_dim, cfg.feedforward_mult, dtype)
        self.attn = ConformerAttention(cfg, dtype)
        self.conv = ConformerConvModule(cfg, dtype)
        self.ff2 = ConformerFeedForward(cfg.hidden_dim, cfg.feedforward_mult, dtype)
        self.post_norm = nn.LayerNorm(cfg.hidden_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(x)
        x = x + self.conv(x)
        return self.post_norm(x + 0.5 * self.ff2(x))


class GraniteSpeechEncoder(nn.Module):
    """``[B, frames, input_dim]`` log-mel rows -> ``[B, frames, hidden_dim]`` (transformers' ``GraniteSpeechCTCEncoder``),
    the CTC head's softmax fed back after the middle block."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_linear = nn.Linear(cfg.input_dim, cfg.hidden_dim, dtype=dtype)
        self.layers = nn.ModuleList(ConformerBlock(cfg, dtype) for _ in range(cfg.num_layers))
        self.out = nn.Linear(cfg.hidden_dim, cfg.output_dim, dtype=dtype)
        self.out_mid = nn.Linear(cfg.output_dim, cfg.hidden_dim, dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.input_linear(features)
        for index, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if index == len(self.layers) // 2:
                x = x + self.out_mid(torch.softmax(self.out(x), dim=-1))
        return x


class QFormerResidual(nn.Module):
    """``LayerNorm(dense(x) + residual)`` (BERT's output layers)."""

    def __init__(self, width: int, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(width, dim, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(dim, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class QFormerProjections(nn.Module):
    def __init__(self, dim: int, kv_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.query = nn.Linear(dim, dim, dtype=dtype)
        self.key = nn.Linear(kv_dim, dim, dtype=dtype)
        self.value = nn.Linear(kv_dim, dim, dtype=dtype)


class QFormerAttention(nn.Module):
    """Bidirectional attention of the queries over themselves (``states`` None) or over a window's rows."""

    def __init__(self, cfg: Any, kv_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.attention = QFormerProjections(cfg.hidden_size, kv_dim, dtype)
        self.output = QFormerResidual(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        source = x if states is None else states

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(*t.shape[:2], self.heads, -1).transpose(1, 2)

        proj = self.attention
        out = F.scaled_dot_product_attention(heads(proj.query(x)), heads(proj.key(source)), heads(proj.value(source)))
        return self.output(out.transpose(1, 2).flatten(2), x)


class QFormerIntermediate(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)


class QFormerLayer(nn.Module):
    def __init__(self, cfg: Any, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = QFormerAttention(cfg, cfg.hidden_size, dtype)
        if index % cfg.cross_attention_frequency == 0:
            self.crossattention = QFormerAttention(cfg, cfg.encoder_hidden_size, dtype)
        self.intermediate_query = QFormerIntermediate(cfg, dtype)
        self.output_query = QFormerResidual(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        if hasattr(self, "crossattention"):
            x = self.crossattention(x, states)
        return self.output_query(F.gelu(self.intermediate_query.dense(x)), x)


class QFormerEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(QFormerLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))


class QFormer(nn.Module):
    """BLIP-2's Q-Former over learned queries alone (no text input): transformers' ``Blip2QFormerModel``."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        _check_qformer(cfg)
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.encoder = QFormerEncoder(cfg, dtype)

    def forward(self, queries: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        x = self.layernorm(queries)
        for layer in self.encoder.layer:
            x = layer(x, states)
        return x


def _check_qformer(cfg: Any) -> None:
    """`NotBuiltError` for a Q-Former config this file does not compute as transformers does."""
    if cfg.hidden_act != "gelu":
        raise NotBuiltError("projector_config.hidden_act", cfg.hidden_act, "'gelu'")
    if getattr(cfg, "use_qformer_text_input", False):
        raise NotBuiltError("projector_config.use_qformer_text_input", True, "False (the queries alone)")


class GraniteSpeechProjector(nn.Module):
    """Encoder rows -> ``window_size / downsample_rate`` decoder-width rows per window of ``window_size`` rows."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = hf_config.projector_config
        if cfg.encoder_hidden_size != hf_config.encoder_config.hidden_dim:
            raise NotBuiltError("projector_config.encoder_hidden_size", cfg.encoder_hidden_size,
                                f"the encoder's hidden_dim ({hf_config.encoder_config.hidden_dim})")
        self.window = hf_config.window_size
        queries = hf_config.window_size // hf_config.downsample_rate
        self.query = nn.Parameter(torch.zeros(1, queries, cfg.hidden_size, dtype=dtype))
        self.qformer = QFormer(cfg, dtype)
        self.linear = nn.Linear(cfg.hidden_size, text_config_of(hf_config).hidden_size, dtype=dtype)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``[B, frames, encoder width]`` -> ``[B, windows * queries, text width]``."""
        batch, length, width = rows.shape
        windows = -(-length // self.window)
        rows = F.pad(rows, (0, 0, 0, windows * self.window - length)).view(batch * windows, self.window, width)
        out = self.qformer(self.query.expand(batch * windows, -1, -1), rows)
        return self.linear(out.reshape(batch, -1, out.shape[-1]))


class GraniteSpeechForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Audio rows replace the ``<|audio|>`` placeholder embeddings; the rest is the Granite decoder (Qwen2-Audio's
    hooks, weight names and LoRA routing)."""

    mm_feature_extractor_class = GraniteSpeechFeatures
    """transformers' ``GraniteSpeechFeatureExtractor`` needs torchaudio: the host computes the features itself."""
    mm_audio_extractor_kwargs: dict[str, Any] = {}

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        VisionLanguageModel.__init__(self)  # Qwen2-Audio's builds its own parts
        self.encoder = GraniteSpeechEncoder(hf_config.encoder_config, dtype)
        self.projector = GraniteSpeechProjector(hf_config, dtype)
        self.language_model = build_decoder(hf_config, {"granite": GraniteForCausalLM}, "Granite Speech",
                                            mm_encoder_tp_mode, dtype=dtype, tp=tp, attn_backend=attn_backend,
                                            max_position=max_position, **decoder_options)
        self.embedding_multiplier = float(text_config_of(hf_config).embedding_multiplier)

    @classmethod
    def mm_audio_windows(cls, waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        """The whole audio (the encoder's attention is local: no 30 s window)."""
        return [waveform]

    @staticmethod
    def mm_audio_values(processed: Any) -> np.ndarray:
        """``[1, frames, 2 * n_mels]`` float32: one audio's log-mel rows."""
        return processed["input_features"].astype("float32", copy=False)

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, values: np.ndarray) -> int:
        return granite_speech_rows(values.shape[-2], hf_config.window_size, hf_config.downsample_rate)

    def embed_multimodal(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, 1, frames, 2 * n_mels]`` audios of one length -> each audio's ``[placeholders, text hidden]`` rows,
        scaled as the decoder scales token embeddings."""
        features = values[:, 0].to(self.encoder.input_linear.weight.dtype)
        return list(self.projector(self.encoder(features)) * self.embedding_multiplier)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The original names (``encoder.``, ``projector.``, ``language_model.model.``) or transformers 5's
        (``model.encoder.`` ...); batch normalization's ``num_batches_tracked`` counters are not needed."""
        return load_vision_language_weights(self, weights, normalize_llava_name, type(self).__name__,
                                            ignored_suffixes=(".num_batches_tracked",))
