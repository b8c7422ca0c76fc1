"""From a model name to a loaded in-house model on one rank.

``resolve_model_path`` finds the checkpoint folder (a local folder, or a hub id
through huggingface_hub's cache), ``load_hf_config`` reads its config.json
(both in asyncllm/models/checkpoint.py, which needs no torch), ``resolve_dtype``
picks the activation dtype and ``load_model`` builds the model
on the device and fills it from the safetensors files (each rank reads only its
shard of each tensor), a GGUF file (asyncllm/models/gguf_loader.py) or with random dummy weights.
A pre-quantized checkpoint's model is built with its parameters on the meta device, and allocated
(`materialize_params`) once the quantized parameters replaced the float ones: the float model is never
on the device.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Callable, Iterator

import torch

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.checkpoint import Fp8CheckpointConfig, load_hf_config, prequantized_config, resolve_model_path
from asyncllm.models.compressed_tensors_config import CompressedTensorsCheckpointConfig
from asyncllm.models.gguf_config import GgufCheckpointConfig
from asyncllm.models.kv_scales import take_kv_scales
from asyncllm.models.layers import LoadedWeight, TensorParallel, params_on_meta
from asyncllm.models.mistral_format import mistral_files, mistral_weights, uses_mistral_weights
from asyncllm.models.pipeline import PipelineStage
from asyncllm.models.registry import CausalLM, check_tensor_parallel, get_model_class, text_config_of
from asyncllm.models.row_states import StateRows

__all__ = [
    "resolve_model_path",
    "load_hf_config",
    "resolve_dtype",
    "load_model",
    "build_model",
    "checkpoint_files",
    "iterate_safetensors",
    "load_checkpoint",
    "init_dummy_weights",
    "materialize_params",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_DUMMY_STD = 0.02


_FLOAT16_UNSTABLE = ("gemma2", "gemma3", "gemma3_text", "plamo2", "glm4")
"""vLLM's ``_FLOAT16_NOT_SUPPORTED_MODELS`` (numerical instability): ``auto`` never picks float16 for them, and
``float16`` asked for them is a `ConfigError`, as vLLM's ``ValueError``."""


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device, pooling: bool = False) -> torch.dtype:
    """The model dtype. ``auto``: float32 on CPU; on GPU as vLLM's: the checkpoint's half type (its config's dtype,
    else its text, vision or encoder config's), a float32 or unknown one served in bfloat16, or float16 for a
    ``pooling`` model (runner='pooling'); bfloat16 for the models float16 is unstable for (`_FLOAT16_UNSTABLE`:
    Gemma 2 / 3, GLM-4, PLaMo 2), a float16 checkpoint of theirs too."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ConfigError("dtype", dtype, f"one of 'auto', {', '.join(map(repr, _DTYPES))}")
        model_type = getattr(hf_config, "model_type", None)
        if dtype == "float16" and model_type in _FLOAT16_UNSTABLE:  # vLLM's _check_valid_dtype refuses it too
            raise ConfigError("dtype", dtype, f"'bfloat16' or 'float32': the model type {model_type!r} does not "
                                              "support float16 (numerical instability)")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt_dtype = _checkpoint_dtype(hf_config)
    unstable = getattr(hf_config, "model_type", None) in _FLOAT16_UNSTABLE
    if ckpt_dtype not in _HALF_DTYPES:  # float32 (vLLM: "downcast for float32 models"), or none given
        return torch.float16 if pooling and not unstable else torch.bfloat16
    return torch.bfloat16 if ckpt_dtype == torch.float16 and unstable else ckpt_dtype


def _checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype config.json gives (``dtype`` or ``torch_dtype``): the outer config's, else its text, vision or
    encoder config's (an image-text checkpoint may give it there only), as vLLM reads it; None without one."""
    for config in (hf_config, *(getattr(hf_config, name, None) for name in ("text_config", "vision_config",
                                                                             "encoder_config"))):
        if config is None:
            continue
        # transformers 5's torch_dtype is a deprecated alias of dtype (read only from a config without dtype)
        value = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        if isinstance(value, str):
            value = _DTYPES.get(value)
        if value is not None:
            return value
    return None


def _has_encoder_modes(model_cls: type) -> bool:
    """Whether the class takes ``mm_encoder_tp_mode`` (its encoder may be sharded or replicated)."""
    return bool(getattr(model_cls, "supports_encoder_data_parallel", False))


