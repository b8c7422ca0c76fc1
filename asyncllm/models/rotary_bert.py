"""BERT-shaped encoders with rotary positions for embeddings: NomicBERT (``NomicBertModel``: nomic-embed-text v1,
v1.5) and GTE (``GteModel``: gte-multilingual-base, Snowflake arctic-embed-m-v2.0; vLLM's ``GteNewModel`` too).

As BERT (asyncllm/models/bert.py) each prompt is computed whole in one step with bidirectional attention and no KV
cache, and the layers are post-LN: ``h = LN(h + attn(h)); h = LN(h + mlp(h))``. Unlike BERT the positions are
rotary (GPT-NeoX halves over the whole head; `compute_inv_freq` reads the config's rope parameters), the MLP is
gated (``down(act(gate(h)) * up(h))``: NomicBERT's SiLU, GTE's GELU), and the embedding is the word embedding plus
token type 0's (none when ``type_vocab_size`` is 0), then a LayerNorm. NomicBERT has no biases; GTE's attention
projections and ``down`` have them. Each family reads its checkpoints' own names (`_RENAMES`): the hub's, which
transformers' ``save_pretrained`` writes too. The configs' names and options: asyncllm/models/rotary_bert_config.py.
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
from asyncllm.models.rotary import compute_inv_freq

__all__ = ["RotaryBertModel", "NomicBertEmbeddingModel", "GteEmbeddingModel", "GteForSequenceClassification"]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class _Layer(nn.Module):
    def __init__(self, cfg: Any, bias: bool, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        hidden, heads, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.layer_norm_eps
        self.qkv = QKVParallelLinear(hidden, hidden // heads, heads, heads, bias, tp, dtype)
        self.attn_out = RowParallelLinear(hidden, hidden, bias, tp, dtype)
        self.norm1 = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.up = MergedColumnParallelLinear(hidden, [cfg.intermediate_size] * 2, False, tp, dtype)  # gate, up
        self.down = RowParallelLinear(cfg.intermediate_size, hidden, bias, tp, dtype)
        self.norm2 = nn.LayerNorm(hidden, eps, dtype=dtype)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise NotBuiltError("model", cfg.hidden_act, f"the {cfg.hidden_act!r} activation in a rotary BERT "
                                                         f"(built: {', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: list[tuple[int, int]]) -> torch.Tensor:
        q, k, v = self.qkv.split_qkv(self.qkv(hidden))
        q, k = rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)
        attn = torch.empty_like(q)
        for start, end in spans:
            attn[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            ).transpose(0, 1)
        hidden = self.norm1(hidden + self.attn_out(attn.reshape(hidden.shape[0], -1)))
        gate, up = self.up(hidden).chunk(2, dim=-1)
        return self.norm2(hidden + self.down(self.act(gate) * up))


class RotaryBertModel(EncoderModel):
    """A rotary BERT over whole prompts; its output is the last layer's hidden states. A family sets its biases,
    its checkpoints' names (`_RENAMES`, checkpoint -> parameter; `_PREFIXES` before them, `_UNUSED` not read) and
    how its gate and up rows are stored (`_GATE_UP`)."""

    _BIAS = False
    _RENAMES: tuple[tuple[str, str], ...] = ()
    _PREFIXES: tuple[str, ...] = ()
    _UNUSED: tuple[str, ...] = ("pooler.", "classifier.", "lm_head.", "cls.", "mlm.")
    _GATE_UP: tuple[str, ...] = ()
    """The checkpoint's gate and up matrices: two names (gate first), or one name holding the up rows, then the
    gate's."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int) -> None:
        super().__init__()
        cfg = hf_config
        self.vocab_size = cfg.vocab_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        types = getattr(cfg, "type_vocab_size", 0) or 0
        self.token_type_embeddings = nn.Embedding(types, cfg.hidden_size, dtype=dtype) if types else None
        self.emb_ln = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(cfg, self._BIAS, dtype, tp) for _ in range(cfg.num_hidden_layers))
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        inv_freq, self.attention_scaling = compute_inv_freq(cfg, head_dim)
        if inv_freq.numel() * 2 != head_dim:
            raise NotBuiltError("model", inv_freq.numel() * 2, "a rotary BERT rotating part of each head")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        spans = prompt_spans(attn_metadata)
        hidden = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        hidden = self.emb_ln(hidden)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), -1)[:, None, :]
        cos = (angles.cos() * self.attention_scaling).to(hidden.dtype)
        sin = (angles.sin() * self.attention_scaling).to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, spans)
        return hidden

    # ---- weights: the family's checkpoint names (`_RENAMES`)
    def _canonical(self, raw_name: str) -> str | None:
        name = raw_name
        for prefix in self._PREFIXES:
            name = name.removeprefix(prefix)
        return None if name.startswith(self._UNUSED) else name

    def _load(self, param: nn.Parameter, name: str, weight: LoadedWeight, shard_id: object) -> None:
        loader = getattr(param, "weight_loader", default_weight_loader)
        if self._target(name)[0].split(".")[-2] == "qkv":
            load_stacked_qkv(param, weight, self.layers[0].qkv.tp.size)
        elif len(self._GATE_UP) == 2 and name.endswith(self._GATE_UP):
            loader(param, weight, 0 if name.endswith(self._GATE_UP[0]) else 1)
        elif len(self._GATE_UP) == 1 and name.endswith(self._GATE_UP[0]):
            rows = param.shape[0] // 2 * self.layers[0].up.tp.size
            loader(param, weight_narrow(weight, 0, 0, rows), 1)  # the up rows first
            loader(param, weight_narrow(weight, 0, rows, rows), 0)
        else:
            loader(param, weight)

    def _checkpoint_names(self, param_name: str) -> list[str]:
        [name] = super()._checkpoint_names(param_name)
        if len(self._GATE_UP) == 2 and name.endswith(self._GATE_UP[0]):  # one parameter, two checkpoint tensors
            return [name.removesuffix(self._GATE_UP[0]) + gate_or_up for gate_or_up in self._GATE_UP]
        return [name]


