"""LoRA adapters: the request type, and reading a PEFT adapter folder (torch-free).

A request names its adapter with a `LoRARequest` (vLLM's: name, integer id,
folder or hub id). The host checks the adapter once per id before the request
reaches the core (`AdapterChecker`, asyncllm/lora_checker.py): the folder, its
``adapter_config.json``, and every tensor's name and shape against the served
model, so a bad adapter is the request's `InvalidRequestError`, never a
worker's failure. The workers read the same folder with `read_adapter` (the
modules, ranks and scalings) and load its tensors (asyncllm/models/lora.py).
docs/lora.md has the whole story.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Container, TypeVar

import msgspec

from asyncllm.config_checks import is_int
from asyncllm.errors import InvalidRequestError
from asyncllm.lora_experts import fused_expert_names, is_expert_parameter, is_expert_path
from asyncllm.lora_hybrid_shapes import KDA_TARGETS, MAMBA_TARGETS
from asyncllm.lora_names import canonical_name
from asyncllm.models.family_config import LATENT_TARGETS

__all__ = ["LoRARequest", "AdapterModule", "Adapter", "read_adapter", "LORA_TARGETS", "kept_lora_ids",
           "IdleIds"]

K = TypeVar("K")

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_FIELD = "lora_request"

LORA_TARGETS = tuple(dict.fromkeys((  # once each: Mamba's out_proj is also Gated DeltaNet's
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "c_fc", "c_proj", "output_gate",
    *LATENT_TARGETS, *KDA_TARGETS, *MAMBA_TARGETS)))
"""The projection names an adapter may change (every linear layer of a decoder layer): separate q/k/v and
gate/up (Llama, Qwen, Gemma) or the checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` (Phi-3); Qwen3.5's Gated
DeltaNet's projections (``linear_attn.*``); a GELU MLP's ``c_fc`` / ``c_proj`` (StarCoder2's, Phi-2's); latent
attention's (DeepSeek's); Kimi Delta Attention's (Kimi-Linear's); MiniMax's lightning layers' ``output_gate``; the
attention-free Mamba models' mixers' (``mixer.in_proj``, ...)."""
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                            ("model.text_model.", "model."), ("layers.", "model.layers."))
"""An image-text checkpoint's language model (transformers 5's names, then older ones; Idefics3's and SmolVLM's
``text_model``), and a bare decoder's layers (an adapter trained on ``AutoModel``: an embedding model's) -> the
decoder's names."""
_UNSERVED_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.",
                      "vision_model.",  # Llama 4's tower (its image-text checkpoints serve text)
                      "model.vision_model.", "model.connector.", "model.embed_vision.",  # Idefics3's, Gemma 4's
                      "model.vision_encoder.", "model.vision_projection.")  # LightOnOCR's
_TENSOR_NAME = re.compile(
    r"model\.layers\.(\d+)\.(self_attn|mlp|linear_attn|encoder_attn|mixer)\.([\w.]+)\.lora_([AB])\.weight")
"""A decoder layer's adapter matrix (``encoder_attn``: Whisper's cross-attention; ``mixer``: Mamba's): layer, block,
projection
(``q_proj``; ``experts.3.gate_proj``, ``experts``,
``shared_expert.up_proj`` in an MoE layer: asyncllm/lora_experts.py), A or B."""


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Which adapter a request runs with (vLLM's ``LoRARequest``).

    ``lora_int_id`` (>= 1) identifies the adapter inside the engine: the
    workers keep its weights under it and prefix caching keys blocks by it, so
    one id must always mean the same adapter. ``lora_path`` is a PEFT adapter
    folder or a hub id.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def validate(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(_FIELD, f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if not is_int(self.lora_int_id) \
                or not 1 <= self.lora_int_id < 2**63:  # the wire's int64
            raise InvalidRequestError(_FIELD, f"lora_int_id must be an int in [1, 2**63 - 1], got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(_FIELD, f"lora_path must be a non-empty str, got {self.lora_path!r}")


KEPT_LORA_IDS = 64
"""The fewest adapter ids no request runs with that the host and the engine core keep bound (`kept_lora_ids`)."""


def kept_lora_ids(max_cpu_loras: int) -> int:
    """How many adapter ids no request runs with the host's `AdapterChecker` and the core's `HostLoRAIds` (each
    host's) keep bound: the workers' CPU cache's size, at least `KEPT_LORA_IDS` (docs/lora.md, "One id, one
    adapter")."""
    return max(max_cpu_loras, KEPT_LORA_IDS)


class IdleIds:
    """When to forget which of a bound map's ids (least recently used first; the host's `AdapterChecker`, the core's
    `HostLoRAIds` for each host): none up to `kept`; past it, the oldest that no request runs with (`busy`: the ids
    in use, a walk over the requests, asked only then), down to an eighth of `kept` below it, so that `busy` runs
    once per that many new ids. An id in use is never forgotten, nor one of the newest eighth of `kept`: an
    `add_lora`'s id, checked before its `AddLoRA` is sent, is not forgotten (its `RemoveLoRA` ahead of the core's
    binding) unless that many other ids are used in between. A walk that cannot get down to `kept` (too many ids in
    use) is not tried again before an eighth of `kept` more ids are bound."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._newest = kept // 8
        """The newest ids never forgotten; also the ids forgotten below `kept`, and the growth past a futile walk."""
        self._walk_at = kept + 1
        """The size at which `to_forget` walks (`busy`) next."""

    def settled(self, size: int) -> bool:
        """Whether `to_forget` on ``size`` ids would forget nothing, walk nothing and change nothing."""
        return size < self._walk_at and (size > self.kept or self._walk_at == self.kept + 1)

    def to_forget(self, ids: Collection[K], busy: Callable[[], Container[K]]) -> list[K]:
        """The ids to forget now (the caller forgets them)."""
        if len(ids) <= self.kept:
            self._walk_at = self.kept + 1
            return []
        if len(ids) < self._walk_at:
            return []
        in_use = busy()
        idle = (i for i in itertools.islice(ids, len(ids) - self._newest) if i not in in_use)
        forgotten = list(itertools.islice(idle, len(ids) - self.kept + self._newest))
        left = len(ids) - len(forgotten)
        self._walk_at = self.kept + 1 if left <= self.kept else left + max(1, self._newest)
        return forgotten


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection: ``W x + scaling * B (A x)``."""

    name: str
    """The projection's checkpoint name, e.g. ``model.layers.0.self_attn.q_proj``."""
    rank: int
    scaling: float
    in_features: int
    out_features: int
    key: str = ""
    """Its tensors' name in the file, before ``.lora_A.weight`` (an image-text checkpoint's adapter names its
    language model's modules ``model.language_model.layers...``); empty: ``name`` or PEFT's prefix and ``name``."""
    num_experts: int = 0
    """Stacked experts' parameter (``mlp.experts.gate_up_proj``): A holds this many experts' `rank` rows each,
    B as many columns (asyncllm/lora_experts.py); 0 for one matrix."""


@dataclass(frozen=True)
class Adapter:
    """An adapter folder as read from its config and tensor headers (no tensor data)."""

    path: str
    modules: dict[str, AdapterModule]
    """By checkpoint name."""
    unserved: tuple[str, ...] = ()
    """Its tensors of a vision tower or projector, left out of ``modules`` (`_pairs`)."""

    @property
    def weights_path(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)

    @property
    def max_rank(self) -> int:
        return max(module.rank for module in self.modules.values())


def read_adapter(path: str) -> Adapter:
    """Read a PEFT LoRA folder: its config and its tensors' names and shapes; `InvalidRequestError` if unusable."""
    config = _read_config(path)
    shapes = _tensor_shapes(path)
    modules: dict[str, AdapterModule] = {}
    try:
        for name, (key, a_shape, b_shape) in _named_experts(_pairs(shapes, path), config, path).items():
            modules[name] = _module(path, config, name, key, a_shape, b_shape)
    except InvalidRequestError:
        raise
    except (TypeError, ValueError, AttributeError, re.error) as exc:  # a config value of the wrong type or form
        _fail(path, f"its {CONFIG_FILE} has a value asyncllm cannot read ({type(exc).__name__}: {exc})")
    if not modules:
        _fail(path, "it holds no LoRA weights (of the language model)")
    unserved = tuple(key for key in shapes if key.removeprefix(_PEFT_PREFIX).startswith(_UNSERVED_PREFIXES))
    return Adapter(path, modules, unserved)


def _module(path: str, config: dict[str, Any], name: str, key: str, a_shape: list[int],
            b_shape: list[int]) -> AdapterModule:
    """One projection's adapter: its rank (per expert for stacked experts) and scaling, ``rank_pattern`` and
    ``alpha_pattern`` matched against the module's name in the file, as PEFT matches them (GPT-2's ``c_attn``)."""
    rows = a_shape[0]
    if rows < 1:
        _fail(path, f"{name}: lora_A has rank 0")
    if b_shape[1] != rows:
        _fail(path, f"{name}: lora_A has rank {rows} but lora_B {b_shape[1]}")
    source = key.removeprefix(_PEFT_PREFIX)
    num_experts, rank = 0, rows
    if name.rsplit(".", 2)[-2] == "experts":  # stacked experts: r from the config, A's rows r per expert
        rank = int(_pattern_value(config.get("rank_pattern") or {}, (source, name), config.get("r", 8)))
        if rank < 1 or rows % rank:
            _fail(path, f"{name}: lora_A's {rows} rows are not the experts' rows of rank r={rank}")
        num_experts = rows // rank
    alpha = _pattern_value(config.get("alpha_pattern") or {}, (source, name), config.get("lora_alpha", 8))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"lora_alpha (or its alpha_pattern entry) must be a number, got {alpha!r}")
    scale_rank = math.sqrt(rank) if config.get("use_rslora") else rank
    return AdapterModule(name, rank, float(alpha) / scale_rank, a_shape[1], b_shape[0], key, num_experts)


_EXPONENT_BITS = {"F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F32": ("<u4", 0x7F800000),
                  "F64": ("<u8", 0x7FF0000000000000)}
"""safetensors' float dtypes: the little-endian word and its exponent bits (all set: NaN or infinity)."""


def check_finite(adapter: Adapter) -> None:
    """`InvalidRequestError` when a LoRA matrix holds NaN or infinity: every adapted projection adds all slots'
    products, masked by multiplying (NaN times 0 is NaN), so such an adapter would corrupt every request batched
    with it, and the slot's later steps. Read from the file's bytes with numpy (the host imports no torch)."""
    import numpy as np

    path = adapter.weights_path
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
    except (OSError, ValueError) as exc:
        _fail(adapter.path, f"its {WEIGHTS_FILE} could not be read ({type(exc).__name__}: {exc})")
    for key, info in header.items():
        bits = _EXPONENT_BITS.get(info.get("dtype")) if isinstance(info, dict) else None
        if ".lora_" in key and bits is not None:
            start, end = info["data_offsets"]
            if np.any((data[start:end].view(bits[0]) & bits[1]) == bits[1]):
                _fail(adapter.path, f"tensor {key} holds NaN or infinity")


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        _fail(path, f"it has no {CONFIG_FILE} (a PEFT LoRA adapter folder is expected)")
    except (OSError, ValueError) as exc:
        _fail(path, f"its {CONFIG_FILE} could not be read ({exc})")
    if not isinstance(config, dict):
        _fail(path, f"its {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        _fail(path, f"it is a {config.get('peft_type')} adapter; only LoRA adapters are served")
    unsupported = {
        "use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained layers)",
        "trainable_token_indices": "trainable tokens", "layer_replication": "layer replication",
        "lora_bias": "LoRA biases",
        "alora_invocation_tokens": "activated LoRA (aLoRA: the adapter from its invocation tokens on)",
        # PEFT's variants whose product is not B A x over the stored matrices
        "arrow_config": "Arrow routing (a per-token mix of other adapters, not its own B A x)",
        "use_bdlora": "block-diagonal LoRA (BD-LoRA: A or B stored as diagonal blocks)",
        "kasa_config": "KaSA (a singular-value vector between A and B, over a truncated base weight)",
        "use_qalora": "QA-LoRA (A over pooled groups of the input)",
    }
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) and is_expert_parameter(t) for t in targets):
        _fail(path, f"it adapts parameters {targets!r} (target_parameters): only a mixture of experts' "
                    "experts.gate_up_proj and experts.down_proj are served")
    for key, what in unsupported.items():
        if config.get(key):
            _fail(path, f"it uses {what} ({key}), which asyncllm does not serve")
    if config.get("bias", "none") != "none":
        _fail(path, f"it trains biases (bias={config.get('bias')!r}), which asyncllm does not serve")
    return config  # fan_in_fan_out (GPT-2's Conv1D layers): its A and B are stored as any layer's


def _tensor_shapes(path: str) -> dict[str, list[int]]:
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        other = " (adapter_model.bin: re-save it with safetensors)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        _fail(path, f"it has no {WEIGHTS_FILE}{other}")
    from safetensors import safe_open

    try:
        with safe_open(weights, framework="numpy") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001 - a corrupt file of any kind is the request's error
        _fail(path, f"its {WEIGHTS_FILE} could not be read ({type(exc).__name__}: {exc})")


def _pairs(shapes: dict[str, list[int]], path: str) -> dict[str, tuple[str, list[int], list[int]]]:
    """Projection name -> (its tensors' name in the file, lora_A shape, lora_B shape); `InvalidRequestError` for
    any other tensor. A vision tower's and projector's matrices are left out: an image-text checkpoint served as
    text (Gemma 3) never runs them (one that runs them refuses them: `AdapterChecker`'s ``runs_tower``)."""
    found: dict[str, dict[str, list[int]]] = {}
    keys: dict[str, str] = {}
    for key, shape in shapes.items():
        name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        name = name.removeprefix("thinker.")  # Qwen2.5-Omni's full model: its thinker is what is served
        if name.startswith(_UNSERVED_PREFIXES):
            continue
        if name.startswith(("model.visual.", "visual.", "model.audio_tower.", "audio_tower.", "model.encoder.",
                            "model.embed_tokens_extend.")):
            # run on every input (Whisper's encoder: its audio tower; Phi-4-multimodal's image_embed / audio_embed)
            tower = "vision" if "visual" in name or ".image_embed." in name else "audio"
            _fail(path, f"tensor {key}: adapters on the {tower} tower are not built "
                        "(the decoder's projections only)")
        for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
        if ".cross_attn." in name:  # Llama 3.2 Vision's keys and values over a request's images, computed once
            _fail(path, f"tensor {key}: adapters on the cross-attention layers are not built (the decoder's "
                        "self_attn and mlp projections only)")
        match = _TENSOR_NAME.fullmatch(canonical_name(name))
        projection = match.group(3) if match else ""
        if match is None or len(shape) != 2 or projection not in LORA_TARGETS and not (
                match.group(2) == "mlp" and is_expert_path(projection)):
            _fail(path, f"tensor {key} {shape}: only LoRA A and B matrices of the decoder layers' projections "
                        f"({', '.join(LORA_TARGETS)}) and of a mixture of experts' experts and shared expert "
                        "are served (not embeddings, lm_head or routers)")
        name = match.group(0)
        module = name[: name.index(".lora_")]
        found.setdefault(module, {})[match.group(4)] = shape
        keys[module] = key[: key.index(".lora_")]
    for module, parts in found.items():
        if set(parts) != {"A", "B"}:
            _fail(path, f"{module} has lora_{'A' if 'A' in parts else 'B'} without its partner")
    return {module: (keys[module], parts["A"], parts["B"]) for module, parts in found.items()}


def _named_experts(pairs: dict[str, tuple[str, list[int], list[int]]], config: dict[str, Any],
                   path: str) -> dict[str, tuple[str, list[int], list[int]]]:
    """`_pairs` with each layer's stacked-experts modules (``mlp.experts``, ``mlp.experts.base_layer``) renamed by
    the parameter they adapt: ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``."""
    by_layer: dict[str, dict[str, tuple[list[int], list[int]]]] = {}
    for module, (_, a_shape, b_shape) in pairs.items():
        head, found, tail = module.partition(".mlp.experts")
        if found and (not tail or tail.startswith(".base_layer")):
            by_layer.setdefault(head, {})[module] = (a_shape, b_shape)
    renamed = {}
    for head, layer_pairs in by_layer.items():
        names = fused_expert_names(layer_pairs, config.get("target_parameters") or [], lambda m: _fail(path, m))
        renamed.update({module: f"{head}.mlp.experts.{param}" for module, param in names.items()})
    return {renamed.get(module, module): value for module, value in pairs.items()}


def _pattern_value(patterns: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """PEFT's per-module override: the first pattern matching the end of the module's name in the file, else of
    asyncllm's name for it (stacked experts': ``mlp.experts.gate_up_proj``, the parameter PEFT adapts)."""
    for name in names:
        for pattern, value in patterns.items():
            if re.match(rf"(.*\.)?({pattern})$", name):
                return value
    return default


def _fail(path: str, message: str) -> Any:
    raise InvalidRequestError(_FIELD, f"the adapter at {path}: {message}")
