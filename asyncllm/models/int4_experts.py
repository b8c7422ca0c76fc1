"""Integer experts of a mixture of experts: AWQ / GPTQ (Qwen3-30B-A3B-AWQ, -GPTQ-Int4) and compressed-tensors'
pack-quantized W4A16 / W8A16 (RedHatAI's ``*-quantized.w4a16``).

A checkpoint stores each expert's gate, up and down matrices in its format (asyncllm/models/int4_checkpoint.py:
AWQ ``qweight [in, out/8]``, GPTQ ``qweight [in/p, out]``, their ``qzeros``, ``scales`` and GPTQ's ``g_idx``;
asyncllm/models/compressed_tensors.py: ``weight_packed [out, in/p]``, ``weight_scale [out, groups]``, an asymmetric
scheme's ``weight_zero_point [out/p, groups]``, ``weight_shape``).
`make_int4_expert_params` gives each `FusedMoE` this rank's part of them as staging parameters (``gate_qweight``,
``up_scales``, ``down_g_idx``, ... stacked over its experts: the gate and up split by their output columns, the
down by its input rows, or whole experts with expert parallelism), which the checkpoint fills; then
`finish_int4_experts` either repacks them into `reference.IntExperts`' layout (on a GPU: the fused-MoE kernel's
integer path reads them packed) or dequantizes every expert in float32, rounds it to the model dtype once and
stacks it into the float ``w13`` / ``w2`` weights (the CPU), dropping the staging tensors. Either computes what the
dequantized weights compute. GPTQ's act-order (``desc_act``) experts take each input row's group from its
``g_idx`` (a rank splitting a down matrix by its rows keeps every group's scales); kept packed, each matrix's ``g_idx``
goes with them (``w13_g_idx`` / ``w2_g_idx``: gate and up share theirs, else the experts are dequantized, logged).
``cfg`` is an
`Int4CheckpointConfig`, or for compressed-tensors a `ct_format` of the experts' scheme (method ``"ct"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.int4_checkpoint import UnpackedWeight, _awq_unpack, unpack_columns
from asyncllm.models.int4_config import Int4CheckpointConfig
from asyncllm.models.layers import LoadedWeight, check_whole_size, copy_weight, new_param, weight_narrow
from asyncllm.models.moe import FusedMoE

__all__ = ["make_int4_expert_params", "finish_int4_experts", "draw_int4_experts", "ct_format",
           "expert_checkpoint_module"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CtExperts:
    """A compressed-tensors pack-quantized scheme, as the staging reads it (`Int4CheckpointConfig`'s fields)."""

    bits: int
    group_size: int
    symmetric: bool
    is_ignored: Callable[[str], bool]
    method: str = "ct"
    desc_act: bool = False
    zero_offset: int = 0

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits


def ct_format(scheme: Any, is_ignored: Callable[[str], bool]) -> CtExperts:
    """The staging's view of a compressed-tensors int scheme (``CompressedTensorsScheme``)."""
    return CtExperts(scheme.bits, scheme.group_size, scheme.symmetric, is_ignored)


_KINDS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "ct": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}


def expert_checkpoint_module(model: nn.Module, name: str) -> str:
    """The checkpoint's module name of the first expert's down matrix of the `FusedMoE` ``name`` (the model's
    checkpoint names: ``...experts.0.down_proj``, Mixtral's ``...block_sparse_moe.experts.0.w2``)."""
    unpacked = getattr(model, "_unpacked", None)
    if unpacked is None:
        return f"{name}.0.down_proj"
    return unpacked(f"{name}.w2_weight")[0][0].removesuffix(".weight")


def _quantized_experts(model: nn.Module, cfg: Any) -> Iterator[tuple[str, FusedMoE]]:
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not cfg.is_ignored(expert_checkpoint_module(model, name)):
            yield name, module


def _kinds(cfg: Any) -> tuple[str, ...]:
    kinds = _KINDS[cfg.method]
    return tuple(k for k in kinds if k != "weight_zero_point" or not cfg.symmetric)


