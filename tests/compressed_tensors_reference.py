"""compressed-tensors checkpoints written by the compressed-tensors library itself, and transformers' model of them.

- `write_ct_checkpoint` loads a float checkpoint in transformers, attaches the config groups with
  ``apply_quantization_config``, sets each weight's scales (and zero points) with compressed-tensors'
  ``calculate_qparams`` over its min / max per tensor, row, group or block (llm-compressor's min-max observer) and
  each static input scale from the largest |input| the module sees on calibration sequences, then compresses with
  ``ModelCompressor`` (quantize, cast to fp8 or int8 or pack into int32) and writes the folder with
  ``save_pretrained`` and ``update_config``: the on-disk format is the library's, not asyncllm's.
- `ct_reference` is transformers' float32 model loaded from that folder (compressed-tensors installed): for fp8
  and int8 (W8A8) weights its default route (weights decompressed, each quantized module's input fake-quantized by
  compressed-tensors' forward, per token, per token and group, or with ``input_scale``), for weight-only integers
  ``CompressedTensorsConfig(dequantize=True)`` (weights dequantized at load; transformers' default route cannot
  load packed asymmetric zero points: a size mismatch).
"""

from __future__ import annotations

import functools
import shutil
import warnings
from pathlib import Path

import torch

from hf_reference import model_greedy, model_logits

CALIBRATION = [[5, 60, 7, 300, 9, 10, 41, 12], [400, 3, 77, 150, 22, 8], [100, 200, 300, 400, 500, 11]]
FP8_DYNAMIC = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                     "symmetric": True}}
"""llm-compressor's FP8_DYNAMIC preset (``RedHatAI/*-FP8-dynamic``)."""
FP8_STATIC = {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                    "symmetric": True}}
"""llm-compressor's FP8 preset (``RedHatAI/*-FP8``): per-tensor weights, calibrated per-tensor inputs."""

FP8_BLOCK = {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "symmetric": True,
                         "block_structure": [16, 16]},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 16,
                                   "dynamic": True, "symmetric": True}}
"""llm-compressor's FP8_BLOCK preset (``RedHatAI/*-FP8-block``: fp8 weights in blocks, activations dynamic per token
and group) with 16x16 blocks and groups of 16 in place of 128 (the tiny model's hidden size is 64; compressed-tensors'
group forward needs the input features to be a multiple of the group)."""
INT8_W8A8 = {"weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
             "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
                                   "symmetric": True}}
"""llm-compressor's W8A8 preset (``RedHatAI/*-quantized.w8a8``): int8 weights per row, int8 activations per token."""
INT8_STATIC = {"weights": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True},
               "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}}
"""int8 W8A8 with one weight scale per tensor and calibrated per-tensor activations."""
_LAYER = "re:.*layers\\.{}\\..*({})_proj$"
MIXED = {"fp8": {**FP8_DYNAMIC, "targets": [_LAYER.format(0, "q|k|v|gate|up")]},
         "int4": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16},
                  "targets": [_LAYER.format(0, "o|down")]},
         "int8": {**INT8_W8A8, "targets": [_LAYER.format(1, "q|k|v|gate|up")]},
         "fp8-block": {**FP8_BLOCK, "targets": [_LAYER.format(1, "o|down")]}}
"""Four config groups (format ``mixed-precision``): layer 0 FP8_DYNAMIC on the column-parallel projections and
W4A16 (groups of 16) on the row-parallel ones, layer 1 W8A8 int8 on the column-parallel ones and FP8_BLOCK on the
row-parallel ones. Under tensor parallelism no per-token activation scale is split over ranks (a row-parallel rank's
input columns are whole groups of FP8_BLOCK's)."""


