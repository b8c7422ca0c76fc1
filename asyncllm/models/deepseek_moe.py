"""DeepSeek's mixture of experts (`DeepseekMoE`): its router (`DeepseekRouter`: V2's softmax, greedy or by group;
V3's and GLM-4.5's grouped sigmoid with the score correction; Mistral 4's), the fused routed experts and the shared
experts; `check_routing`, the routing settings built (asyncllm/models/deepseek.py's docstring has the math).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import new_param
from asyncllm.models.llama import DecoderBuild, LlamaMLP
from asyncllm.models.moe import FusedMoE, MoESpec, select_experts_by_scores

__all__ = ["DeepseekMoE", "DeepseekRouter", "check_routing"]


class DeepseekRouter(nn.Module):
    """The gate: float32 ``[E, H]`` logits (transformers keeps this matrix in float32) -> (weights, ids)."""

    def __init__(self, hf_config: Any, spec: MoESpec) -> None:
        super().__init__()
        mistral4 = hf_config.model_type == "mistral4"
        self.v3 = hf_config.model_type != "deepseek_v2" and not mistral4
        self.top_k, self.num_experts = spec.top_k, spec.num_experts
        self.groups, self.topk_group = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
        self.method = "mistral4" if mistral4 else "noaux_tc" if self.v3 else hf_config.topk_method
        self.renormalize = spec.renormalize
        self.scaling = float(hf_config.routed_scaling_factor)
        self.weight = new_param(spec.num_experts, hf_config.hidden_size, dtype=torch.float32)
        if self.v3:
            self.e_score_correction_bias = new_param(spec.num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        scores = logits.sigmoid() if self.v3 else logits.softmax(dim=-1)
        bias = self.e_score_correction_bias if self.v3 else None
        restrict = None if self.method == "greedy" else self._best_groups
        return select_experts_by_scores(scores, self.top_k, renormalize=self.renormalize, scaling=self.scaling,
                                        bias=bias, restrict=restrict)

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with every expert outside the ``topk_group`` best groups masked: V2's ``group_limited_greedy``
        ranks a group by its best score, V3 and Mistral 4 by their two best (V3 masks to -inf: its biased scores
        may be negative; the others to 0, as transformers)."""
        grouped = choice.view(-1, self.groups, self.num_experts // self.groups)
        if self.method == "group_limited_greedy":
            rank = grouped.max(dim=-1).values
        else:
            rank = grouped.topk(2, dim=-1)[0].sum(-1)
        best = rank.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), -math.inf if self.v3 else 0.0).view(-1, self.num_experts)


class DeepseekMoE(nn.Module):
    """Routed experts (fused) plus the shared experts every token runs."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        self.gate = DeepseekRouter(cfg, spec)
        self.experts = FusedMoE(spec, cfg.hidden_size, b)
        self.shared_experts = LlamaMLP(b, spec.shared_expert_size) if spec.shared_expert_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def check_routing(hf_config: Any) -> None:
    """`NotBuiltError` for routing settings other than the version's own (V2: softmax; V3 and GLM-4.5: sigmoid)."""
    v2 = hf_config.model_type == "deepseek_v2"
    method = getattr(hf_config, "topk_method", None) or ("greedy" if v2 else "noaux_tc")
    built = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    if method not in built:
        raise NotBuiltError("topk_method", method, f"DeepSeek-{'V2' if v2 else 'V3'} routing by {' or '.join(built)}")
    scoring = getattr(hf_config, "scoring_func", None) or ("softmax" if v2 else "sigmoid")
    if scoring != ("softmax" if v2 else "sigmoid"):
        raise NotBuiltError("scoring_func", scoring, "DeepSeek's own scoring function for its version")
    if v2 and getattr(hf_config, "norm_topk_prob", False):
        raise NotBuiltError("norm_topk_prob", True,
                            "DeepSeek-V2 routing weights renormalized (transformers ignores it)")
    if hf_config.hidden_act != "silu":
        raise NotBuiltError("hidden_act", hf_config.hidden_act, "DeepSeek with SiLU MLPs")
