"""Tiny random attention-free Mamba checkpoints (Mamba, Falcon Mamba, Mamba2) with the tiny Llama's tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["KINDS", "make_tiny_mamba"]

KINDS = ("mamba", "falcon_mamba", "mamba2")


def make_tiny_mamba(path: str | os.PathLike[str], kind: str, seed: int = 0) -> str:
    """Save a tiny random ``kind`` model (2 layers, hidden 64, states of 8; Mamba2: 8 heads of 16 in 2 groups) in
    ``path``: norm scales about 1, decays from ``A_log`` spread over [0.5, 4.5], steps around softplus(-1), the
    rest N(0, 0.15) (embeddings N(0, 1)), so every part matters."""
    import torch
    import transformers

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = tiny_checkpoint("llama")
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(source, name), path)
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if kind == "mamba2":
        config = transformers.Mamba2Config(num_heads=8, head_dim=16, n_groups=2, chunk_size=16, **common)
    else:
        config_cls = transformers.MambaConfig if kind == "mamba" else transformers.FalconMambaConfig
        config = config_cls(time_step_rank=8, **common)
    model_cls = {"mamba": transformers.MambaForCausalLM, "falcon_mamba": transformers.FalconMambaForCausalLM,
                 "mamba2": transformers.Mamba2ForCausalLM}[kind]
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                param.copy_(1 + 0.2 * noise)
            elif "A_log" in name:
                param.copy_(torch.log(torch.rand(param.shape, generator=gen) * 4 + 0.5))
            elif name.endswith(("dt_bias", "dt_proj.bias")):
                param.copy_(0.5 * noise - 1)
            elif "embeddings" in name:
                param.copy_(noise)
            else:
                param.copy_(0.15 * noise)
    model.save_pretrained(path)
    return str(path)