def load_model(
    config: EngineConfig,
    hf_config: Any,
    device: torch.device,
    dtype: torch.dtype,
    tp_rank: int = 0,
    tp_size: int = 1,
    pipeline: PipelineStage | None = None,
    model_cls: type | None = None,
) -> CausalLM:
    """Build ``hf_config``'s model on ``device`` for rank ``tp_rank`` and fill its weights.

    With ``tp_size > 1`` the torch.distributed default group (or ``pipeline``'s TP group) must already span
    the ``tp_size`` ranks. ``pipeline``: only that stage's parts (asyncllm/models/pipeline.py). ``model_cls``:
    this class rather than the one the config's architecture names (an EAGLE head: asyncllm/models/eagle.py).
    The model is returned in eval mode; call it under ``torch.inference_mode()``.
    """
    prequantized = prequantized_config(hf_config, config.model, config.quantization)
    fp8_checkpoint = prequantized if isinstance(prequantized, Fp8CheckpointConfig) else None
    check_tensor_parallel(hf_config, tp_size, config.enable_expert_parallel)
    _tensor_parallel(tp_rank, tp_size, pipeline).check_group()
    # a pre-quantized checkpoint read from files: its float parameters on the meta device until the quantized ones
    # replace them (`materialize_params`), so the float model is never allocated
    on_meta = prequantized is not None and not isinstance(prequantized, GgufCheckpointConfig) \
        and config.load_format != "dummy"
    with params_on_meta() if on_meta else contextlib.nullcontext():
        model = build_model(config, hf_config, device, dtype, tp_rank, tp_size, pipeline=pipeline,
                            model_cls=model_cls)
    if fp8_checkpoint is not None:  # a pre-quantized fp8 checkpoint: asyncllm/models/fp8_checkpoint.py
        _fill_fp8_weights(model, config, fp8_checkpoint, device)
    elif isinstance(prequantized, GgufCheckpointConfig) and config.load_format != "dummy":
        from asyncllm.models.gguf_loader import load_gguf_weights  # dequantized at load

        load_gguf_weights(model, prequantized.path, hf_config)
    elif isinstance(prequantized, GgufCheckpointConfig):
        init_dummy_weights(model, config.seed)
    elif isinstance(prequantized, CompressedTensorsCheckpointConfig):  # asyncllm/models/compressed_tensors.py
        from asyncllm.models.compressed_tensors import fill_compressed_tensors_weights

        fill_compressed_tensors_weights(model, config, prequantized, device)
    elif prequantized is not None:  # AWQ / GPTQ: asyncllm/models/int4_checkpoint.py
        from asyncllm.models.int4_checkpoint import fill_int4_weights

        fill_int4_weights(model, config, prequantized, device)
    elif config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_checkpoint(model, resolve_model_path(config.model, config.revision), config.kv_cache_dtype,
                        load_format=config.load_format)
    if config.quantization == "fp8" and prequantized is None:  # online: asyncllm/models/quantization.py
        from asyncllm.models.quantization import quantize_model

        quantize_model(model, config.quantization)
    model.eval()  # type: ignore[attr-defined]
    return model


