"""LoRA adapters on a mixture-of-experts model's experts: the names they come under, and the host's check (torch-free).

Two formats are read:

- PEFT's ``target_parameters`` (transformers 5 keeps a layer's experts as two stacked parameters,
  ``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows then up rows, and ``mlp.experts.down_proj [E, H, I]``):
  one A ``[E * r, in]`` (expert-major rows) and one B ``[out, r * E]`` (rank-major columns: expert e's k-th
  column is ``k * E + e``) per parameter. An adapter of both parameters nests one wrapper in the other, so its
  tensors are ``mlp.experts.base_layer.lora_A`` and ``mlp.experts.lora_A``; the shapes tell which is which.
- Per-expert projections (adapters trained where the experts were a module list, vLLM's format):
  ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1`` /
  ``w3`` / ``w2``. Llama 4's ``feed_forward.*`` are read as ``mlp.*``.

Both become `AdapterModule` s named ``model.layers.{L}.mlp.experts.gate_up_proj`` / ``.down_proj`` (``num_experts``
set) or ``model.layers.{L}.mlp.experts.{e}.gate_proj`` (...). A shared expert (Qwen2-MoE, Qwen3.5-MoE:
``mlp.shared_expert.*``) is a dense MLP and takes adapters as one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["FUSED_EXPERT_PARAMS", "ExpertLayer", "expert_problem", "fused_expert_names",
           "is_expert_parameter", "is_expert_path"]

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The experts' stacked parameters PEFT's ``target_parameters`` may name."""
_EXPERT_PATH = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)")
_SHARED_PATH = re.compile(r"shared_experts?\.(gate_proj|up_proj|down_proj)")
"""Qwen's ``shared_expert``, DeepSeek-style ``shared_experts`` (GLM-4.5, ERNIE 4.5, ...): a dense MLP."""
_FUSED_PATH = re.compile(r"experts(\.base_layer)*|experts\.(gate_up_proj|down_proj)")
"""PEFT's stacked-experts tensors as stored, and as `fused_expert_names` names them."""


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer's shapes, as the served model builds it."""

    num_experts: int
    intermediate: int
    shared_intermediate: int = 0
    """A shared expert's intermediate size; 0: none."""


def is_expert_path(path: str) -> bool:
    """Whether ``path`` (after ``mlp.``) names an expert's, the stacked experts' or the shared expert's matrix."""
    return any(p.fullmatch(path) for p in (_EXPERT_PATH, _SHARED_PATH, _FUSED_PATH))


def is_expert_parameter(target: str) -> bool:
    """Whether a ``target_parameters`` entry names the stacked experts' parameters: ``[...]experts.gate_up_proj``,
    ``[...]experts.down_proj``, or the bare parameter name."""
    head, _, parameter = target.rpartition(".")
    return parameter in FUSED_EXPERT_PARAMS and (not head or head == "experts" or head.endswith(".experts"))


def fused_expert_names(pairs: dict[str, tuple[list[int], list[int]]], targets: list[str],
                       fail: Callable[[str], Any]) -> dict[str, str]:
    """Each of one layer's stacked-experts modules (``...mlp.experts``, ``...mlp.experts.base_layer``: their A and
    B shapes) -> the parameter it adapts. Two: gate_up's input is down's output and its output twice down's input,
    or (A and B in each other's places, Llama 4) its input twice down's output and its output down's input (no
    shapes satisfy both); one: the parameter ``target_parameters`` names."""
    named = sorted({t.rsplit(".", 1)[-1] for t in targets} & set(FUSED_EXPERT_PARAMS))
    if len(pairs) == 1 and len(named) == 1:
        return {next(iter(pairs)): named[0]}
    if len(pairs) == 2:  # (A's in, B's out): gate_up (H, 2I), down (I, H); transposed (Llama 4) (2I, H), (H, I)
        (m1, (a1, b1)), (m2, (a2, b2)) = pairs.items()
        for (gate_up, a_g, b_g), (down, a_d, b_d) in (((m1, a1, b1), (m2, a2, b2)), ((m2, a2, b2), (m1, a1, b1))):
            if (a_g[1], b_g[0]) in ((b_d[0], 2 * a_d[1]), (2 * b_d[0], a_d[1])):
                return {gate_up: "gate_up_proj", down: "down_proj"}
    return fail(f"{', '.join(pairs)}: cannot tell which of the experts' parameters they adapt "
                f"(target_parameters: {targets})")


def expert_problem(path: str, module: Any, layer: ExpertLayer | None, hidden: int,
                   transposed: bool = False) -> str | None:
    """What is wrong with an adapter matrix at ``mlp.{path}`` of a layer (None: nothing); ``module`` its
    `AdapterModule`, ``layer`` the layer's experts (None: a dense layer); `transposed`: the model's stacked
    experts are ``[E, in, out]`` and PEFT stores their A and B each in the other's place (Llama 4)."""
    if layer is None:
        return "is a dense MLP layer: it has no experts"
    shared = _SHARED_PATH.fullmatch(path)
    if shared:
        size = layer.shared_intermediate
        if not size:
            return "has no shared expert"
        return _shape_problem(module, (size, hidden) if shared.group(1) == "down_proj" else (hidden, size))
    expert = _EXPERT_PATH.fullmatch(path)
    if expert:
        if int(expert.group(1)) >= layer.num_experts:
            return f"has {layer.num_experts} experts"
        down = expert.group(2) == "down_proj"
        return _shape_problem(module, (layer.intermediate, hidden) if down else (hidden, layer.intermediate))
    if module.num_experts != layer.num_experts:
        return f"has {layer.num_experts} experts, the adapter's A holds {module.num_experts} experts' rows"
    down = path.endswith("down_proj")
    expected = (layer.intermediate, hidden) if down else (hidden, 2 * layer.intermediate)
    return _shape_problem(module, expected[::-1] if transposed else expected)


def _shape_problem(module: Any, expected: tuple[int, int]) -> str | None:
    if (module.in_features, module.out_features) == expected:
        return None
    return (f"maps {expected[0]} -> {expected[1]} features, the adapter {module.in_features} -> "
            f"{module.out_features} (an adapter of another model?)")