class NomicBertEmbeddingModel(RotaryBertModel):
    """NomicBERT: no biases, SwiGLU (``fc12`` the gate, ``fc11`` the up rows), the remote code's names."""

    _PREFIXES = ("bert.",)
    _RENAMES = (("embeddings.word_embeddings.", "word_embeddings."),
                ("embeddings.token_type_embeddings.", "token_type_embeddings."), ("encoder.layers.", "layers."),
                (".attn.Wqkv.", ".qkv."), (".attn.out_proj.", ".attn_out."), (".mlp.fc11.", ".up."),
                (".mlp.fc12.", ".up."), (".mlp.fc2.", ".down."))
    _GATE_UP = ("mlp.fc12.weight", "mlp.fc11.weight")


class GteEmbeddingModel(RotaryBertModel):
    """GTE (Alibaba's "new" architecture): biased attention and ``down``, ``up_gate_proj`` the up rows then the
    gate's, names under ``new.`` in a task model's checkpoint."""

    _BIAS = True
    _PREFIXES = ("new.", "model.")
    _RENAMES = (("embeddings.LayerNorm.", "emb_ln."), ("embeddings.word_embeddings.", "word_embeddings."),
                ("embeddings.token_type_embeddings.", "token_type_embeddings."), ("encoder.layer.", "layers."),
                (".attention.qkv_proj.", ".qkv."), (".attention.o_proj.", ".attn_out."),
                (".mlp.up_gate_proj.", ".up."), (".mlp.down_proj.", ".down."), (".attn_ln.", ".norm1."),
                (".mlp_ln.", ".norm2."))
    _GATE_UP = ("mlp.up_gate_proj.weight",)


class GteForSequenceClassification(GteEmbeddingModel):
    """A GTE cross-encoder or reranker (transformers' ``GteForSequenceClassification``; Alibaba's
    ``NewForSequenceClassification``, vLLM's ``GteNewForSequenceClassification``, e.g. gte-multilingual-reranker-base):
    the encoder, then its ``pooler`` (dense, tanh) on the CLS row and ``classifier`` (the host pools CLS). The head
    is small: every rank keeps all of it."""

    _PREFIXES = ("gte.", "new.", "model.")
    _UNUSED = tuple(unused for unused in GteEmbeddingModel._UNUSED if unused not in ("pooler.", "classifier."))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        dtype, hidden = kwargs["dtype"], hf_config.hidden_size
        self.pooler = nn.ModuleDict({"dense": nn.Linear(hidden, hidden, dtype=dtype)})
        self.classifier = nn.Linear(hidden, hf_config.num_labels, dtype=dtype)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """The CLS row's final hidden state ``[..., hidden]`` -> float32 logits ``[..., num_labels]``."""
        hidden = hidden.to(self.word_embeddings.weight.dtype)
        return self.classifier(torch.tanh(self.pooler["dense"](hidden))).float()

    def token_classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every prompt row ``[T, hidden]`` -> float32 logits ``[T, num_labels]``: the ``classifier`` alone on each
        row, as vLLM's ``DispatchPooler.for_seq_cls`` (its ``pooler`` reads the CLS row only), as for BERT."""
        return self.classifier(hidden.to(self.word_embeddings.weight.dtype)).float()
