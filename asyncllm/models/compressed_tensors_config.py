"""A pre-quantized compressed-tensors checkpoint's ``quantization_config``, read without torch.

compressed-tensors is llm-compressor's format (RedHatAI / neuralmagic ``*-FP8-dynamic``, ``*-FP8``,
``*-FP8-block``, ``*-quantized.w8a8``, ``*-quantized.w4a16`` and ``w8a16`` checkpoints): ``config_groups`` give
each a quantization scheme and the modules it ``targets`` (``"Linear"``, module names, ``re:`` regexes),
``ignore`` the modules left in float. `compressed_tensors_config` turns the section into a
`CompressedTensorsCheckpointConfig` (what asyncllm/models/compressed_tensors.py loads), or refuses it:
`ConfigError` for a malformed section or a ``quantization`` naming another method, `NotBuiltError` naming the
part that is not built (asymmetric int8 activations, fp4 activations, group fp8 scales, 2:4 sparsity, KV-cache
scales, transforms, a quantized LM head or embedding, experts stored fused, multimodal models; the experts'
schemes are checked at load, asyncllm/models/compressed_tensors_experts.py).
docs/quantization.md describes the formats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from asyncllm.config_checks import is_int
from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["COMPRESSED_TENSORS", "CompressedTensorsScheme", "CompressedTensorsCheckpointConfig",
           "compressed_tensors_config"]

COMPRESSED_TENSORS = "compressed-tensors"
"""The ``quant_method`` (and the `quantization` value, vLLM's name) of these checkpoints."""
_FORMATS = {"fp8": ("float-quantized", "naive-quantized"), "int8": ("int-quantized", "naive-quantized"),
            "int": ("pack-quantized",)}
"""The kind of scheme -> the storage formats built for it: fp8 and int8 (W8A8) weights stored as they are, weight-only
integers packed in int32."""
_CLASS_NAME = re.compile(r"[A-Z]\w*")
"""A target or ignore entry naming a module class (``Linear``) rather than a module (``lm_head``, ``model.x``)."""
_REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "an image-text checkpoint served as a text model (its module names are not "
                                      "the checkpoint's)",
    "Phi3ForCausalLM": "a checkpoint whose q/k/v and gate/up projections are stored fused (one scale or zero-point "
                       "tensor for several of asyncllm's shards)",
}


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """How one checkpoint module's weight is stored and its product computed."""

    kind: str
    """``"fp8"``: float8_e4m3fn weights and activations (W8A8 fp8); ``"int8"``: int8 weights and activations (W8A8
    int8); ``"int"``: packed integer weights, model-dtype activations (W4A16, W8A16)."""
    strategy: str
    """Weight scales: ``"tensor"`` (one per checkpoint tensor), ``"channel"`` (one per output row), ``"group"`` (one
    per output row and ``group_size`` input features) or ``"block"`` (fp8: one per ``block`` of the weight)."""
    bits: int = 8
    group_size: int = -1
    """Input features per scale (``"group"``); -1: the whole input (``"channel"``)."""
    symmetric: bool = True
    """int: False when the checkpoint stores ``weight_zero_point`` (packed along the output)."""
    static_input: bool = False
    """fp8 and int8: activations quantized with the checkpoint's per-tensor ``input_scale``; False: dynamic, per
    token (per token and group of ``block[1]`` features with block-wise weights)."""
    block: tuple[int, int] | None = None
    """``"block"``: the ``(rows, columns)`` of the weight each scale covers (``block_structure``)."""

    @property
    def pack_factor(self) -> int:
        """Integer values per int32."""
        return 32 // self.bits


