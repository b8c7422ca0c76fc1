"""What the bidirectional encoders share (asyncllm/models/bert.py, modernbert.py): whole prompts per step, no
LM head, and loading checkpoint tensors by name through each family's own name mapping."""

from __future__ import annotations

import abc
from typing import Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import ConfigError
from asyncllm.models.layers import LoadedWeight, default_weight_loader, weight_narrow

__all__ = ["EncoderModel", "load_stacked_qkv", "prompt_spans", "rotate_neox"]


def prompt_spans(attn_metadata: AttentionMetadata) -> list[tuple[int, int]]:
    """Each prompt's rows in the step (the encoders compute whole prompts: query rows are the prompt)."""
    starts = attn_metadata.query_start_loc_cpu
    return list(zip(starts[:-1], starts[1:]))


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotary over ``[T, heads, head_dim]`` with ``cos``/``sin`` ``[T, 1, head_dim]`` (the rotary encoders'
    attention: asyncllm/models/modernbert.py, rotary_bert.py)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def load_stacked_qkv(param: nn.Parameter, weight: LoadedWeight, tp_size: int) -> None:
    """A checkpoint's q, k and v rows stacked in one tensor -> this rank's shard of each in the fused parameter."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    rows = param.shape[0] // 3 * tp_size  # each of q, k and v: `rows` long in the checkpoint
    for i, part in enumerate(("q", "k", "v")):
        loader(param, weight_narrow(weight, 0, i * rows, rows), part)


class EncoderModel(nn.Module, abc.ABC):
    """An encoder over whole prompts: the engine schedules them whole, keeps no KV cache for them
    (``is_encoder``, read by the host's preparation) and drops the token they sample."""

    has_lm_head = False
    is_encoder = True
    vocab_size: int

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Zeros: the token an embedding or classification request samples is dropped."""
        return hidden.new_zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)

    # ---- weights: a family maps checkpoint names (`_canonical`, `_target`, `_checkpoint_names`) and loads one
    def checkpoint_weight_names(self) -> set[str]:
        return {ckpt for name, _ in self.named_parameters() for ckpt in self._checkpoint_names(name)}

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """(checkpoint name, weight) pairs -> this rank's parameters; the (canonical) checkpoint names read."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for raw_name, weight in weights:
            name = self._canonical(raw_name)
            if name is None:
                continue  # a tensor the model does not read (a task head, a saved position table)
            param_name, shard_id = self._target(name)
            if param_name not in params:
                unexpected.append(raw_name)
                continue
            try:
                self._load(params[param_name], name, weight, shard_id)
            except (ValueError, RuntimeError) as exc:  # a shape (the copy), or a shard past the tensor (narrow)
                raise ConfigError("model", raw_name, f"a weight matching config.json, but it {exc}") from exc
            loaded.add(name)
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
            raise ConfigError("model", type(self).__name__, f"a checkpoint of this architecture; unexpected weights: "
                                                            f"{shown}")
        return loaded

    @abc.abstractmethod
    def _canonical(self, raw_name: str) -> str | None:
        """A checkpoint name as the family maps it; None: a tensor the model does not read."""

    _RENAMES: tuple[tuple[str, str], ...] = ()
    """(checkpoint name part, parameter name part) pairs, applied in order, for the families whose parameters differ
    from their checkpoints' names by such parts alone (the default `_target` and `_checkpoint_names`)."""

    def _target(self, name: str) -> tuple[str, object]:
        """Canonical checkpoint name -> (parameter name, shard id or None): `_RENAMES` by default."""
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        return name, None

    def _checkpoint_names(self, param_name: str) -> list[str]:
        """Parameter name -> the canonical checkpoint names it loads from: `_RENAMES` undone by default."""
        for old, new in reversed(self._RENAMES):
            param_name = param_name.replace(new, old)
        return [param_name]

    @abc.abstractmethod
    def _load(self, param: nn.Parameter, name: str, weight: LoadedWeight, shard_id: object) -> None:
        """Copy this rank's shard of one checkpoint tensor into `param`."""
