"""The decode memory-bandwidth roofline: the fastest decode the device's memory allows.

A decode step reads every weight once (the embedding table only through the
LM head when the two are tied: otherwise just the batch's rows) and the KV
cache of every running request. With the device's copy bandwidth measured by
a large device-to-device copy (bytes read + bytes written, over time), the
roofline is ``batch * bandwidth / (weight_bytes + batch * context * kv_bytes_per_token)``
output tokens/s. A sliding-window layer's decode reads at most its window of the context (the
attention kernels start at the window), so at a given context ``kv_bytes_per_token`` counts such a
layer's bytes times ``min(context, window) / context``. It ignores compute, prefill and the host, so
the fraction of it an engine reaches says how close to memory-bound its decode is.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["Roofline", "measure_copy_bandwidth", "model_bytes", "decode_roofline", "MXFP4_BYTES_PER_WEIGHT",
           "sync_device"]

MXFP4_BYTES_PER_WEIGHT = 17 / 32
"""An MXFP4 weight's bytes: 4 bits, and a one-byte exponent per 32 weights."""


@dataclass(frozen=True)
class Roofline:
    copy_bandwidth_gb_s: float
    """Measured device copy bandwidth, GB/s (1e9 bytes), read + write counted."""
    weight_bytes_per_step: int
    kv_bytes_per_token: float
    """KV bytes a decode step reads per token of the mean context (sliding-window layers: only their window)."""
    decode_batch: float
    """Requests a decode step decodes: the mean over the fastest schedule for ``throughput`` (`decode_shape`)."""
    mean_context: float
    """Mean tokens of context each decoding request reads (per output token)."""
    output_tokens_per_s: float
    """The roofline: decode output tokens/s at this batch and context."""

    def fraction(self, measured_tokens_per_s: float) -> float:
        return measured_tokens_per_s / self.output_tokens_per_s if self.output_tokens_per_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes/s of a large ``dst.copy_(src)`` on ``device``, counting the read and the write."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 27)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync_device(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync_device(device)
    elapsed = time.perf_counter() - start
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes * iters / elapsed


def model_bytes(
    path: str, dtype: torch.dtype, decode_batch: float = 1, kv_cache_dtype: str = "auto", quantization: str | None = None,
    mean_context: float | None = None, mxfp4_packed: bool = False, int_packed: bool = True,
) -> tuple[int, float]:
    """(weight bytes one decode step of ``decode_batch`` requests reads, KV-cache bytes per token).

    Counted on the model built on the meta device (`_built_model_bytes`: every family's own modules, a hybrid's
    attention caches only), but for MXFP4 experts served packed (``mxfp4_packed``), whose bytes are counted from the
    config with the family's flags as asyncllm's Llama-style decoder lays its parameters out. A mixture-of-experts
    layer reads its router, shared expert, and the experts the batch routes to:
    ``E * (1 - (1 - k / E) ** batch)`` of them on average under uniform routing
    (k at batch 1, all of them for large batches). With ``quantization="fp8"``
    the decoder's linear weights count one byte each (docs/quantization.md), with
    an fp8 ``kv_cache_dtype`` the KV cache one byte per element. A pre-quantized checkpoint's quantized linears and
    experts (fp8, AWQ, GPTQ, compressed-tensors: its ``quantization_config``) count as the engine serves them
    (`_ServedWeight`; integer ones in the model dtype unless ``int_packed``: the CPU dequantizes them at load).
    gpt-oss adds its attention sinks
    and its router's and experts' biases (the experts' as expected, like their weights); with ``mxfp4_packed`` (an
    MXFP4 checkpoint's experts served packed: `mxfp4_experts.serves_packed`) its expert weights count
    `MXFP4_BYTES_PER_WEIGHT` each, else the model dtype's (dequantized at load: docs/gpt-oss.md).

    The KV bytes per token are what the cache stores per token (every layer keeps a request's whole
    context), or, given ``mean_context``, what a decode step at that context reads per token of it: a
    sliding-window layer's share scaled by ``min(mean_context, window) / mean_context``.
    """
    from asyncllm.models.checkpoint import checkpoint_quantization
    from asyncllm.models.layers import head_dim_of
    from asyncllm.models.llama import sliding_window_of
    from asyncllm.models.loader import load_hf_config
    from asyncllm.models.registry import get_model_class, kv_cache_spec, kv_cache_torch_dtype

    cfg = load_hf_config(path)
    model_cls = get_model_class(cfg)
    if not (mxfp4_packed and checkpoint_quantization(cfg) == "mxfp4"):  # counted on the model
        return _built_model_bytes(path, cfg, dtype, decode_batch, kv_cache_dtype, quantization, mean_context,
                                  int_packed)
    flags = model_cls.decoder_flags(cfg)  # type: ignore[attr-defined]
    hidden, head_dim = cfg.hidden_size, head_dim_of(cfg)
    q_size, kv_size = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    linear = hidden * (q_size + 2 * kv_size) + q_size * hidden  # the attention's projections
    other = 2 * hidden + (q_size + 2 * kv_size) * flags.qkv_bias + hidden * flags.o_bias + 2 * head_dim * flags.qk_norm
    other += cfg.num_attention_heads * getattr(model_cls, "attention_sinks", False)  # one logit per query head
    itemsize = torch.empty((), dtype=dtype).element_size()
    # gpt-oss's MXFP4 experts served packed (docs/gpt-oss.md), counted in parameters of ``dtype``
    packed = MXFP4_BYTES_PER_WEIGHT / itemsize if mxfp4_packed and checkpoint_quantization(cfg) == "mxfp4" else 1.0
    layers = [_mlp_params(model_cls, cfg, i, flags.mlp_bias, decode_batch, packed)
              for i in range(cfg.num_hidden_layers)]
    linear = cfg.num_hidden_layers * linear + sum(mlp_linear for mlp_linear, _ in layers)
    # the LM head reads the whole vocabulary matrix; a separate embedding table only the batch's rows
    other = cfg.num_hidden_layers * other + sum(mlp_other for _, mlp_other in layers) + hidden + cfg.vocab_size * hidden
    linear_itemsize = 1 if quantization == "fp8" else itemsize
    kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    spec = kv_cache_spec(cfg, 1)
    layer_kv = spec.bytes_per_block(1, kv_dtype) // spec.num_layers  # one token of one layer, K and V
    kv_per_token = sum(layer_kv * _window_share(sliding_window_of(cfg, i), mean_context)
                       for i in range(cfg.num_hidden_layers))
    return int(linear * linear_itemsize + other * itemsize), kv_per_token


