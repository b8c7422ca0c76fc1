"""PEFT LoRA adapters of the tiny test models, and PEFT's outputs as the reference."""

from __future__ import annotations

import functools
import os
from typing import Any

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, out_dir: str, seed: int, rank: int = 8, alpha: int = 16,
                 targets: list[str] | str | None = None, auto_class: Any = None, **lora_kwargs: Any) -> str:
    """Save a PEFT LoRA adapter of the model at `base_path` (loaded by ``auto_class``, default
    ``AutoModelForCausalLM``) with random A and B (PEFT starts B at zero, which would change nothing), large
    enough to change greedy outputs; ``targets``: module names, or PEFT's regex over the full names."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = (auto_class or AutoModelForCausalLM).from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=None)
def _peft_model(base_path: str, adapter_path: str, auto_class: Any = None):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = (auto_class or AutoModelForCausalLM).from_pretrained(base_path, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_path).eval()


def peft_greedy(base_path: str, adapter_path: str, prompt_ids: list[int], max_new_tokens: int,
                auto_class: Any = None, **generate_kwargs: Any) -> list[int]:
    """PEFT's greedy `generate` with the adapter (unmerged: base output plus the scaled B A product) on the model
    ``auto_class`` loads (default ``AutoModelForCausalLM``); `generate_kwargs` go to `generate`."""
    import torch

    model = _peft_model(base_path, os.path.abspath(adapter_path), auto_class)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **generate_kwargs)
    return out[0, len(prompt_ids):].tolist()


def peft_logits(base_path: str, adapter_path: str, token_ids: list[int]):
    """PEFT's float32 logits with the adapter at every position of one sequence: ``[len(token_ids), vocab]``."""
    import torch

    model = _peft_model(base_path, os.path.abspath(adapter_path))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long))
    return out.logits[0].float()
