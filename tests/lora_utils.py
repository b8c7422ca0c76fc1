"""PEFT LoRA adapters of the tiny test models, and PEFT's outputs as the reference."""

from __future__ import annotations

import functools
import os
from typing import Any

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""transformers 5's stacked experts' parameters, as PEFT's ``target_parameters`` names them."""


def make_adapter(base_path: str, out_dir: str, seed: int, rank: int = 8, alpha: int = 16,
                 targets: list[str] | str | None = None, auto_class: Any = None, **lora_kwargs: Any) -> str:
    """Save a PEFT LoRA adapter of the model at `base_path` (loaded by ``auto_class``, default
    its causal LM class) with random A and B (PEFT starts B at zero, which would change nothing), large
    enough to change greedy outputs; ``targets``: module names, or PEFT's regex over the full names (None: every
    projection)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = _base_model(base_path, auto_class)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=ALL_TARGETS if targets is None else targets, **lora_kwargs)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=None)
def _peft_model(base_path: str, adapter_path: str, auto_class: Any = None):
    from peft import PeftModel

    return PeftModel.from_pretrained(_base_model(base_path, auto_class), adapter_path).eval()


def _base_model(base_path: str, auto_class: Any):
    """transformers' model of the checkpoint: ``auto_class``'s, else its causal LM (hf_reference's choice)."""
    import torch
    from hf_reference import _causal_lm

    return _causal_lm(base_path) if auto_class is None else auto_class.from_pretrained(base_path, dtype=torch.float32)


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


def peft_logits(base_path: str, adapter_path: str, token_ids: list[int], auto_class: Any = None):
    """PEFT's float32 logits with the adapter at every position of one sequence: ``[len(token_ids), vocab]``
    (``auto_class``: the model class, default its causal LM)."""
    import torch

    model = _peft_model(base_path, os.path.abspath(adapter_path), auto_class)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long))
    return out.logits[0].float()


def merged_logits(base_path: str, adapter_path: str, token_ids: list[int], added: dict[str, Any] | None = None,
                  dtype: Any = None):
    """transformers' logits (in ``dtype``, default float32) at every position of one sequence, the adapter merged
    into the base model's weights (`merged_model`): ``[len(token_ids), vocab]``."""
    import torch

    model = merged_model(base_path, adapter_path, added, dtype)
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0]


def merged_greedy(base_path: str, adapter_path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens with the adapter merged into the weights (`merged_model`): the reference where
    PEFT's unmerged layers are bypassed (transformers' Mamba reads ``dt_proj.weight`` itself)."""
    import torch

    model = merged_model(base_path, adapter_path)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def merged_model(base_path: str, adapter_path: str, added: dict[str, Any] | None = None, dtype: Any = None):
    """transformers' model (in ``dtype``, default float32) with the adapter merged into its weights (PEFT's
    ``merge_and_unload``), then ``added`` (parameter name -> tensor) added to those parameters."""
    import torch
    from peft import PeftModel

    model = PeftModel.from_pretrained(_base_model(base_path, None), adapter_path).merge_and_unload().eval()
    model = model.to(dtype or torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, delta in (added or {}).items():
            params[name] += delta.to(params[name].dtype)
    return model


def make_expert_adapter(base: str, out_dir: str, seed: int, targets: list[str], rank: int = 4,
                        parameters: list[str] = EXPERTS) -> str:
    """A PEFT adapter of the experts' stacked parameters (``target_parameters``) and of `targets`, random."""
    return make_adapter(base, out_dir, seed, rank, 2 * rank, targets, target_parameters=parameters)


def per_expert_copy(adapter: str, out_dir: str, hidden: int, num_experts: int, block: str,
                    names: tuple[str, str, str]) -> str:
    """The same adapter with its stacked experts' A and B written per expert, ``{block}.experts.{e}.{name}`` with
    `names` (gate, up, down): gate and up share the stacked A, B's rows split between them."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    rank, out = config["r"], {}
    for key, a in tensors.items():
        if ".experts." not in key:
            out[key] = a
            continue
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        head = key[: key.index(".mlp.experts")] + f".{block}.experts"
        a_e, b_e = a.view(num_experts, rank, -1), b.view(b.shape[0], rank, num_experts)
        half = b.shape[0] // 2
        parts = [(names[0], slice(0, half)), (names[1], slice(half, None))] if a.shape[1] == hidden else \
            [(names[2], slice(None))]
        for e in range(num_experts):
            for name, rows in parts:
                out[f"{head}.{e}.{name}.lora_A.weight"] = a_e[e].clone()
                out[f"{head}.{e}.{name}.lora_B.weight"] = b_e[:, :, e][rows].contiguous()
    os.makedirs(out_dir)
    save_file(out, os.path.join(out_dir, "adapter_model.safetensors"))
    del config["target_parameters"]
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir
