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
from asyncllm.models.moe import FusedMoE, MoESpec

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
        if self.v3:
            scores = logits.sigmoid()
            ids = self._top_k(scores + self.e_score_correction_bias, lambda g: g.topk(2, dim=-1)[0].sum(-1), -math.inf)
            weights = scores.gather(1, ids)
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                ids = self._top_k(scores, lambda g: g.max(dim=-1).values, 0.0)
            elif self.method == "mistral4":  # groups ranked by their two best scores, as V3 (no correction)
                ids = self._top_k(scores, lambda g: g.topk(2, dim=-1)[0].sum(-1), 0.0)
            else:
                ids = scores.topk(self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.method == "mistral4" and self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def _top_k(self, scores: torch.Tensor, group_score: Any, fill: float) -> torch.Tensor:
        """The top k experts among the ``topk_group`` groups that ``group_score`` ranks best."""
        grouped = scores.view(-1, self.groups, self.num_experts // self.groups)
        best = group_score(grouped).topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), fill).view(-1, self.num_experts)
        return masked.topk(self.top_k, dim=-1, sorted=False)[1]


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