@dataclass(frozen=True)
class CompressedTensorsCheckpointConfig:
    """The schemes of a compressed-tensors checkpoint and the modules each applies to."""

    groups: tuple[tuple[tuple[str, ...], CompressedTensorsScheme], ...]
    """``(targets, scheme)`` per config group, in config order."""
    ignore: tuple[str, ...] = ()

    def scheme_of(self, checkpoint_name: str) -> CompressedTensorsScheme | None:
        """The scheme of a linear module (None: left unquantized), by compressed-tensors' rule: not ignored, then
        the first matching target among exact names, then regexes (each sorted), then the class ``Linear``."""
        if any(_matches(checkpoint_name, entry) for entry in self.ignore):
            return None
        by_target: dict[str, CompressedTensorsScheme] = {}
        for targets, scheme in self.groups:
            by_target.update(dict.fromkeys(targets, scheme))  # a later group's scheme wins, as in compressed-tensors
        named = sorted((t for t in by_target if t != "Linear" and _matches(checkpoint_name, t)),
                       key=lambda t: (t.startswith("re:"), t))
        first = named[0] if named else ("Linear" if "Linear" in by_target else None)
        return None if first is None else by_target[first]

    def is_ignored(self, checkpoint_name: str) -> bool:
        return self.scheme_of(checkpoint_name) is None


def _matches(name: str, entry: str) -> bool:
    """compressed-tensors' ``match_name`` for a linear module: ``re:`` a regex matched at the start, else the exact
    name; a class name matches only when it is ``Linear``."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    if _CLASS_NAME.fullmatch(entry):
        return entry == "Linear"
    return entry == name


def _not_built(model: str, what: str) -> NotBuiltError:
    return NotBuiltError("model", model, f"{what} in a compressed-tensors checkpoint")


def compressed_tensors_config(section: dict[str, Any], hf_config: Any, model: str,
                              quantization: str | None) -> CompressedTensorsCheckpointConfig:
    """``section`` (config.json's quantization_config, ``quant_method`` compressed-tensors) read and checked."""
    if quantization not in (None, COMPRESSED_TENSORS):
        raise ConfigError("quantization", quantization, f"None or {COMPRESSED_TENSORS!r}: the checkpoint is "
                          f"pre-quantized with {COMPRESSED_TENSORS!r} (its config.json's quantization_config)")
    _refuse_architecture(hf_config, model)
    _refuse_extras(section, model)
    groups = section.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("model", model, "a compressed-tensors quantization_config with config_groups")
    ignore = section.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(entry, str) for entry in ignore):
        raise ConfigError("model", model, f"a compressed-tensors quantization_config whose ignore is a list of "
                                          f"names, not {ignore!r}")
    top_format = section.get("format")
    cfg = CompressedTensorsCheckpointConfig(
        tuple(_group(name, group, top_format, model) for name, group in groups.items()), tuple(ignore))
    if cfg.scheme_of("lm_head") is not None:
        raise _not_built(model, "a quantized lm_head (its 'ignore' does not name it)")
    from asyncllm.models.architectures import architecture_of, refuse_quantized_multimodal

    refuse_quantized_multimodal(architecture_of(hf_config), model, COMPRESSED_TENSORS, cfg.is_ignored)
    return cfg


def _refuse_architecture(hf_config: Any, model: str) -> None:
    from asyncllm.models.architectures import architecture_of, base_architecture, has_experts

    arch = architecture_of(hf_config)
    from asyncllm.models.checkpoint import FUSED_EXPERT_ARCHITECTURES

    if has_experts(hf_config, arch) and base_architecture(arch) in FUSED_EXPERT_ARCHITECTURES:
        raise _not_built(model, f"a mixture-of-experts model whose experts are stored fused ({arch}; experts "
                                "stored per expert in a pack-quantized integer scheme, or in fp8 or int8 with "
                                "dynamic activations, are served)")
    if base_architecture(arch) in _REFUSED_ARCHITECTURES:
        raise _not_built(model, f"{_REFUSED_ARCHITECTURES[base_architecture(arch)]}: {arch}")