def _built_model_bytes(path: str, cfg: Any, dtype: torch.dtype, decode_batch: float, kv_cache_dtype: str,
                       quantization: str | None, mean_context: float | None, int_packed: bool = True
                       ) -> tuple[int, float]:
    """`model_bytes` counted on the model itself, built on the meta device: each linear layer whole (one byte per
    weight under fp8; a pre-quantized checkpoint's quantized ones as served, `_prequantized_bytes`), the LM head
    whole, an embedding table not at all (a step reads only its batch's rows), the
    stacked experts times the share of them the batch routes to (wherever a layer keeps them), every other parameter
    whole (a learned position table, GPT-2's, not at all: its batch's rows); the KV bytes per token
    summed over the layers, a KV-sharing layer reading its source layer's cache (Gemma 4), a latent cache
    (DeepSeek) one part, a hybrid (Kimi-Linear) its attention layers' caches, an attention-free model (Mamba) none.
    A multimodal model counts its language model (Gemma 3's: no encoder runs in a decode step). The count of every
    family but packed MXFP4 experts: a two-matrix MLP (Phi, StarCoder2), extra norms (Gemma 2),
    a config without Llama's ``num_key_value_heads`` (GPT-2, OPT, GPT-J, MPT) are what the model holds."""
    from asyncllm.config import EngineConfig
    from asyncllm.models.embedding import ParallelLMHead, VocabParallelEmbedding
    from asyncllm.models.fp8_online_experts import takes_online_fp8
    from asyncllm.models.gpt2 import LearnedPositions
    from asyncllm.models.linear import LinearBase
    from asyncllm.models.llama import sliding_window_of
    from asyncllm.models.loader import build_model
    from asyncllm.models.moe import FusedMoE
    from asyncllm.models.registry import kv_cache_spec, kv_cache_torch_dtype

    built = build_model(EngineConfig.create(path), cfg, torch.device("cpu"), dtype, tensor_device=torch.device("meta"))
    model = getattr(built, "language_model", built)  # a multimodal model's decoder: no encoder runs in a decode step
    spec_cfg, cfg = cfg, cfg if hasattr(cfg, "num_hidden_layers") else cfg.text_config
    itemsize = torch.empty((), dtype=dtype).element_size()
    linear_itemsize = 1 if quantization == "fp8" else itemsize
    specs = [type(model).moe_spec(cfg, i) for i in range(cfg.num_hidden_layers)] if getattr(model, "is_moe", False) \
        else []
    top_k = {id(moe): spec.top_k for layer, spec in zip(model.model.layers, specs) if spec is not None
             for moe in layer.modules() if isinstance(moe, FusedMoE)}  # wherever the layer keeps its experts
    served = _prequantized_bytes(built, spec_cfg, path, quantization, int_packed)  # id(module) -> (bytes, numel)
    total = 0.0
    for module in model.modules():
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        if isinstance(module, ParallelLMHead) or not isinstance(module, (VocabParallelEmbedding, LearnedPositions)):
            share = 1.0
            if isinstance(module, FusedMoE):
                share = 1 - (1 - top_k[id(module)] / module.num_local_experts) ** max(1, decode_batch)
            if id(module) in served:  # its quantized weights as served, its other parameters (biases) as built
                quantized, replaced = served[id(module)]
                total += (quantized + (numel - replaced) * itemsize) * share
                continue
            fp8 = isinstance(module, LinearBase) or isinstance(module, FusedMoE) and takes_online_fp8(module)
            total += numel * share * (linear_itemsize if fp8 else itemsize)
    kv_itemsize = torch.empty((), dtype=kv_cache_torch_dtype(kv_cache_dtype, dtype)).element_size()
    if hasattr(type(model), "kv_cache_spec_of"):  # attention-free (Mamba): no KV cache is read
        return int(total), 0.0
    spec = kv_cache_spec(spec_cfg, 1)
    shapes, parts = spec.shapes(), spec.kv_parts
    # Gemma 4: layers share caches; a hybrid (Kimi-Linear) has a cache only for its attention layers
    layout = getattr(model.model, "cache_of_layer", range(len(shapes)))
    per_layer = (parts * kv_itemsize * heads * dim for heads, dim in (shapes[c] for c in layout))
    if mean_context is None:  # what the cache stores per token: each cache once
        return int(total), float(sum(parts * kv_itemsize * heads * dim for heads, dim in shapes))
    windows = (_window_share(sliding_window_of(cfg, i), mean_context) for i in range(cfg.num_hidden_layers))
    return int(total), float(sum(b * w for b, w in zip(per_layer, windows)))


