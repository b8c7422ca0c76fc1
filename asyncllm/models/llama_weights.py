"""Loading a checkpoint into a Llama-style model (`LlamaWeights`, a mixin of `LlamaForCausalLM`): each
checkpoint matrix into its (fused) parameter's shard, another pipeline stage's parts skipped, unexpected names
refused together.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from asyncllm.errors import ConfigError
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.pipeline import PipelineStage, in_missing_part

__all__ = ["LlamaWeights"]


class LlamaWeights:
    """Mixin of `LlamaForCausalLM`: its checkpoint names and weight loading."""

    has_lm_head: bool
    tie_word_embeddings: bool
    pipeline: PipelineStage | None
    packed_modules: dict[str, list[tuple[str, object]]]
    """Fused parameter -> the checkpoint matrices stacked in it, with their shard ids."""

    def checkpoint_weight_names(self) -> set[str]:
        """The checkpoint names this model needs (fused parameters expanded to their parts)."""
        names = set()
        for name, _ in self.named_parameters():
            names.update(ckpt for ckpt, _ in self._unpacked(name))
        return names if self.has_lm_head else names - {"lm_head.weight", "lm_head.bias"}

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Load (checkpoint name, weight) pairs, each rank keeping its shard.

        Returns the checkpoint names consumed. Names the model does not have raise
        `ConfigError` listing them all (after the others are loaded); rotary
        ``inv_freq`` buffers and a tied ``lm_head.weight`` are skipped.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for ckpt_name, weight in weights:
            if "rotary_emb.inv_freq" in ckpt_name or (self.tie_word_embeddings and ckpt_name == "lm_head.weight"):
                continue
            param_name, shard_id = self._packed(ckpt_name)
            if param_name not in params:
                if not self.holds_weight(param_name):  # another pipeline stage's: skipped unread
                    continue
                unexpected.append(ckpt_name)
                continue
            self._load_one(params[param_name], ckpt_name, weight, shard_id)
            loaded.add(ckpt_name)
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
            allowed = f"a checkpoint of this architecture; unexpected weights: {shown}"
            raise ConfigError("model", type(self).__name__, allowed)
        return loaded

    def holds_weight(self, param_name: str) -> bool:
        """Whether this rank holds the parameter: False for a part another pipeline stage holds."""
        return self.pipeline is None or not in_missing_part(self, param_name)

    def _load_one(self, param: nn.Parameter, ckpt_name: str, weight: LoadedWeight, shard_id: object) -> None:
        try:
            if shard_id is None:
                param.weight_loader(param, weight)  # type: ignore[attr-defined]
            else:
                param.weight_loader(param, weight, shard_id)  # type: ignore[attr-defined]
        except ValueError as exc:
            raise ConfigError("model", ckpt_name, f"a weight matching config.json, but it {exc}") from exc

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """Checkpoint name -> (parameter name, shard id or None)."""
        for fused, parts in self.packed_modules.items():
            for part, shard_id in parts:
                if f".{part}." in ckpt_name:
                    return ckpt_name.replace(f".{part}.", f".{fused}."), shard_id
        return ckpt_name, None

    def _unpacked(self, param_name: str) -> list[tuple[str, object]]:
        """Parameter name -> the (checkpoint name, shard id) pairs loaded into it."""
        for fused, parts in self.packed_modules.items():
            if f".{fused}." in param_name:
                return [(param_name.replace(f".{fused}.", f".{part}."), shard) for part, shard in parts]
        return [(param_name, None)]