def build_model(config: EngineConfig, hf_config: Any, device: torch.device, dtype: torch.dtype, tp_rank: int = 0,
                tp_size: int = 1, tensor_device: torch.device | None = None,
                pipeline: PipelineStage | None = None, model_cls: type | None = None) -> CausalLM:
    """``hf_config``'s model (or ``model_cls``) for rank ``tp_rank``, its parameters uninitialised on
    ``tensor_device`` (default ``device``; workers/weight_update.py builds one whose parameters are on the meta
    device), or on the meta device inside `layers.params_on_meta` (a pre-quantized load: those `new_param` makes)."""
    model_cls = model_cls or get_model_class(hf_config, config.multimodal_config.limit_mm_per_prompt)
    max_position = max(getattr(text_config_of(hf_config), "max_position_embeddings", 0) or 0,  # Mamba: none
                       config.max_model_len or 0, 1)
    # a model whose encoder can be replicated is told how to spread it (docs/multimodal.md), an MoE model
    # how to spread its experts (docs/moe.md)
    options: dict[str, Any] = {"mm_encoder_tp_mode": config.mm_encoder_tp_mode} if _has_encoder_modes(model_cls) else {}
    if getattr(model_cls, "is_moe", False):
        options["expert_parallel"] = config.enable_expert_parallel
    if getattr(model_cls, "takes_max_model_len", False):  # LongRoPE's factors depend on it (docs/phi3.md)
        options["max_model_len"] = config.max_model_len
    if getattr(model_cls, "takes_state_rows", False):  # recurrent states' rows and checkpoints (docs/hybrid-models.md)
        spec = config.scheduler_config.speculative
        options["state_rows"] = StateRows(config.max_num_seqs,
                                          config.mamba_checkpoint_slots if config.enable_prefix_caching else 0,
                                          spec.num_speculative_tokens if spec is not None else 0)
    if pipeline is not None:  # a pipeline stage: only its parts (asyncllm/models/pipeline.py)
        options["pipeline"] = pipeline
    with torch.device(tensor_device or device):
        model = model_cls(
            hf_config,
            dtype=dtype,
            tp=_tensor_parallel(tp_rank, tp_size, pipeline),
            attn_backend=get_attention_backend(config.attention_backend, device, dtype),
            max_position=max_position,
            **options,
        )
    if pipeline is not None and not pipeline.is_first and callable(getattr(model, "drop_encoder", None)):
        model.drop_encoder()  # an image-text model's encoder runs on the first stage only
    return model


def _tensor_parallel(tp_rank: int, tp_size: int, pipeline: PipelineStage | None) -> TensorParallel:
    """This rank's TP group: torch.distributed's default group, or its pipeline stage's."""
    return TensorParallel(tp_rank, tp_size, None if pipeline is None else pipeline.tp_group)


def _fill_fp8_weights(model: CausalLM, config: EngineConfig, fp8_checkpoint: Fp8CheckpointConfig,
                      device: torch.device) -> None:
    """The fp8 weights and scales read into fp8 parameters, or drawn and quantized into the same format."""
    from asyncllm.models import fp8_checkpoint as fp8
    from asyncllm.models import fp8_experts

    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
        fp8.quantize_drawn_weights(model, fp8_checkpoint)  # type: ignore[arg-type]
        fp8_experts.quantize_drawn_experts(model, fp8_checkpoint)  # type: ignore[arg-type]
        return
    fp8.make_fp8_params(model, fp8_checkpoint)  # type: ignore[arg-type]
    fp8_experts.make_fp8_expert_params(model, fp8_checkpoint)  # type: ignore[arg-type]
    materialize_params(model, device)
    load_checkpoint(model, resolve_model_path(config.model, config.revision), config.kv_cache_dtype,
                    load_format=config.load_format)
    fp8.finish_fp8_params(model, fp8_checkpoint)  # type: ignore[arg-type]
    fp8_experts.finish_fp8_expert_params(model, fp8_checkpoint)  # type: ignore[arg-type]


def checkpoint_files(path: str, load_format: str = "auto") -> list[str]:
    """The weight files to read: the safetensors of the index when there is one, else every ``*.safetensors``
    (Mistral's duplicate ``consolidated*`` files left out, and a PEFT adapter saved beside the weights: Granite
    Speech's, served as a `LoRARequest` of the folder); PyTorch pickle files (asyncllm/models/pt_checkpoint.py)
    when there are none and ``load_format`` is ``auto``, or always with ``pt``."""
    if load_format == "pt":
        return _pt_files(path, load_format)
    from asyncllm.models.pt_checkpoint import indexed_files

    indexed = indexed_files(path, "model.safetensors.index.json")
    if indexed is not None:
        return indexed
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    files = [f for f in files if not os.path.basename(f).startswith("consolidated")] or files
    files = [f for f in files if os.path.basename(f) != "adapter_model.safetensors"]
    if not files and load_format == "auto":
        return _pt_files(path)
    if not files:
        raise ConfigError("load_format", load_format, f"a folder with *.safetensors weights, and {path} has none "
                                                      "(load_format='auto' or 'pt' reads .bin / .pt checkpoints)")
    return files