def _refuse_extras(section: dict[str, Any], model: str) -> None:
    """What a checkpoint may carry besides weight schemes: none of it is built."""
    kv = section.get("kv_cache_scheme") or {}
    if kv and not (kv.get("num_bits") == 8 and kv.get("type") == "float" and kv.get("strategy", "tensor") == "tensor"
                   and not kv.get("dynamic", False) and kv.get("symmetric", True) is not False):
        raise _not_built(model, f"kv_cache_scheme {kv} (one static fp8 scale per layer for keys and for values is "
                                "read: docs/fp8-kv-cache.md)")
    sparsity = section.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")) != "dense":
        raise _not_built(model, f"sparsity_config (format {sparsity.get('format')!r}: 2:4 sparse weights)")
    if section.get("transform_config"):
        raise _not_built(model, "transform_config (rotations applied to the weights and activations)")
    if section.get("moe_sparsity_config"):
        raise _not_built(model, "moe_sparsity_config (pruned experts)")


def _group(name: str, group: Any, top_format: Any, model: str) -> tuple[tuple[str, ...], CompressedTensorsScheme]:
    if not isinstance(group, dict) or not isinstance(group.get("targets"), list):
        raise ConfigError("model", model, f"a compressed-tensors config group {name!r} with a list of targets")
    targets = tuple(str(target) for target in group["targets"])
    for target in targets:
        if _CLASS_NAME.fullmatch(target) and target != "Linear":
            raise _not_built(model, f"config group {name!r} targeting {target!r} (only linear layers: 'Linear', "
                                    "module names and 're:' regexes)")
    if group.get("output_activations"):
        raise _not_built(model, f"config group {name!r}'s output_activations (quantized outputs)")
    fmt = str(group.get("format") or top_format)
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict):
        raise _not_built(model, f"config group {name!r} without weights (activations quantized alone)")
    kind = _kind(weights, inputs)
    if fmt not in _FORMATS[kind]:
        inputs_named = " and int 8-bit input_activations" if kind == "int8" else ""
        raise _not_built(model, f"config group {name!r}'s format {fmt!r} with {weights.get('type')} "
                                f"{weights.get('num_bits')}-bit weights{inputs_named} (built: 'float-quantized' "
                                "and 'naive-quantized' fp8, 'int-quantized' int8 W8A8, 'pack-quantized' int4 / int8 "
                                "weight-only)")
    what = f"config group {name!r}"
    return targets, _SCHEMES[kind](weights, inputs, what, model)


def _kind(weights: dict[str, Any], inputs: Any) -> str:
    """fp8 weights; int8 weights with int8 activations (W8A8); other integer weights (weight-only, or refused by
    `_int_scheme`)."""
    if (weights.get("type"), weights.get("num_bits")) == ("float", 8):
        return "fp8"
    int8_inputs = isinstance(inputs, dict) and (inputs.get("type"), inputs.get("num_bits")) == ("int", 8)
    return "int8" if int8_inputs and (weights.get("type"), weights.get("num_bits")) == ("int", 8) else "int"


def _fp8_scheme(weights: dict[str, Any], inputs: Any, what: str, model: str) -> CompressedTensorsScheme:
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise _not_built(model, f"{what}'s fp8 weight strategy {strategy!r} (only 'tensor', 'channel' and 'block')")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise _not_built(model, f"{what}'s asymmetric or dynamic fp8 weights")
    if not isinstance(inputs, dict) or (inputs.get("type"), inputs.get("num_bits")) != ("float", 8):
        raise _not_built(model, f"{what}: fp8 weights without fp8 input_activations (weight-only fp8)")
    if not inputs.get("symmetric", True):
        raise _not_built(model, f"{what}'s asymmetric fp8 input_activations")
    if strategy == "block":
        return _fp8_block_scheme(weights, inputs, what, model)
    dynamic, input_strategy = inputs.get("dynamic"), inputs.get("strategy")
    if (input_strategy, dynamic) not in (("token", True), ("tensor", False)):
        raise _not_built(model, f"{what}'s fp8 input_activations strategy {input_strategy!r} with dynamic "
                                f"{dynamic!r} (only dynamic 'token' and static 'tensor')")
    return CompressedTensorsScheme("fp8", strategy, static_input=not dynamic)


