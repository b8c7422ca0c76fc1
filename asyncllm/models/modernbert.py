"""ModernBERT encoders for embeddings, reranking and tagging: ``ModernBertModel``,
``ModernBertForSequenceClassification``, ``ModernBertForTokenClassification``.

gte-modernbert, nomic-modernbert-embed, modernbert-embed and the gte / Alibaba ModernBERT rerankers. Like BERT
(asyncllm/models/bert.py) each prompt is computed whole in one step with bidirectional attention and no KV cache,
but the layers are pre-LN (the first layer without its attention norm), the positions are rotary (GPT-NeoX
halves, one ``rope_theta`` for the global layers and one for the local ones), the local layers
(``layer_types``: ``sliding_attention``) see the tokens at most ``sliding_window`` away on either side, the MLP
is a GLU (the activation on the first half of ``Wi``'s output, times the second half), and no projection or norm
has a bias by default. The classifier's head (``head``: dense, activation, norm; then ``classifier``) reads the
CLS row or the mean of the rows (``classifier_pooling``); the token classifier's reads every row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError
from asyncllm.models.encoder import EncoderModel, load_stacked_qkv, prompt_spans, rotate_neox
from asyncllm.models.layers import LoadedWeight, TensorParallel, default_weight_loader, weight_narrow
from asyncllm.models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

__all__ = ["ModernBertEmbeddingModel", "ModernBertForSequenceClassification", "ModernBertForTokenClassification"]

_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}


def _activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise NotBuiltError("model", name, f"the {name!r} activation in ModernBERT (built: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _layer_types(cfg: Any) -> list[str]:
    """Each layer's attention: ``layer_types`` (transformers 5), else every ``global_attn_every_n_layers``-th
    layer global from the first."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    every = cfg.global_attn_every_n_layers
    return ["full_attention" if i % every == 0 else "sliding_attention" for i in range(cfg.num_hidden_layers)]


def _rope_theta(cfg: Any, layer_type: str) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get(layer_type, params)
    if params.get("rope_type", "default") != "default":
        raise NotBuiltError("model", params.get("rope_type"), "ModernBERT rotary scaling")
    old_key = "global_rope_theta" if layer_type == "full_attention" else "local_rope_theta"  # transformers 4's keys
    default = getattr(cfg, old_key, None) or (160000.0 if layer_type == "full_attention" else 10000.0)
    return float(params.get("rope_theta", default))