def _pt_files(path: str, load_format: str = "auto") -> list[str]:
    from asyncllm.models.pt_checkpoint import pt_checkpoint_files

    files = pt_checkpoint_files(path)
    if not files and load_format == "pt":
        raise ConfigError("load_format", load_format, f"a folder with pytorch_model*.bin or *.pt weights, and {path} "
                                                      "has none (load_format='auto' or 'safetensors' reads its "
                                                      "*.safetensors)")
    if not files:
        raise ConfigError("model", path, "a folder with *.safetensors, pytorch_model*.bin or *.pt weights; it has "
                                         "none (load_format='dummy' draws random weights)")
    return files


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, LoadedWeight]]:
    """(name, lazy slice) for every tensor; a slice reads only the part that is indexed. PyTorch pickle files
    (``.bin`` / ``.pt``) give whole tensors (memory-mapped where they can be). A file that cannot be read (truncated,
    corrupt): a `ConfigError` naming it."""
    from asyncllm.models.pt_checkpoint import iterate_pt

    for file in files:
        if not file.endswith(".safetensors"):
            yield from iterate_pt([file])
            continue
        with _open_safetensors(file) as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _open_safetensors(file: str) -> Any:
    """``safe_open`` of ``file``; a file it cannot read (truncated by an interrupted download, not safetensors) a
    `ConfigError` naming that file, not safetensors' bare ``SafetensorError`` ("incomplete metadata")."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ConfigError("model", file, f"a readable safetensors file ({type(exc).__name__}: {exc}; a truncated or "
                                         "corrupt download: download it again)") from exc


def load_checkpoint(model: CausalLM, path: str, kv_cache_dtype: str = "auto",
                    weights_filter: Callable[[Iterator[tuple[str, LoadedWeight]]], Iterator[tuple[str, LoadedWeight]]]
                    | None = None, load_format: str = "auto") -> None:
    """Fill every parameter from the safetensors in ``path``; `ConfigError` naming missing weights.

    Calibrated KV-cache scales (``k_scale`` / ``v_scale``) go to the attention layers with an fp8
    ``kv_cache_dtype`` and are dropped otherwise (asyncllm/models/kv_scales.py).
    """
    if uses_mistral_weights(path, load_format):  # Mistral's names and rotary layout (asyncllm/models/mistral_format.py)
        weights = mistral_weights(path, iterate_safetensors(mistral_files(path)))
    else:
        weights = iterate_safetensors(checkpoint_files(path, load_format))
    weights = take_kv_scales(weights, model, kv_cache_dtype)
    loaded = model.load_weights(weights if weights_filter is None else weights_filter(weights))
    missing = sorted(model.checkpoint_weight_names() - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError("model", path, f"a checkpoint with every weight of its architecture; missing: {shown}")


def materialize_params(model: CausalLM, device: torch.device) -> int:
    """Every parameter still on the meta device (`params_on_meta`: those no quantized one replaced) made a zeroed
    tensor on ``device`` (zeros: what an ``__init__``'s ``nn.init.zeros_`` meant for a weight never loaded); one
    per parameter however many modules hold it (tied embeddings stay tied), its attributes (``weight_loader``)
    kept. Returns how many; `RuntimeError` for a buffer left on the meta device (made from a meta parameter)."""
    made: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id -> (meta, real): the ids stay unique
    for module in model.modules():  # type: ignore[attr-defined]
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                real = torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device),
                                          requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                made[id(param)] = (param, real)
            module._parameters[name] = made[id(param)][1]
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]  # type: ignore[attr-defined]
    if meta:
        raise RuntimeError(f"buffers {meta} were made on the meta device from parameters built there; build them "
                           "from the parameters' shapes, not their tensors")
    return len(made)


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights of the real shapes, the same for the same seed: norm weights 1,
    everything else N(0, 0.02) so activations stay well within bfloat16's range; a module holding packed (integer)
    parameters draws them itself (``draw_dummy(generator)``: gpt-oss's MXFP4 experts)."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    for name, param in model.named_parameters():  # type: ignore[attr-defined]
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dtype.is_floating_point:
            param.normal_(0.0, _DUMMY_STD, generator=generator(param.device))
    undrawn = []
    for module_name, module in model.named_modules():  # type: ignore[attr-defined]
        draw = getattr(module, "draw_dummy", None)
        if draw is not None:
            draw(generator(next(module.parameters()).device))
            continue
        undrawn += [f"{module_name}.{name}" for name, param in module.named_parameters(recurse=False)
                    if not param.dtype.is_floating_point]
    if undrawn:
        raise RuntimeError(f"dummy weights: integer parameters {undrawn} have no module drawing them (draw_dummy)")
