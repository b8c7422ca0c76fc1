"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE) and how their checkpoints load.

A router (a replicated ``[E, H]`` matrix) scores the experts of each token; the
top ``k`` run, weighted by their softmax probabilities (renormalised over the
k when the family does). The experts are stacked in two parameters, ``w13``
``[E, 2I, H]`` (gate rows then up rows) and ``w2`` ``[E, H, I]``, that the
backend's ``fused_moe`` op consumes in one call (a Triton kernel on the GPU,
`asyncllm.kernels.reference.fused_moe` on the CPU). Families that choose by sigmoid or softmax scores plus a
correction bias and weigh by the plain scores (DeepSeek, AFMoE, LongCat-Flash) share `select_experts_by_scores`.
Checkpoints name each expert's matrices (``experts.{e}.gate_proj.weight``); transformers 5's modules stack
them as ``w13`` / ``w2`` are (``experts.gate_up_proj`` / ``down_proj``), which load too, cut per expert.

Across tensor-parallel ranks the experts are split one of two ways:
- by default each rank keeps every expert's slice of the intermediate dim
  (``I / tp`` rows of gate and up, columns of down), as the dense MLP does;
- with ``enable_expert_parallel`` each rank keeps ``E / tp`` whole experts, and
  routes the others' ids to nothing.
Either way each rank computes a partial sum and an all-reduce completes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ConfigError
from asyncllm.kernels.reference import Fp8Experts, IntExperts
from asyncllm.kernels.reference import fused_moe as reference_fused_moe
from asyncllm.models.layers import LoadedWeight, copy_weight, new_param, weight_narrow, weight_shape
from asyncllm.models.llama import DecoderBuild, LlamaMLP, check_silu

__all__ = ["MoESpec", "num_experts_of", "FusedMoE", "ReplicatedLinear", "SparseMoeBlock", "MoECausalLM",
           "select_experts", "select_experts_by_spec", "select_experts_by_scores", "moe_parallel_problems"]