@dataclass(frozen=True)
class _ServedWeight:
    """How the engine serves a pre-quantized checkpoint's weight matrix: ``bits`` per weight and, for the integer
    formats (AWQ, GPTQ, compressed-tensors pack-quantized: ``group`` set), a scale and a zero point of
    ``scale_bytes`` each per ``group`` inputs of each output row (-1: the whole input) and, GPTQ act-order
    (``g_idx``), an int32 group index per input; for fp8 and int8 weights a float32 scale per ``block`` (rows,
    columns), per output row (``per_row``) or one per matrix."""

    bits: int
    group: int = 0
    block: tuple[int, int] | None = None
    per_row: bool = False
    g_idx: bool = False

    def nbytes(self, rows: int, cols: int, scale_bytes: int) -> float:
        if self.group:
            groups = -(-cols // self.group) if self.group > 0 else 1
            return rows * cols * self.bits / 8 + 2 * scale_bytes * rows * groups + 4 * cols * self.g_idx
        scales = -(-rows // self.block[0]) * -(-cols // self.block[1]) if self.block else rows if self.per_row else 1
        return rows * cols * self.bits / 8 + 4 * scales


def _served_weight(qcfg: Any, checkpoint_module: str, int_packed: bool) -> _ServedWeight | None:
    """The `_ServedWeight` of a checkpoint module under a pre-quantized config (asyncllm/models/checkpoint.py's
    `prequantized_config`), None where it is served in the model dtype: a module the config leaves unquantized
    (``ignore``, ``modules_to_not_convert``, ``ignored_layers``, the LM head), or integer weights off CUDA
    (``int_packed`` False: dequantized at load)."""
    from asyncllm.models.checkpoint import Fp8CheckpointConfig
    from asyncllm.models.compressed_tensors_config import CompressedTensorsCheckpointConfig
    from asyncllm.models.int4_config import Int4CheckpointConfig

    if isinstance(qcfg, Fp8CheckpointConfig):  # per tensor: requantized to one scale (fp8_checkpoint.py)
        return None if qcfg.is_ignored(checkpoint_module) else _ServedWeight(8, block=qcfg.weight_block_size)
    if isinstance(qcfg, Int4CheckpointConfig):
        if qcfg.is_ignored(checkpoint_module) or not int_packed:
            return None
        return _ServedWeight(qcfg.bits, qcfg.group_size, g_idx=qcfg.desc_act)
    if isinstance(qcfg, CompressedTensorsCheckpointConfig):
        scheme = qcfg.scheme_of(checkpoint_module)
        if scheme is None or scheme.kind == "int" and not int_packed:
            return None
        if scheme.kind == "int":
            return _ServedWeight(scheme.bits, scheme.group_size)
        return _ServedWeight(8, block=scheme.block, per_row=True)  # a per-tensor scale repeated over its rows
    return None  # a float checkpoint, gpt-oss's MXFP4 (counted apart), GGUF (dequantized at load)


def _prequantized_bytes(built: Any, hf_config: Any, path: str, quantization: str | None, int_packed: bool
                        ) -> dict[int, tuple[float, int]]:
    """``id(module) -> (bytes of its quantized weights as served, the model-dtype parameters they replace)`` for
    every linear layer (its ``weight``) and `FusedMoE` (its ``w13_weight`` / ``w2_weight``, each expert's gate, up
    and down matrices apart) a pre-quantized checkpoint quantized; empty for a float one. Integer scales and zero
    points are served float16 in dense layers (their checkpoints' scales are float16 values), float32 in experts."""
    from asyncllm.models.checkpoint import prequantized_config
    from asyncllm.models.int4_experts import expert_checkpoint_module
    from asyncllm.models.moe import FusedMoE
    from asyncllm.models.quantized_layers import checkpoint_modules, quantized_layers

    qcfg = prequantized_config(hf_config, path, quantization)
    if qcfg is None:
        return {}
    served: dict[int, tuple[float, int]] = {}
    for name, layer in quantized_layers(built, lambda module: _served_weight(qcfg, module, int_packed) is None):
        fmt = _served_weight(qcfg, checkpoint_modules(built, name)[0], int_packed)
        assert fmt is not None
        served[id(layer)] = fmt.nbytes(*layer.weight.shape, scale_bytes=2), layer.weight.numel()
    for name, moe in built.named_modules():
        if isinstance(moe, FusedMoE) and (fmt := _served_weight(qcfg, expert_checkpoint_module(built, name),
                                                                int_packed)) is not None:
            experts, hidden, inter = moe.w2_weight.shape
            matrices = moe.w13_weight.shape[1] // inter  # gate and up (one without a gate)
            nbytes = experts * (matrices * fmt.nbytes(inter, hidden, 4) + fmt.nbytes(hidden, inter, 4))
            served[id(moe)] = nbytes, moe.w13_weight.numel() + moe.w2_weight.numel()
    return served


def _window_share(window: int | None, mean_context: float | None) -> float | int:
    """The share of a context of ``mean_context`` tokens a layer with attention window ``window`` reads."""
    if window is None or mean_context is None or mean_context <= window:
        return 1
    return window / mean_context


def _mlp_params(model_cls: Any, cfg: Any, layer_idx: int, mlp_bias: bool, decode_batch: float, packed: float = 1.0
                ) -> tuple[float, float]:
    """(parameters fp8 quantization turns into fp8, others) of layer ``layer_idx``'s MLP a decode step reads
    (expected, for a mixture of experts: its experts are quantized too, but for gpt-oss's, whose expert weights count
    ``packed`` parameters each: MXFP4's bytes; its router is not)."""
    hidden = cfg.hidden_size
    spec = model_cls.moe_spec(cfg, layer_idx) if getattr(model_cls, "is_moe", False) else None
    if spec is None:  # a dense MLP (Llama 4's dense layers: intermediate_size_mlp)
        inter = getattr(cfg, "intermediate_size_mlp", None) or cfg.intermediate_size
        return 3 * hidden * inter, (2 * inter + hidden) * mlp_bias
    experts = spec.num_experts * (1 - (1 - spec.top_k / spec.num_experts) ** max(1, decode_batch))
    shared_gate = hidden if spec.shared_expert_size else 0
    expert = 3 * hidden * spec.intermediate_size
    router = spec.num_experts * hidden
    if getattr(model_cls, "moe_biases", False):  # gpt-oss: the router's bias, each expert's gate/up and down biases
        router += spec.num_experts
        expert = expert * packed + 2 * spec.intermediate_size + hidden
        return 3 * hidden * spec.shared_expert_size, router + experts * expert + shared_gate  # float under fp8
    return 3 * hidden * spec.shared_expert_size + experts * expert, router + shared_gate


def decode_roofline(
    path: str, dtype: torch.dtype, bandwidth: float, decode_batch: float, mean_context: float,
    kv_cache_dtype: str = "auto", quantization: str | None = None, mxfp4_packed: bool = False,
    int_packed: bool = True,
) -> Roofline:
    batch = max(1, decode_batch)
    weight_bytes, kv_per_token = model_bytes(path, dtype, batch, kv_cache_dtype, quantization, mean_context,
                                             mxfp4_packed, int_packed)
    step_bytes = weight_bytes + batch * mean_context * kv_per_token
    return Roofline(
        copy_bandwidth_gb_s=bandwidth / 1e9,
        weight_bytes_per_step=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        decode_batch=batch,
        mean_context=mean_context,
        output_tokens_per_s=batch * bandwidth / step_bytes,
    )