def _fp8_block_scheme(weights: dict[str, Any], inputs: dict[str, Any], what: str,
                      model: str) -> CompressedTensorsScheme:
    """FP8_BLOCK: ``block_structure [rows, columns]``, activations dynamic per token in groups of ``columns`` (the
    block product needs its activation groups on the weight blocks' columns, as vLLM computes it)."""
    block = weights.get("block_structure")
    if (not isinstance(block, list) or len(block) != 2
            or not all(is_int(v) and v > 0 for v in block)):
        raise ConfigError("model", model, f"a compressed-tensors {what} whose block_structure is two positive ints, "
                                          f"not {block!r}")
    input_strategy, dynamic, group_size = inputs.get("strategy"), inputs.get("dynamic"), inputs.get("group_size")
    if (input_strategy, dynamic, group_size) != ("group", True, block[1]):
        raise _not_built(model, f"{what}'s fp8 block weights {block} with input_activations strategy "
                                f"{input_strategy!r}, dynamic {dynamic!r}, group_size {group_size!r} (only dynamic "
                                f"'group' of the block's {block[1]} columns, FP8_BLOCK)")
    return CompressedTensorsScheme("fp8", "block", block=(block[0], block[1]))


def _int8_scheme(weights: dict[str, Any], inputs: dict[str, Any], what: str, model: str) -> CompressedTensorsScheme:
    """W8A8 int8: symmetric weights per channel or tensor, symmetric activations per token (dynamic) or per tensor
    (static)."""
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise _not_built(model, f"{what}'s int8 W8A8 weight strategy {strategy!r} (only 'channel' and 'tensor')")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise _not_built(model, f"{what}'s asymmetric or dynamic int8 W8A8 weights")
    if not inputs.get("symmetric", True):
        raise _not_built(model, f"{what}'s asymmetric int8 input_activations (input_zero_point; only symmetric)")
    dynamic, input_strategy = inputs.get("dynamic"), inputs.get("strategy")
    if (input_strategy, dynamic) not in (("token", True), ("tensor", False)):
        raise _not_built(model, f"{what}'s int8 input_activations strategy {input_strategy!r} with dynamic "
                                f"{dynamic!r} (only dynamic 'token' and static 'tensor')")
    return CompressedTensorsScheme("int8", strategy, static_input=not dynamic)


def _int_scheme(weights: dict[str, Any], inputs: Any, what: str, model: str) -> CompressedTensorsScheme:
    if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
        raise _not_built(model, f"{what}'s {weights.get('type')} {weights.get('num_bits')}-bit weights (only fp8, "
                                "int4 and int8)")
    if inputs:
        raise _not_built(model, f"{what}'s {inputs.get('type')} {inputs.get('num_bits')}-bit input_activations "
                                f"with {weights.get('num_bits')}-bit integer weights (only weight-only int4 / int8, "
                                "W4A16 and W8A16, and int8 weights with int8 activations, W8A8)")
    if weights.get("actorder") not in (None, "weight", False):
        raise _not_built(model, f"{what}'s actorder {weights.get('actorder')!r} (weight_g_idx)")
    if weights.get("dynamic"):
        raise _not_built(model, f"{what}'s dynamic integer weights")
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if strategy == "group":
        if not is_int(group_size) or group_size <= 0:
            raise ConfigError("model", model, f"a compressed-tensors {what} whose group_size is a positive int, "
                                              f"not {group_size!r}")
    elif strategy == "channel":
        group_size = -1
    else:
        raise _not_built(model, f"{what}'s integer weight strategy {strategy!r} (only 'group' and 'channel')")
    return CompressedTensorsScheme("int", strategy, weights["num_bits"], group_size,
                                   bool(weights.get("symmetric", True)))


_SCHEMES = {"fp8": _fp8_scheme, "int8": _int8_scheme, "int": _int_scheme}