def int_weights(bits: int, group_size: int | None, symmetric: bool = True) -> dict:
    """W4A16 / W8A16 weights: ``group_size`` None is one scale per output row (strategy channel)."""
    strategy = {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    return {"weights": {"num_bits": bits, "type": "int", "symmetric": symmetric, **strategy}}


def _min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "block":  # the tests' blocks divide the weights
        blocks = w.unflatten(0, (-1, args.block_structure[0])).unflatten(2, (-1, args.block_structure[1]))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    groups = w.unflatten(-1, (-1, args.group_size))
    return groups.amin(-1), groups.amax(-1)


def _input_ranges(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each linear's smallest and largest input value over the calibration sequences (the float model)."""
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name, _module, args):
        lo, hi = args[0].amin().reshape(1), args[0].amax().reshape(1)
        old = ranges.get(name, (lo, hi))
        ranges[name] = (torch.minimum(old[0], lo), torch.maximum(old[1], hi))

    handles = [m.register_forward_pre_hook(functools.partial(hook, n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for ids in CALIBRATION:
            model(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return ranges


@torch.no_grad()
def _calibrate(model, ranges) -> None:
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        scale, zero_point = calculate_qparams(*_min_max(module.weight.data, scheme.weights), scheme.weights)
        module.weight_scale.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.copy_(zero_point)
        if hasattr(module, "input_scale"):
            module.input_scale.copy_(calculate_qparams(*ranges[name], scheme.input_activations)[0])
        module.quantization_status = QuantizationStatus.FROZEN


def write_ct_checkpoint(src: str, dst: Path, groups: dict[str, dict], ignore: tuple[str, ...] = ("lm_head",),
                        auto_class=None) -> Path:
    """``src``'s float checkpoint (loaded by ``auto_class``, default ``AutoModelForCausalLM``) quantized and written
    by compressed-tensors into ``dst``; ``groups``: name -> scheme fields (``weights``, ``input_activations``) and
    ``targets`` (default ``["Linear"]``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = (auto_class or AutoModelForCausalLM).from_pretrained(src, dtype=torch.float32).eval()
    ranges = _input_ranges(model)
    config_groups = {name: {"targets": ["Linear"], **fields} for name, fields in groups.items()}
    apply_quantization_config(model, QuantizationConfig(config_groups=config_groups, ignore=list(ignore)),
                              show_progress=False)
    _calibrate(model, ranges)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(dst))
    compressor.update_config(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)
    return dst


class CtReference:
    """transformers' float32 model of a compressed-tensors checkpoint (see the module's docstring)."""

    def __init__(self, path: str | Path, dequantize: bool) -> None:
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
        with warnings.catch_warnings():  # "the quantization_config from the model will be used", with dequantize
            warnings.filterwarnings("ignore", message="You passed `quantization_config`", category=UserWarning)
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()
        self.logits([0])  # the default route decompresses the weights on the first forward pass

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return model_logits(self.model, token_ids)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return model_greedy(self.model, prompt, max_new_tokens)

    def weight(self, name: str) -> torch.Tensor:
        """The decompressed ``[out, in]`` weight of the module ``name``."""
        return self.model.get_submodule(name).weight.detach()


def write_ct_int_experts(src: str, dst: Path, bits: int, group: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """``src``'s mixture of experts with every expert's matrices in compressed-tensors' pack-quantized format, written
    here from the format (transformers 5 stacks the experts, so the library cannot quantize them as linears):
    ``weight_packed`` int32 ``[out, in / p]`` (value i of an int32 at bits ``i * bits``, stored plus
    ``2 ** (bits - 1)``), ``weight_scale`` ``[out, in / group]``, ``weight_zero_point`` int32 ``[out / p, groups]``
    (asymmetric: packed the same way along the output), ``weight_shape``; a config group targeting the experts, the
    rest float. Returns each expert matrix dequantized (``...weight`` -> ``[out, in]`` float32)."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(file))
    gen = torch.Generator().manual_seed(bits + group)
    half, pack = 1 << (bits - 1), 32 // bits
    dequantized = {}
    for name in sorted(n for n in tensors if re.search(r"\.experts\.\d+\.\w+\.weight$", n)):
        w, prefix = tensors.pop(name).float(), name.removesuffix(".weight")
        out, inp = w.shape
        grouped = w.view(out, inp // group, group)
        if symmetric:
            scale = grouped.abs().amax(-1) / (half - 1)
            zero = torch.zeros_like(scale, dtype=torch.int32)
        else:
            low, high = grouped.amin(-1), grouped.amax(-1)
            scale = (high - low) / ((1 << bits) - 1)
            zero = (-half - torch.round(low / scale)).to(torch.int32).clamp(-half, half - 1)
        scale = scale.clamp(min=1e-6) * (1 + 0.1 * torch.rand(scale.shape, generator=gen))  # not a round trip
        q = (torch.round(grouped / scale[..., None]) + zero[..., None]).clamp(-half, half - 1).to(torch.int32)
        stored = (q + half).view(out, inp)
        packed = torch.zeros(out, inp // pack, dtype=torch.int32)
        for i in range(pack):
            packed |= stored[:, i::pack] << (bits * i)
        tensors[f"{prefix}.weight_packed"] = packed
        tensors[f"{prefix}.weight_scale"] = scale.to(torch.float16)
        tensors[f"{prefix}.weight_shape"] = torch.tensor([out, inp], dtype=torch.int64)
        dequantized[name] = ((q - zero[..., None]).float() * scale.to(torch.float16).float()[..., None]).view(out, inp)
        if not symmetric:
            zeros = (zero + half).t()  # [groups, out] packed along the output
            packed_zeros = torch.zeros(zeros.shape[0], out // pack, dtype=torch.int32)
            for i in range(pack):
                packed_zeros |= zeros[:, i::pack] << (bits * i)
            tensors[f"{prefix}.weight_zero_point"] = packed_zeros.t().contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group}
    section = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
               "config_groups": {"experts": {"targets": ["re:.*experts.*"], "weights": weights}}}
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    return dequantized


def write_ct_fp8_experts(src: str, dst: Path, strategy: str, block: tuple[int, int] | None = None,
                         int8: bool = False) -> dict[str, torch.Tensor]:
    """``src``'s mixture of experts with every expert's matrices in compressed-tensors' fp8 format
    (``float-quantized``), written here from the format: float8_e4m3fn ``weight`` and a bfloat16 ``weight_scale``
    (the multiplier) per output row ``[out, 1]`` (``strategy`` channel: FP8_DYNAMIC), per matrix ``[1]`` (tensor) or
    per ``block`` cell (block: FP8_BLOCK, activations in groups of the block's columns), each ``max / 448`` times 1
    to 1.1 (not a round trip); a config group targeting the experts, the rest float. ``int8``: W8A8 int8 instead
    (``int-quantized``: int8 ``weight`` ``round(clamp(w / scale, -128, 127))``, each scale ``max / 127.5`` times 1 to
    1.1, int8 activations per token). Returns each expert matrix dequantized (``...weight`` -> ``[out, in]``
    float32)."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(file))
    gen = torch.Generator().manual_seed(8)
    dequantized = {}
    for name in sorted(n for n in tensors if re.search(r"\.experts\.\d+\.\w+\.weight$", n)):
        w = tensors[name].float()
        out, inp = w.shape
        bn, bk = {"channel": (1, inp), "tensor": (out, inp)}.get(strategy, block)
        cells = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # the tests' blocks divide the matrices
        top = 127.5 if int8 else 448
        scale = cells.abs().amax((1, 3)) / top * (1 + 0.1 * torch.rand(out // bn, inp // bk, generator=gen))
        stored = scale.to(torch.bfloat16)
        expanded = stored.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        q = (w / expanded).clamp(-128, 127).round().to(torch.int8) if int8 \
            else (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale"] = q, stored.reshape(-1) if strategy == "tensor" else stored
        dequantized[name] = q.float() * expanded
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    kind = "int" if int8 else "float"
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False}
    inputs = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True, "strategy": "token"}
    if strategy == "block":
        weights["block_structure"] = list(block)
        inputs.update(strategy="group", group_size=block[1])
    section = {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "ignore": ["lm_head"],
               "config_groups": {"experts": {"targets": ["re:.*experts.*"], "weights": weights,
                                             "input_activations": inputs}}}
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    return dequantized