@dataclass(frozen=True)
class MoESpec:
    """One family's MoE layer, read from its HF config."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    """Rescale the k chosen probabilities to sum to 1 (Mixtral always; Qwen by ``norm_topk_prob``)."""
    weights_in_model_dtype: bool
    """Round the routing weights to the model's dtype before scaling (Qwen's order; Mixtral keeps float32)."""
    shared_expert_size: int = 0
    """A dense expert every token also runs, gated by a sigmoid (Qwen2-MoE); 0 for none."""
    activation: str = "silu"
    """The experts' activation: ``silu`` (SiLU of the gate times up), ``gelu_tanh`` (GELU of the gate times up,
    Gemma 4) or ``relu2`` (no gate: ``relu(up) ** 2``, Nemotron 3)."""


def num_experts_of(hf_config: Any) -> int:
    """The expert count: ``num_local_experts`` (Mixtral, and what transformers 5 writes for Qwen-MoE) or
    ``num_experts`` (Qwen-MoE checkpoints' config.json); the workers' plain config has no alias map."""
    value = getattr(hf_config, "num_local_experts", None)
    return int(getattr(hf_config, "num_experts", 0) if value is None else value)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (weights ``[T, k]`` float32, expert ids ``[T, k]``): the softmax's top k, in
    float32 as transformers computes it; no host sync, so it runs inside a CUDA graph."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_by_spec(spec: MoESpec, router_logits: torch.Tensor,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` as ``spec`` routes: renormalized when it says, the weights rounded through the model's
    ``dtype`` first when ``weights_in_model_dtype`` (Qwen's and Aria's order; Mixtral keeps float32)."""
    weights, ids = select_experts(router_logits, spec.top_k, spec.renormalize)
    return (weights.to(dtype).float() if spec.weights_in_model_dtype else weights), ids


Restrict = Callable[[torch.Tensor], torch.Tensor]
"""Masks the experts a token may not choose in its ``[T, E]`` choice scores (DeepSeek's groups)."""


def select_experts_by_scores(scores: torch.Tensor, top_k: int, *, renormalize: bool, scaling: float = 1.0,
                             bias: torch.Tensor | None = None, restrict: Restrict | None = None,
                             ordered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``[T, E]`` scores (a family's sigmoid or softmax) -> (weights ``[T, k]``, ids ``[T, k]``): the top k
    by score plus ``bias`` (a load-balancing correction that chooses but never weighs), among what ``restrict``
    leaves (DeepSeek's expert groups: it masks the biased scores), weighted by the plain scores, renormalized
    (``+ 1e-20``) when asked, times ``scaling``. ``ordered``: ids in score order (transformers' ``topk`` for AFMoE)
    rather than unspecified."""
    choice = scores if bias is None else scores + bias
    if restrict is not None:
        choice = restrict(choice)
    ids = choice.topk(top_k, dim=-1, sorted=ordered)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_parallel_problems(spec: MoESpec, tp_size: int, expert_parallel: bool) -> list[str]:
    """What of ``spec`` does not split over ``tp_size`` ranks (phrases for `check_tensor_parallel`)."""
    problems = []
    if expert_parallel and spec.num_experts % tp_size:
        problems.append(f"num_experts={spec.num_experts} (with enable_expert_parallel)")
    if not expert_parallel and spec.intermediate_size % tp_size:
        problems.append(f"experts' intermediate_size={spec.intermediate_size} (without enable_expert_parallel)")
    if spec.shared_expert_size % tp_size:
        problems.append(f"shared_expert_intermediate_size={spec.shared_expert_size}")
    return problems


class FusedMoE(nn.Module):
    """This rank's experts: ``forward(x, weights, ids)`` -> ``[T, H]``, summed over the ranks."""

    def __init__(self, spec: MoESpec, hidden_size: int, b: DecoderBuild) -> None:
        super().__init__()
        tp = b.tp
        self.tp = tp
        self.expert_parallel = b.expert_parallel and tp.size > 1
        self.num_local_experts = tp.split(spec.num_experts) if self.expert_parallel else spec.num_experts
        self.expert_start = tp.rank * self.num_local_experts if self.expert_parallel else 0
        self.intermediate = spec.intermediate_size if self.expert_parallel else tp.split(spec.intermediate_size)
        self.num_experts = spec.num_experts
        self.hidden_size = hidden_size
        self.params_dtype = b.dtype
        """The model's dtype (the weights may be fp8 or packed integers)."""
        self.lora: Any = None
        """The experts' adapter slots (asyncllm/models/lora_experts.py: models whose experts take adapters)."""
        self.interleaved_gate_up = False
        """Whether an adapter's stacked gate_up B interleaves gate and up rows (gpt-oss's layout)."""
        self.gated = spec.activation != "relu2"
        """Whether ``w13`` holds gate rows before the up rows (without a gate: the up rows alone)."""
        self.activation = {} if spec.activation == "silu" else {"activation": spec.activation}
        self.make_weights(b)
        self.fused_moe = b.attn_backend.ops.fused_moe
        self.int_experts: tuple[int, int] | None = None
        """(bits, group) of AWQ / GPTQ experts kept packed (asyncllm/models/int4_experts.py: on a GPU): ``w13`` /
        ``w2`` int32 with ``w13_scales``, ``w13_zeros``, ``w2_scales``, ``w2_zeros`` (`reference.IntExperts`), GPTQ
        act-order ones with ``w13_g_idx`` / ``w2_g_idx`` too."""
        self.fp8_block: tuple[int, int] | None = None
        """An fp8 checkpoint's block (per tensor: ``(intermediate, K)``, per row ``(1, K)``, ``K`` covering both
        products' inputs: `fp8_experts.whole_row_group`): the weights are float8_e4m3fn (or int8: compressed-tensors'
        W8A8 int8 experts) with ``*_weight_scale_inv`` block scales (asyncllm/models/fp8_experts.py)."""
        self.w13_input_scale: torch.Tensor | None = None
        """Static fp8 activation scales (per-tensor fp8 experts): the gate/up product's one input scale, and
        ``w2_input_scale`` the down's (float32 scalars; None: the inputs quantized per token)."""
        self.w2_input_scale: torch.Tensor | None = None

    def make_weights(self, b: DecoderBuild) -> None:
        """``w13_weight [E, 2I, H]`` (without a gate ``[E, I, H]``) and ``w2_weight [E, H, I]`` in the model dtype, for
        this rank's experts and intermediate rows (gpt-oss's MXFP4 experts store theirs packed)."""
        n, inter = self.num_local_experts, self.intermediate
        rows = 2 * inter if self.gated else inter
        self.w13_weight = new_param(n, rows, self.hidden_size, dtype=b.dtype, loader=self.weight_loader)
        self.w2_weight = new_param(n, self.hidden_size, inter, dtype=b.dtype, loader=self.weight_loader)

    @property
    def local_experts(self) -> range:
        """The ids of the experts this rank holds (every expert unless expert parallel)."""
        return range(self.expert_start, self.expert_start + self.num_local_experts)

    def is_local(self, expert: int) -> bool:
        """Whether this rank holds ``expert``."""
        return expert in self.local_experts

    @property
    def intermediate_start(self) -> int:
        """This rank's first row of an expert's whole gate and up (first column of its down): 0 under expert
        parallelism, which keeps the experts whole."""
        return 0 if self.expert_parallel else self.tp.rank * self.intermediate

    @property
    def whole_intermediate(self) -> int:
        """An expert's intermediate size before the tensor-parallel split (the checkpoint's, every rank's check)."""
        return self.intermediate if self.expert_parallel else self.intermediate * self.tp.size

    @property
    def parts(self) -> tuple[str, ...]:
        """An expert's matrices in ``w13``'s row order, then the down."""
        return ("gate", "up", "down") if self.gated else ("up", "down")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        fp8 = {} if self.fp8_block is None else {"fp8": Fp8Experts(self.w13_weight_scale_inv, self.w2_weight_scale_inv,
                                                                  self.fp8_block, self.w13_input_scale,
                                                                  self.w2_input_scale)}
        if self.int_experts is not None:
            fp8 = {"int_experts": IntExperts(self.w13_scales, self.w13_zeros, self.w2_scales, self.w2_zeros,
                                             *self.int_experts, getattr(self, "w13_g_idx", None),
                                             getattr(self, "w2_g_idx", None))}
        fused_moe, lora = self.kernel()
        return self.tp.all_reduce(fused_moe(x, self.w13_weight, self.w2_weight, weights, self.local_ids(ids),
                                            **self.activation, **fp8, **lora))

    def kernel(self) -> tuple[Any, dict[str, Any]]:
        """The step's ``fused_moe`` and its extra arguments: the backend's, or with an adapter of the experts in
        the step the reference's expert loop adding it (asyncllm/models/lora_experts.py)."""
        if self.lora is not None and self.lora.context.experts:
            return reference_fused_moe, {"lora": self.lora.delta}
        return self.fused_moe, {}

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids as indices into this rank's experts; -1 (nothing to add) for other ranks' experts."""
        if not self.expert_parallel:
            return ids
        ids = ids - self.expert_start
        return torch.where((ids >= 0) & (ids < self.num_local_experts), ids, -1)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: tuple[int, str]) -> None:
        """One expert's gate, up or down matrix (``shard_id = (expert, "gate" | "up" | "down")``)."""
        expert, part = shard_id
        self.load_part(param.data[expert - self.expert_start], loaded, part)

    def load_part(self, dst: torch.Tensor, loaded: LoadedWeight, part: str) -> None:
        """This rank's rows of a gate or up matrix into one expert's ``w13`` rows ``dst``, or its columns of a down
        matrix into its ``w2`` (online fp8 experts reload through it: asyncllm/models/fp8_online_experts.py)."""
        inter, start, whole = self.intermediate, self.intermediate_start, self.whole_intermediate
        expected = (self.hidden_size, whole) if part == "down" else (whole, self.hidden_size)  # every rank checks it
        if weight_shape(loaded) != expected:
            raise ValueError(f"has shape {weight_shape(loaded)}, an expert's {part} matrix is {expected}")
        if part == "down":
            copy_weight(dst, weight_narrow(loaded, 1, start, inter))
        else:
            offset = inter if part == "up" and self.gated else 0
            copy_weight(dst.narrow(0, offset, inter), weight_narrow(loaded, 0, start, inter))


class ReplicatedLinear(nn.Module):
    """A small matrix every rank keeps whole (the router, Qwen2-MoE's shared-expert gate)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """The MLP of an MoE layer: route, run the experts (and the shared expert), sum."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        check_silu(b.hf_config)
        hidden = b.hf_config.hidden_size
        self.spec = spec
        self.gate = ReplicatedLinear(spec.num_experts, hidden, b.dtype)
        self.experts = FusedMoE(spec, hidden, b)
        if spec.shared_expert_size:
            self.shared_expert = LlamaMLP(b, spec.shared_expert_size)
            self.shared_expert_gate = ReplicatedLinear(1, hidden, b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        weights, ids = select_experts_by_spec(spec, self.gate(x), x.dtype)
        out = self.experts(x, weights, ids)
        if spec.shared_expert_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


INT4_EXPERT_KINDS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
                     "weight_shape")
"""An integer expert matrix's tensors: AWQ / GPTQ's (g_idx: GPTQ's only), compressed-tensors' pack-quantized ones;
staged as ``experts.{gate,up,down}_{kind}`` (asyncllm/models/int4_experts.py)."""
STAGED_EXPERT_KINDS = (*INT4_EXPERT_KINDS, "input_scale")
"""The expert tensors staged per matrix as ``experts.{gate,up,down}_{kind}``: the integer ones, and a static fp8
activation scale (asyncllm/models/fp8_experts.py)."""
_EXPERT_NAME = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv|" + "|".join(STAGED_EXPERT_KINDS)
                          + ")$")
"""An expert's matrix, or (block-fp8 checkpoints) its block scales, or its integer tensors."""
_STACKED_PARTS = {"gate_up_proj": ("gate", "up"), "up_proj": ("up",), "down_proj": ("down",)}
"""transformers 5's stacked experts (its modules' ``state_dict()``: ``experts.gate_up_proj``...) -> their parts:
``gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows), ``up_proj`` ``[E, I, H]`` (experts
without a gate), ``down_proj`` ``[E, H, I]``."""
_STACKED_NAME = re.compile(r"^(.*)\.experts\.(" + "|".join(_STACKED_PARTS) + ")$")
_LAYER_MLP = re.compile(r"(\.layers\.\d+)\.mlp\.")


class MoECausalLM:
    """Mixin before a Llama-style causal LM whose MLPs are (some or all) `SparseMoeBlock`: builds them
    and maps the checkpoint's per-expert matrices onto the stacked ``w13`` / ``w2`` parameters."""

    is_moe = True
    moe_module = "mlp"
    """The MoE block's name in the checkpoint (Mixtral: ``block_sparse_moe``); the model calls it ``mlp``."""
    expert_parts = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    """The experts' checkpoint matrix names -> gate, up, down."""
    lora_experts = False
    """Whether LoRA adapters may change the experts (asyncllm/models/lora_experts.py; checked against PEFT per
    family: tests/unit/test_lora_experts.py)."""
    lora_experts_transposed = False
    """Whether PEFT stores the stacked experts' adapters with A and B each in the other's place (Llama 4)."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        """Layer ``layer_idx``'s MoE, or None for a dense MLP layer."""
        raise NotImplementedError

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b) if spec is None else SparseMoeBlock(spec, b)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """As the dense model's, stacked experts cut per expert, skipping the experts other ranks hold (expert
        parallel)."""
        return super().load_weights(  # type: ignore[misc]
            (name, weight) for name, weight in self._per_expert(weights) if self._on_this_rank(name))

    def _per_expert(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """``weights`` with each stacked experts tensor (`_STACKED_NAME`) as its experts' matrices under the
        checkpoint's per-expert names; an expert another rank holds is not read. The layout read is transformers
        5's (``[E, 2I, H]``, gate rows first): another one is refused by the per-expert shape check, except a
        transposed ``[E, H, 2I]`` when H == 2I (or a down ``[E, I, H]`` when H == I), which no shape tells apart."""
        names = {part: ckpt for ckpt, part in self.expert_parts.items()}
        for name, weight in weights:
            name = _LAYER_MLP.sub(rf"\1.{self.moe_module}.", name)  # transformers 5's name of every MoE block
            match = _STACKED_NAME.match(name)
            parts = _STACKED_PARTS[match.group(2)] if match is not None else ()
            if match is None or not names.keys() >= set(parts):
                yield name, weight
                continue
            shape = weight_shape(weight)
            if len(shape) != 3 or shape[1] % len(parts):
                raise ConfigError("model", name, f"stacked experts as transformers 5 holds them: [E, 2I, H] "
                                                 f"(gate_up_proj), [E, I, H] (up_proj) or [E, H, I] (down_proj); got "
                                                 f"shape {list(shape)}")
            for expert in range(shape[0]):
                expert_names = [f"{match.group(1)}.experts.{expert}.{names[part]}.weight" for part in parts]
                if self._on_this_rank(expert_names[0]):
                    matrix = weight_narrow(weight, 0, expert, 1)[0]  # a lazy slice reads this expert's only
                    yield from zip(expert_names, matrix.split(shape[1] // len(parts)))

    def _on_this_rank(self, ckpt_name: str) -> bool:
        param_name, shard_id = self._packed(ckpt_name)
        if not isinstance(shard_id, tuple):
            return True
        if not self.holds_weight(param_name):  # type: ignore[attr-defined] - another pipeline stage's layer
            return False
        try:
            experts = self.get_submodule(param_name.rsplit(".", 1)[0])  # type: ignore[attr-defined]
        except AttributeError:  # a dense layer's, a layer the model lacks: the loader lists it as unexpected
            return True
        if not isinstance(experts, FusedMoE):
            return True
        if not 0 <= shard_id[0] < experts.num_experts:  # on every rank, before expert parallel's filter
            n = experts.num_experts
            raise ConfigError("model", ckpt_name, f"a weight of one of config.json's {n} experts (ids 0..{n - 1})")
        return experts.is_local(shard_id[0])

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        name = ckpt_name.replace(f".{self.moe_module}.", ".mlp.")
        match = _EXPERT_NAME.match(name)
        if match is None or match.group(3) not in self.expert_parts:
            return super()._packed(name)  # type: ignore[misc]
        prefix, expert, part = match.group(1), int(match.group(2)), self.expert_parts[match.group(3)]
        if match.group(4) in STAGED_EXPERT_KINDS:
            return f"{prefix}.experts.{part}_{match.group(4)}", (expert, part)
        suffix = match.group(4).removeprefix("weight")
        return f"{prefix}.experts.{'w2' if part == 'down' else 'w13'}_weight{suffix}", (expert, part)

    def _unpacked(self, param_name: str) -> list[tuple[str, object]]:
        prefix, _, leaf = param_name.rpartition(".experts.")
        ckpt_prefix = prefix.removesuffix(".mlp") + f".{self.moe_module}" if prefix.endswith(".mlp") else prefix
        part, _, int4_kind = leaf.partition("_")
        if part in ("gate", "up", "down") and int4_kind in STAGED_EXPERT_KINDS:  # AWQ / GPTQ staging, input scales
            experts = self.get_submodule(f"{prefix}.experts")  # type: ignore[attr-defined]
            names = {p: ckpt for ckpt, p in self.expert_parts.items()}
            return [(f"{ckpt_prefix}.experts.{e}.{names[part]}.{int4_kind}", (e, part))
                    for e in experts.local_experts]
        kind, _, suffix = leaf.partition("_weight")
        if kind in ("w13", "w2") and suffix in ("", "_scale_inv"):
            experts: FusedMoE = self.get_submodule(f"{prefix}.experts")  # type: ignore[attr-defined]
            parts = experts.parts[-1:] if kind == "w2" else experts.parts[:-1]
            names = {part: ckpt for ckpt, part in self.expert_parts.items()}
            return [(f"{ckpt_prefix}.experts.{e}.{names[part]}.weight{suffix}", (e, part))
                    for e in experts.local_experts for part in parts]
        return [(name.replace(".mlp.", f".{self.moe_module}."), shard)
                for name, shard in super()._unpacked(param_name)]  # type: ignore[misc]