def _shape(moe: FusedMoE, part: str, kind: str, cfg: Any, hidden: int) -> tuple[int, ...]:
    """A staging tensor's shape: ``[experts, ...]`` of this rank's rows and columns in the checkpoint's layout (an
    act-order down matrix: every group's scales and zero points, its rows' groups being any)."""
    k, n = (moe.intermediate, hidden) if part == "down" else (hidden, moe.intermediate)
    pack, groups = cfg.pack_factor, -(-(moe.whole_intermediate if _all_groups(moe, part, cfg) else k)
                                      // _group(moe, part, cfg, hidden))
    shapes = {"qweight": (k, n // pack) if cfg.method == "awq" else (k // pack, n),
              "qzeros": (groups, n // pack), "scales": (groups, n), "g_idx": (k,),
              "weight_packed": (n, k // pack), "weight_scale": (n, groups), "weight_zero_point": (n // pack, groups),
              "weight_shape": (2,)}
    return (moe.num_local_experts, *shapes[kind])


def _all_groups(moe: FusedMoE, part: str, cfg: Any) -> bool:
    """Whether this rank keeps every group's scales and zero points of ``part``: an act-order down matrix split by
    its input rows (each row's group is its ``g_idx``'s, anywhere)."""
    return cfg.desc_act and part == "down" and moe.tp.size > 1 and not moe.expert_parallel


def _group(moe: FusedMoE, part: str, cfg: Int4CheckpointConfig, hidden: int) -> int:
    if cfg.group_size > 0:
        return cfg.group_size
    return moe.whole_intermediate if part == "down" else hidden  # one group for a whole (unsplit) input


def _check(name: str, moe: FusedMoE, cfg: Int4CheckpointConfig) -> None:
    split = moe.tp.size > 1 and not moe.expert_parallel
    bad_pack = moe.intermediate % cfg.pack_factor
    bad_group = split and not cfg.desc_act and (cfg.group_size <= 0 or moe.intermediate % cfg.group_size)
    if bad_pack or bad_group:
        raise ConfigError("tensor_parallel_size", moe.tp.size, f"a split of {name}'s experts on whole packs and "
                                                               f"groups ({moe.intermediate} intermediate rows per "
                                                               "rank): try enable_expert_parallel")


def make_int4_expert_params(model: nn.Module, cfg: Int4CheckpointConfig) -> int:
    """Staging parameters for every quantized `FusedMoE` (its float ``w13`` / ``w2`` dropped); how many."""
    count = 0
    for name, moe in _quantized_experts(model, cfg):
        _check(name, moe, cfg)
        hidden, device = moe.w13_weight.shape[2], moe.w13_weight.device
        moe.int4_shape = (tuple(moe.w13_weight.shape), tuple(moe.w2_weight.shape), moe.w13_weight.dtype)
        del moe.w13_weight, moe.w2_weight
        with torch.device(device):
            for part in moe.parts:
                for kind in _kinds(cfg):
                    dtype = {"scales": torch.float32, "weight_scale": torch.float32,
                             "weight_shape": torch.int64}.get(kind, torch.int32)
                    loader = lambda param, loaded, shard, p=part, k=kind, m=moe: _load(m, p, k, cfg, param, loaded,
                                                                                      shard)
                    setattr(moe, f"{part}_{kind}", new_param(*_shape(moe, part, kind, cfg, hidden), dtype=dtype,
                                                             loader=loader))
        count += 1
    return count


def _load(moe: FusedMoE, part: str, kind: str, cfg: Int4CheckpointConfig, param: nn.Parameter,
          loaded: LoadedWeight, shard: tuple[int, str]) -> None:
    """One expert's checkpoint tensor: this rank's columns (gate, up) or rows (down) of it, the whole tensor's
    checked first (a larger one would load cut short)."""
    expert = shard[0] - moe.expert_start
    start = moe.intermediate_start
    length, pack, group = moe.intermediate, cfg.pack_factor, cfg.group_size
    if cfg.method == "ct":
        src = _ct_part(loaded, part, kind, start, length, pack, group, moe.whole_intermediate)
    elif part == "down" and kind in ("qzeros", "scales") and _all_groups(moe, part, cfg):
        src = loaded  # act-order: every group's
    elif part == "down":  # split by input rows: qweight (GPTQ's by packs), zero points and scales by groups, g_idx
        rows = {"qweight": pack if cfg.method == "gptq" else 1, "g_idx": 1}.get(kind, group if group > 0 else length)
        check_whole_size(loaded, 0, -(-moe.whole_intermediate // rows))
        src = weight_narrow(loaded, 0, start // rows, -(-length // rows))
    elif kind == "g_idx":
        src = loaded
    else:  # split by output columns: packed ones for AWQ's qweight and every qzeros
        columns = pack if kind == "qzeros" or (kind == "qweight" and cfg.method == "awq") else 1
        check_whole_size(loaded, 1, -(-moe.whole_intermediate // columns))
        src = weight_narrow(loaded, 1, start // columns, length // columns)
    copy_weight(param.data[expert], src)


def _ct_part(loaded: LoadedWeight, part: str, kind: str, start: int, length: int, pack: int, group: int,
             whole: int) -> LoadedWeight:
    """This rank's part of a compressed-tensors expert tensor (``[out, ...]``: the gate and up split by output rows,
    the down by its input columns; ``whole``: every rank's intermediate size, the tensor's checked first)."""
    if kind == "weight_shape":
        return loaded
    if part != "down":  # rows: zero points packed along them
        unit = pack if kind == "weight_zero_point" else 1
        check_whole_size(loaded, 0, -(-whole // unit))
        return weight_narrow(loaded, 0, start // unit, length // unit)
    unit = pack if kind == "weight_packed" else group if group > 0 else length  # columns: packs, or groups
    check_whole_size(loaded, 1, -(-whole // unit))
    return weight_narrow(loaded, 1, start // unit, -(-length // unit))


def _act_order_groups(moe: FusedMoE, part: str, expert: int, g_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """An act-order matrix's ``g_idx`` as the rows of its staged scales (int64), or a `ConfigError` naming the
    expert's matrix for a group outside them."""
    groups = g_idx.long()
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= num_groups):
        raise ConfigError("model", f"expert {expert + moe.expert_start}'s {part}_proj",
                          f"a g_idx naming one of its {num_groups} groups, not {int(groups.min())}..{int(groups.max())}")
    return groups


@torch.no_grad()
def _dequantized(moe: FusedMoE, part: str, expert: int, cfg: Int4CheckpointConfig, hidden: int) -> torch.Tensor:
    """One local expert's matrix ``[out, in]`` in float32."""
    return _unpacked(moe, part, expert, cfg, hidden).dequantize().t()


@torch.no_grad()
def _unpacked(moe: FusedMoE, part: str, expert: int, cfg: Int4CheckpointConfig, hidden: int) -> UnpackedWeight:
    """One local expert's staged tensors, unpacked (``q [in, out]``)."""
    tensor = {kind: getattr(moe, f"{part}_{kind}").data[expert] for kind in _kinds(cfg)}
    if cfg.method == "ct":  # the stored values are the signed ones plus 2**(bits-1): so is a symmetric zero point
        q = unpack_columns(tensor["weight_packed"], cfg.bits).t().contiguous()
        scales = tensor["weight_scale"].float().t().contiguous()
        zeros = (torch.full(scales.shape, 1 << (cfg.bits - 1), dtype=torch.int32, device=q.device) if cfg.symmetric
                 else unpack_columns(tensor["weight_zero_point"].t().contiguous(), cfg.bits))
        return UnpackedWeight(q, zeros, scales, torch.arange(q.shape[0], device=q.device) // _group(moe, part, cfg,
                                                                                                   hidden))
    if cfg.method == "awq":
        q, zeros = _awq_unpack(tensor["qweight"]), _awq_unpack(tensor["qzeros"])
    else:
        q = reference.unpack_int_rows(tensor["qweight"], cfg.bits)
        zeros = (unpack_columns(tensor["qzeros"], cfg.bits) + cfg.zero_offset) & ((1 << cfg.bits) - 1)
    groups = torch.arange(q.shape[0], device=q.device) // _group(moe, part, cfg, hidden)
    if cfg.desc_act:  # act-order: each input row's group is its g_idx's
        groups = _act_order_groups(moe, part, expert, tensor["g_idx"], tensor["scales"].shape[0])
    elif cfg.method == "gptq":
        offset = moe.intermediate_start if part == "down" else 0
        if not torch.equal(tensor["g_idx"].long() - (offset // _group(moe, part, cfg, hidden) if cfg.group_size > 0
                                                     else 0), groups):
            raise ConfigError("model", f"expert {expert + moe.expert_start}'s {part}_proj",
                              "a g_idx of k // group_size, as its quantization_config's desc_act false says")
    return UnpackedWeight(q, zeros, tensor["scales"].float(), groups)


@torch.no_grad()
def finish_int4_experts(model: nn.Module, cfg: Int4CheckpointConfig, keep_packed: bool = False) -> None:
    """Every quantized `FusedMoE`'s experts, the staging dropped: packed in `reference.IntExperts`' layout
    (``keep_packed``: on a GPU, for the fused-MoE kernel's integer path), else dequantized into its float ``w13`` /
    ``w2`` weights. Act-order experts kept packed take their ``g_idx``, one for gate and up: an expert whose gate and
    up ``g_idx`` differ has them all dequantized, logged."""
    differing = _gate_up_g_idx_differ(model, cfg) if keep_packed and cfg.desc_act else None
    if differing is not None:
        logger.info("GPTQ act-order (desc_act) experts dequantized to the model dtype at load: %s's gate and up "
                    "g_idx differ (the fused-MoE kernel's integer path reads one per expert)", differing)
        keep_packed = False
    for _, moe in _quantized_experts(model, cfg):
        (w13_shape, w2_shape, dtype), hidden = moe.int4_shape, moe.int4_shape[0][2]
        experts = range(moe.num_local_experts)
        if keep_packed:
            def stacked(part: str) -> list[torch.Tensor]:  # (values, scales, zero points) over the local experts
                return [torch.stack(t) for t in zip(*(_packed_rows(moe, part, e, cfg, hidden) for e in experts))]

            w13 = [torch.cat(pair, dim=1) for pair in zip(*(stacked(part) for part in moe.parts[:-1]))]
            w2 = stacked("down")
            g_idx = (getattr(moe, f"{moe.parts[0]}_g_idx").data, moe.down_g_idx.data) if cfg.desc_act else None
        else:
            w13 = torch.stack([torch.cat([_dequantized(moe, part, e, cfg, hidden) for part in moe.parts[:-1]])
                               for e in experts])
            w2 = torch.stack([_dequantized(moe, "down", e, cfg, hidden) for e in experts])
        for part in moe.parts:
            for kind in _kinds(cfg):
                delattr(moe, f"{part}_{kind}")
        del moe.int4_shape
        if keep_packed:
            _attach_packed(moe, w13, w2, cfg, _group(moe, "gate", cfg, hidden), _group(moe, "down", cfg, hidden),
                           g_idx)
            continue
        assert tuple(w13.shape) == w13_shape and tuple(w2.shape) == w2_shape, (w13.shape, w2.shape)
        moe.w13_weight = nn.Parameter(w13.to(dtype), requires_grad=False)
        moe.w2_weight = nn.Parameter(w2.to(dtype), requires_grad=False)


def _gate_up_g_idx_differ(model: nn.Module, cfg: Int4CheckpointConfig) -> str | None:
    """The first `FusedMoE` (its name) with an expert whose staged gate and up ``g_idx`` differ, else None."""
    for name, moe in _quantized_experts(model, cfg):
        if moe.gated and not torch.equal(moe.gate_g_idx.data, moe.up_g_idx.data):
            return name
    return None


def _packed_rows(moe: FusedMoE, part: str, expert: int, cfg: Int4CheckpointConfig, hidden: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One local expert's matrix in `reference.IntExperts`' layout: (int32 ``[out, in / p]`` packed along the input,
    float32 scales and zero points ``[out, groups]``)."""
    w = _unpacked(moe, part, expert, cfg, hidden)
    q = w.q.t().contiguous()  # [out, in]
    pack = cfg.pack_factor
    words = torch.zeros(q.shape[0], q.shape[1] // pack, dtype=torch.int32, device=q.device)
    for i in range(pack):
        words |= q[:, i::pack] << (cfg.bits * i)
    return words, w.scales.t().contiguous(), w.zeros.float().t().contiguous()


def _attach_packed(moe: FusedMoE, w13: list[torch.Tensor], w2: list[torch.Tensor], cfg: Int4CheckpointConfig,
                   group13: int, group2: int, g_idx: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """The packed experts as the layer's ``w13`` / ``w2`` (int32) with their scales and zero points, and act-order
    ones' ``g_idx`` of w13 and w2 (int32 ``[E, K]``, `reference.IntExperts`' ``w13_g_idx`` / ``w2_g_idx``)."""
    if group13 != group2 and g_idx is None:  # with g_idx the kernel reads each row's group from it
        raise NotBuiltError("model", f"group_size {cfg.group_size}", "packed int experts whose gate/up and down "
                                                                      "inputs are grouped differently")
    moe.w13_weight = nn.Parameter(w13[0], requires_grad=False)
    moe.w2_weight = nn.Parameter(w2[0], requires_grad=False)
    for name, tensor in (("w13_scales", w13[1]), ("w13_zeros", w13[2]), ("w2_scales", w2[1]), ("w2_zeros", w2[2])):
        moe.register_buffer(name, tensor)
    if g_idx is not None:
        moe.register_buffer("w13_g_idx", g_idx[0].to(torch.int32).contiguous())
        moe.register_buffer("w2_g_idx", g_idx[1].to(torch.int32).contiguous())
    moe.int_experts = (cfg.bits, group13)


@torch.no_grad()
def draw_int4_experts(model: nn.Module, cfg: Int4CheckpointConfig, seed: int) -> None:
    """``load_format="dummy"``: random packed values and zero points, scales up to 0.005, trivial ``g_idx``."""
    gen = torch.Generator().manual_seed(seed)
    for _, moe in _quantized_experts(model, cfg):
        hidden = moe.int4_shape[0][2]
        for part in moe.parts:
            for kind in ("qweight", "qzeros"):
                param = getattr(moe, f"{part}_{kind}")
                param.copy_(torch.randint(-2**31, 2**31 - 1, param.shape, generator=gen, dtype=torch.int32))
            scales = getattr(moe, f"{part}_scales")
            scales.copy_(torch.rand(scales.shape, generator=gen) * 0.005)
            if cfg.method == "gptq":
                g_idx = getattr(moe, f"{part}_g_idx")
                offset = moe.intermediate_start if part == "down" else 0
                g_idx.copy_(((torch.arange(g_idx.shape[1]) + offset) // _group(moe, part, cfg, hidden)).expand_as(g_idx))