class _Layer(nn.Module):
    def __init__(self, cfg: Any, index: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        hidden, heads, eps, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.norm_eps, cfg.norm_bias
        self.head_dim = hidden // heads
        self.attn_norm = nn.LayerNorm(hidden, eps, bias=bias, dtype=dtype) if index else nn.Identity()
        self.qkv = QKVParallelLinear(hidden, self.head_dim, heads, heads, cfg.attention_bias, tp, dtype)
        self.attn_out = RowParallelLinear(hidden, hidden, cfg.attention_bias, tp, dtype)
        self.mlp_norm = nn.LayerNorm(hidden, eps, bias=bias, dtype=dtype)
        self.up = MergedColumnParallelLinear(hidden, [cfg.intermediate_size] * 2, cfg.mlp_bias, tp, dtype)
        self.down = RowParallelLinear(cfg.intermediate_size, hidden, cfg.mlp_bias, tp, dtype)
        self.act = _activation(cfg.hidden_activation)
        layer_type = _layer_types(cfg)[index]
        self.window = cfg.local_attention // 2 if layer_type == "sliding_attention" else None
        """Local layers: a token sees the tokens at most this far away (either side)."""
        theta = _rope_theta(cfg, layer_type)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32)
                                                          / self.head_dim), persistent=False)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        q, k, v = self.qkv.split_qkv(self.qkv(self.attn_norm(hidden)))
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :].to(q.dtype)
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :].to(q.dtype)
        q, k = rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)
        attn = torch.empty_like(q)
        for start, end in spans:
            mask = None
            if self.window is not None:
                index = torch.arange(end - start, device=q.device)
                mask = (index[:, None] - index[None, :]).abs() <= self.window
            attn[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                attn_mask=mask).transpose(0, 1)
        hidden = hidden + self.attn_out(attn.reshape(hidden.shape[0], -1))
        first, second = self.up(self.mlp_norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down(self.act(first) * second)


class ModernBertEmbeddingModel(EncoderModel):
    """A ModernBERT encoder over whole prompts; its output is the final-normed last hidden states."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int) -> None:
        super().__init__()
        cfg = hf_config
        self.vocab_size = cfg.vocab_size
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, cfg.norm_eps, bias=cfg.norm_bias, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(cfg, i, dtype, tp) for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, cfg.norm_eps, bias=cfg.norm_bias, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        spans = prompt_spans(attn_metadata)
        hidden = self.embed_norm(self.tok_embeddings(input_ids))
        for layer in self.layers:
            hidden = layer(hidden, positions, spans)
        return self.final_norm(hidden)

    # ---- weights: checkpoint names are ``model.``-prefixed under a task model, bare under ModernBertModel
    def _canonical(self, raw_name: str) -> str | None:
        name = raw_name.removeprefix("model.")
        if name.startswith(("decoder.", "head.")) and not hasattr(self, "head"):
            return None  # a masked-LM checkpoint's prediction head
        return name

    def _load(self, param: nn.Parameter, name: str, weight: LoadedWeight, shard_id: object) -> None:
        loader = getattr(param, "weight_loader", default_weight_loader)
        if name.endswith("attn.Wqkv.weight") or name.endswith("attn.Wqkv.bias"):
            load_stacked_qkv(param, weight, self.layers[0].qkv.tp.size)
        elif ".mlp.Wi." in name:
            rows = param.shape[0] // 2 * self.layers[0].up.tp.size
            for i in range(2):
                loader(param, weight_narrow(weight, 0, i * rows, rows), i)
        else:
            loader(param, weight)

    _RENAMES = (("embeddings.tok_embeddings.", "tok_embeddings."), ("embeddings.norm.", "embed_norm."),
                (".attn.Wqkv.", ".qkv."), (".attn.Wo.", ".attn_out."), (".mlp.Wi.", ".up."), (".mlp.Wo.", ".down."))


class ModernBertForSequenceClassification(ModernBertEmbeddingModel):
    """The encoder and its classification head, replicated on every rank, over the CLS row or the mean of the
    rows (``classifier_pooling``; the host pools them: asyncllm/engine/pooling_model.py)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        cfg, dtype = hf_config, kwargs["dtype"]
        self.head = nn.ModuleDict({
            "dense": nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias, dtype=dtype),
            "norm": nn.LayerNorm(cfg.hidden_size, cfg.norm_eps, bias=cfg.norm_bias, dtype=dtype)})
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=dtype)
        self.head_act = _activation(cfg.classifier_activation)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.tok_embeddings.weight.dtype)
        return self.classifier(self.head["norm"](self.head_act(self.head["dense"](hidden)))).float()

    def token_classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every prompt row ``[T, hidden]`` -> float32 logits ``[T, num_labels]`` (``token_classify``): the
        ``classifier`` alone on each row, as vLLM's ``DispatchPooler.for_seq_cls`` (its ``head`` is the pooler's)."""
        return self.classifier(hidden.to(self.tok_embeddings.weight.dtype)).float()


class ModernBertForTokenClassification(ModernBertForSequenceClassification):
    """A token classifier: the encoder, then the prediction ``head`` (dense, activation, norm) and ``classifier``
    on every token's final hidden state, as transformers' ``ModernBertForTokenClassification`` (its dropout is
    off at inference). It serves ``token_classify`` only, every prompt row (vLLM's ALL pooling)."""

    token_classify = ModernBertForSequenceClassification.classify
