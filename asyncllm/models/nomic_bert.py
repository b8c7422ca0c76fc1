"""NomicBERT encoders for embeddings: ``NomicBertModel`` (nomic-ai/nomic-embed-text-v1, v1.5).

A BERT-shaped encoder (asyncllm/models/bert.py: whole prompts in one step, bidirectional attention, no KV cache,
post-LN layers ``h = LN(h + attn(h)); h = LN(h + mlp(h))``) with rotary positions instead of a position table
(GPT-NeoX halves over the whole head, theta ``rotary_emb_base``), a SwiGLU MLP (``fc2(fc11(h) * silu(fc12(h)))``)
and no projection biases. The embedding is the word embedding plus token type 0's, then ``emb_ln``. The config's
remote-code names are read on the host (asyncllm/models/nomic_config.py); the weights keep the remote code's names
(``encoder.layers.N.attn.Wqkv``, ``mlp.fc11`` ...), as the hub's checkpoints and transformers' ``save_pretrained``
write them, bare or under ``bert.`` (a pre-training checkpoint, whose ``mlm.`` head is not read).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.encoder import EncoderModel, prompt_spans
from asyncllm.models.layers import LoadedWeight, TensorParallel, default_weight_loader, weight_narrow
from asyncllm.models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.models.modernbert import _rotate

__all__ = ["NomicBertEmbeddingModel"]


class _Layer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        hidden, heads, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.layer_norm_eps
        self.head_dim = hidden // heads
        self.qkv = QKVParallelLinear(hidden, self.head_dim, heads, heads, False, tp, dtype)
        self.attn_out = RowParallelLinear(hidden, hidden, False, tp, dtype)
        self.norm1 = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.up = MergedColumnParallelLinear(hidden, [cfg.intermediate_size] * 2, False, tp, dtype)  # gate, up
        self.down = RowParallelLinear(cfg.intermediate_size, hidden, False, tp, dtype)
        self.norm2 = nn.LayerNorm(hidden, eps, dtype=dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: list[tuple[int, int]]) -> torch.Tensor:
        q, k, v = self.qkv.split_qkv(self.qkv(hidden))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = torch.empty_like(q)
        for start, end in spans:
            attn[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            ).transpose(0, 1)
        hidden = self.norm1(hidden + self.attn_out(attn.reshape(hidden.shape[0], -1)))
        gate, up = self.up(hidden).chunk(2, dim=-1)
        return self.norm2(hidden + self.down(F.silu(gate) * up))


class NomicBertEmbeddingModel(EncoderModel):
    """A NomicBERT encoder over whole prompts; its output is the last layer's hidden states."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int) -> None:
        super().__init__()
        cfg = hf_config
        self.vocab_size = cfg.vocab_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
        self.emb_ln = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(cfg, dtype, tp) for _ in range(cfg.num_hidden_layers))
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 1000.0))
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                                          / head_dim), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        spans = prompt_spans(attn_metadata)
        hidden = self.emb_ln(self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0])
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :].to(hidden.dtype)
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :].to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, spans)
        return hidden

    # ---- weights: the remote code's names, bare or under ``bert.``
    def _canonical(self, raw_name: str) -> str | None:
        name = raw_name.removeprefix("bert.")
        return None if name.startswith(("mlm.", "cls.", "pooler.")) else name

    def _target(self, name: str) -> tuple[str, object]:
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        return name, None

    def _load(self, param: nn.Parameter, name: str, weight: LoadedWeight, shard_id: object) -> None:
        loader = getattr(param, "weight_loader", default_weight_loader)
        if name.endswith(".attn.Wqkv.weight"):
            rows = param.shape[0] // 3 * self.layers[0].qkv.tp.size  # q, k and v stacked, each `rows` long
            for i, part in enumerate(("q", "k", "v")):
                loader(param, weight_narrow(weight, 0, i * rows, rows), part)
        elif name.endswith((".mlp.fc12.weight", ".mlp.fc11.weight")):
            loader(param, weight, 0 if name.endswith("fc12.weight") else 1)  # the gate first, then the up rows
        else:
            loader(param, weight)

    _RENAMES = (("embeddings.word_embeddings.", "word_embeddings."),
                ("embeddings.token_type_embeddings.", "token_type_embeddings."), ("encoder.layers.", "layers."),
                (".attn.Wqkv.", ".qkv."), (".attn.out_proj.", ".attn_out."), (".mlp.fc11.", ".up."),
                (".mlp.fc12.", ".up."), (".mlp.fc2.", ".down."))

    def _checkpoint_names(self, param_name: str) -> list[str]:
        if param_name.endswith(".up.weight"):
            prefix = param_name.removesuffix(".up.weight").replace("layers.", "encoder.layers.", 1)
            return [f"{prefix}.mlp.fc11.weight", f"{prefix}.mlp.fc12.weight"]
        name = param_name
        for old, new in self._RENAMES:
            name = name.replace(new, old)
        return [name]
