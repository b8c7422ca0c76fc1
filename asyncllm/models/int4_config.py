"""A pre-quantized integer weight-only checkpoint's ``quantization_config`` (AWQ, GPTQ), read without torch.

`int4_checkpoint_config` turns config.json's section into an `Int4CheckpointConfig` (what
asyncllm/models/int4_checkpoint.py loads), or refuses it: `ConfigError` for a malformed section or a
``quantization`` that names another method, `NotBuiltError` naming the field of a variant that is not built
(AWQ ``version`` other than ``gemm``, ``bits`` other than 4 for AWQ and 4 or 8 for GPTQ, GPTQ ``dynamic``
per-module overrides, a quantized ``lm_head``, Marlin-serialized checkpoints, mixture-of-experts and
multimodal models). The formats are described in docs/quantization.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.config_checks import is_int
from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["INT4_METHODS", "QUANTIZATION_NAMES", "Int4CheckpointConfig", "int4_checkpoint_config"]

INT4_METHODS = ("awq", "gptq")
"""The ``quant_method`` values served by asyncllm/models/int4_checkpoint.py."""
QUANTIZATION_NAMES = {"awq": ("awq", "awq_marlin"), "gptq": ("gptq", "gptq_marlin")}
"""The `quantization` values that serve each method's checkpoints besides None: vLLM's ``*_marlin`` names read
the same checkpoint format (vLLM picks its Marlin kernels with them; asyncllm always runs its own)."""
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
"""GPTQ ``checkpoint_format`` -> the offset added to each stored zero point (v1 stores ``zero - 1``)."""


@dataclass(frozen=True)
class Int4CheckpointConfig:
    """An AWQ or GPTQ checkpoint's quantization (int4, or GPTQ's int8), weights only."""

    method: str
    """``"awq"`` (qweight ``[in, out/8]``, AWQ's interleaved nibbles) or ``"gptq"`` (qweight ``[in/8, out]``)."""
    bits: int
    group_size: int
    """Input features per scale and zero point; -1: one group for the whole input."""
    desc_act: bool = False
    """GPTQ's act-order: ``g_idx`` maps each input feature to its group in any order."""
    zero_offset: int = 0
    """Added to each stored zero point, modulo ``2**bits``: 1 for GPTQ's v1 format, else 0."""
    ignored_layers: tuple[str, ...] = ()
    """``modules_to_not_convert``: a layer whose checkpoint name contains one of these loads unquantized."""

    @property
    def pack_factor(self) -> int:
        """Values per int32."""
        return 32 // self.bits

    def is_ignored(self, checkpoint_name: str) -> bool:
        return any(entry in checkpoint_name for entry in self.ignored_layers)


def int4_checkpoint_config(section: dict[str, Any], hf_config: Any, model: str,
                           quantization: str | None) -> Int4CheckpointConfig:
    """``section`` (config.json's quantization_config, ``quant_method`` awq or gptq) read and checked."""
    method = str(section.get("quant_method")).lower()
    allowed = QUANTIZATION_NAMES[method]
    if quantization is not None and quantization not in allowed:
        raise ConfigError("quantization", quantization,
                          f"None or one of {', '.join(map(repr, allowed))}: the checkpoint is pre-quantized with "
                          f"{method!r} (its config.json's quantization_config)")
    ignored = tuple(section.get("modules_to_not_convert") or ())
    _refuse_architecture(hf_config, model, method, ignored)
    if method == "awq":
        return _awq_config(section, model, ignored)
    return _gptq_config(section, model, ignored)


def _field(section: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    return next((section[name] for name in names if section.get(name) is not None), default)


def _not_built(model: str, what: str) -> NotBuiltError:
    return NotBuiltError("model", model, what)


def _group_size(section: dict[str, Any], names: tuple[str, ...], model: str) -> int:
    value = _field(section, names, 128)
    if not is_int(value) or (value <= 0 and value != -1):
        raise ConfigError("model", model, f"a quantization_config whose {names[0]} is a positive int or -1, "
                                          f"not {value!r}")
    return value


def _awq_config(section: dict[str, Any], model: str, ignored: tuple[str, ...]) -> Int4CheckpointConfig:
    version = str(_field(section, ("version",), "gemm")).lower()
    if version != "gemm":
        raise _not_built(model, f"AWQ quantization_config.version {version!r} (only 'gemm')")
    backend = str(_field(section, ("backend",), "autoawq")).lower()
    if backend != "autoawq":
        raise _not_built(model, f"AWQ quantization_config.backend {backend!r} (only 'autoawq')")
    bits = _field(section, ("bits", "w_bit"), 4)
    if bits != 4:
        raise _not_built(model, f"AWQ quantization_config.bits {bits!r} (only 4)")
    if not _field(section, ("zero_point",), True):
        raise _not_built(model, "AWQ quantization_config.zero_point false (only zero-point AWQ)")
    return Int4CheckpointConfig("awq", 4, _group_size(section, ("group_size", "q_group_size"), model),
                                ignored_layers=ignored)


def _gptq_config(section: dict[str, Any], model: str, ignored: tuple[str, ...]) -> Int4CheckpointConfig:
    bits = _field(section, ("bits",), 4)
    if bits not in (4, 8) or isinstance(bits, bool):
        raise _not_built(model, f"GPTQ quantization_config.bits {bits!r} (only 4 and 8)")
    fmt = str(_field(section, ("checkpoint_format",), "gptq")).lower()
    if fmt not in _GPTQ_FORMATS:
        raise _not_built(model, f"GPTQ quantization_config.checkpoint_format {fmt!r} (only 'gptq' and "
                                "'gptq_v2')")
    if section.get("dynamic"):
        raise _not_built(model, "GPTQ quantization_config.dynamic (per-module overrides)")
    if section.get("lm_head"):
        raise _not_built(model, "GPTQ quantization_config.lm_head true (a quantized LM head)")
    desc_act = section.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise ConfigError("model", model, f"a quantization_config whose desc_act is a bool, not {desc_act!r}")
    return Int4CheckpointConfig("gptq", bits, _group_size(section, ("group_size",), model), desc_act,
                                _GPTQ_FORMATS[fmt], ignored)


def _refuse_architecture(hf_config: Any, model: str, method: str, ignored: tuple[str, ...]) -> None:
    from asyncllm.models.architectures import (architecture_of, base_architecture, has_experts,
                                               refuse_quantized_multimodal)
    from asyncllm.models.checkpoint import FUSED_EXPERT_ARCHITECTURES

    arch = architecture_of(hf_config)
    if has_experts(hf_config, arch) and base_architecture(arch) in FUSED_EXPERT_ARCHITECTURES:
        raise _not_built(model, f"a pre-quantized {method} {arch} checkpoint (its experts are stored fused; "
                                "per-expert AWQ / GPTQ experts are served)")
    refuse_quantized_multimodal(arch, model, method, lambda name: any(entry in name for entry in ignored))
