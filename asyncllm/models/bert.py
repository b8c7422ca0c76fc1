"""BERT-family encoders for embeddings: ``BertModel``, ``RobertaModel``, ``XLMRobertaModel`` (docs/embeddings.md).

Sentence-embedding checkpoints such as bge, e5, gte, all-MiniLM and multilingual-e5 are bidirectional encoders:
every token attends to every token of its prompt, so a prompt is computed whole, in one step (the host turns
chunked prefill and prefix caching off for these architectures), and the model keeps no KV cache. Each layer is
post-LN: ``h = LN(h + attn(h)); h = LN(h + down(act(up(h))))``. The embedding sums the word, absolute position
and token-type embeddings (type 0; 1 for a score pair's second text, where the host's tokenizer marks it), then a
LayerNorm. RoBERTa and XLM-R number positions from ``pad_token_id + 1``.

The projections are the parallel linears (query, key and value fused in one column-parallel matrix, the output
projections row-parallel), so tensor parallelism splits the heads and the intermediate features; the embeddings
and norms are replicated. The checkpoint's ``pooler.dense`` (BERT's next-sentence head) is not used: sentence
embeddings pool the last hidden states (CLS by default, or as the checkpoint's sentence-transformers config says).
The classifiers' heads: ``BertForSequenceClassification`` (and RoBERTa's, XLM-R's) on the CLS row,
``BertForTokenClassification`` on every row (docs/pooling.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError
from asyncllm.models.encoder import EncoderModel, prompt_spans
from asyncllm.models.layers import LoadedWeight, TensorParallel, default_weight_loader
from asyncllm.models.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

__all__ = ["BertEmbeddingModel", "BertForSequenceClassification", "BertForTokenClassification", "position_offset"]

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_PREFIXES = ("bert.", "roberta.", "model.")
"""Prefixes a checkpoint saved from a task model (``BertForMaskedLM`` & co.) puts before the encoder's names."""
_UNUSED = ("pooler.", "embeddings.position_ids", "cls.", "lm_head.")
"""Checkpoint tensors the embedding model does not read: the pooler and task heads, a saved position table."""
_PACKED = {"attention.self.query.": "q", "attention.self.key.": "k", "attention.self.value.": "v"}


def position_offset(hf_config: Any) -> int:
    """Where a prompt's positions start in the position table: ``pad_token_id + 1`` for RoBERTa and XLM-R."""
    if getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
        return int(hf_config.pad_token_id) + 1
    return 0


class _Layer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        hidden, heads, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.layer_norm_eps
        self.qkv = QKVParallelLinear(hidden, hidden // heads, heads, heads, True, tp, dtype)
        self.attn_out = RowParallelLinear(hidden, hidden, True, tp, dtype)
        self.attn_norm = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.up = ColumnParallelLinear(hidden, cfg.intermediate_size, True, tp, dtype)
        self.down = RowParallelLinear(cfg.intermediate_size, hidden, True, tp, dtype)
        self.out_norm = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        q, k, v = self.qkv.split_qkv(self.qkv(hidden))
        attn = torch.empty_like(q)
        for start, end in spans:  # each prompt attends to itself only, both ways
            attn[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            ).transpose(0, 1)
        hidden = self.attn_norm(hidden + self.attn_out(attn.reshape(hidden.shape[0], -1)))
        return self.out_norm(hidden + self.down(self.act(self.up(hidden))))


class BertEmbeddingModel(EncoderModel):
    """A BERT-style encoder over whole prompts; its output is the last hidden states (no LM head)."""

    unused = _UNUSED

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                 max_position: int) -> None:
        super().__init__()
        cfg = hf_config
        if cfg.hidden_act not in _ACTIVATIONS:
            raise NotBuiltError("model", cfg.hidden_act, f"the {cfg.hidden_act!r} activation in a BERT encoder "
                                                         f"(built: {', '.join(_ACTIVATIONS)})")
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            raise NotBuiltError("model", cfg.position_embedding_type, "BERT position embeddings other than absolute")
        self.vocab_size = cfg.vocab_size
        self.offset = position_offset(cfg)
        self.takes_token_types = cfg.type_vocab_size > 1
        """The runner passes ``token_type_starts`` (score pairs' second texts, from the host's tokenizer)."""
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(cfg, dtype, tp) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, token_type_starts: list[int | None] | None = None) -> torch.Tensor:
        """``[T]`` ids of whole prompts laid end to end -> ``[T, hidden]`` last hidden states."""
        spans = prompt_spans(attn_metadata)
        hidden = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
                  + self.token_type_embeddings(_token_types(input_ids, spans, token_type_starts)))
        hidden = self.embed_norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, spans)
        return hidden

    # ---- weights
    def _canonical(self, raw_name: str) -> str | None:
        name = _canonical(raw_name)
        return None if name.startswith(self.unused) else name

    def _target(self, name: str) -> tuple[str, object]:
        return self._packed(name)

    def _checkpoint_names(self, param_name: str) -> list[str]:
        return [ckpt for ckpt, _ in self._unpacked(param_name)]

    def _load(self, param: nn.Parameter, name: str, weight: LoadedWeight, shard_id: object) -> None:
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, weight) if shard_id is None else loader(param, weight, shard_id)

    @staticmethod
    def _packed(name: str) -> tuple[str, object]:
        """Checkpoint name -> (parameter name, shard id or None)."""
        if name.startswith(("pooler.", "classifier.")):  # a classifier's head: the same names
            return name, None
        if name.startswith("embeddings."):
            return name.replace("embeddings.LayerNorm.", "embed_norm.").removeprefix("embeddings."), None
        layer, _, rest = name.removeprefix("encoder.layer.").partition(".")
        prefix = f"layers.{layer}."
        for part, shard_id in _PACKED.items():
            if rest.startswith(part):
                return prefix + "qkv." + rest.removeprefix(part), shard_id
        for old, new in (("attention.output.dense.", "attn_out."), ("attention.output.LayerNorm.", "attn_norm."),
                         ("intermediate.dense.", "up."), ("output.dense.", "down."), ("output.LayerNorm.", "out_norm.")):
            if rest.startswith(old):
                return prefix + new + rest.removeprefix(old), None
        return name, None

    @staticmethod
    def _unpacked(param_name: str) -> list[tuple[str, object]]:
        """Parameter name -> the checkpoint names it loads from (the inverse of `_packed`)."""
        if param_name.startswith(("pooler.", "classifier.")):
            return [(param_name, None)]
        if not param_name.startswith("layers."):
            norm = param_name.replace("embed_norm.", "LayerNorm.")
            return [("embeddings." + norm, None)]
        _, layer, module, leaf = param_name.split(".")
        base = f"encoder.layer.{layer}."
        if module == "qkv":
            return [(base + part + leaf, shard) for part, shard in _PACKED.items()]
        old = {"attn_out": "attention.output.dense.", "attn_norm": "attention.output.LayerNorm.",
               "up": "intermediate.dense.", "down": "output.dense.", "out_norm": "output.LayerNorm."}[module]
        return [(base + old + leaf, None)]


def _token_types(input_ids: torch.Tensor, spans: list[tuple[int, int]],
                 starts: list[int | None] | None) -> torch.Tensor:
    """0 for every token, and 1 from ``starts[i]`` to the end of prompt i: a score pair's second text, where the
    host's tokenizer marked it (``token_type_ids``, as vLLM passes them). A single text is all 0, "[SEP]" in it
    or not. A start before the prompt marks it all (never the rows of the prompt before it in the batch)."""
    types = torch.zeros_like(input_ids)
    for (start, end), first in zip(spans, starts or ()):
        if first is not None:
            types[start + max(first, 0):end] = 1
    return types


def _canonical(name: str) -> str:
    """A checkpoint name without a task model's prefix, with old TF-era LayerNorm names (gamma, beta) renamed."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.endswith(".gamma"):
        return name[: -len("gamma")] + "weight"
    if name.endswith(".beta"):
        return name[: -len("beta")] + "bias"
    return name


class BertForSequenceClassification(BertEmbeddingModel):
    """A cross-encoder or classifier: the encoder, then its head on the CLS row (the host pools CLS for it).
    BERT's head is its ``pooler`` (dense, tanh) then ``classifier``; RoBERTa's and XLM-R's is
    ``classifier.dense``, tanh, ``classifier.out_proj``. The head is small: every rank keeps all of it."""

    unused = ("embeddings.position_ids", "cls.", "lm_head.")

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        dtype, hidden, labels = kwargs["dtype"], hf_config.hidden_size, hf_config.num_labels
        if position_offset(hf_config):  # RoBERTa, XLM-R
            self.classifier = nn.ModuleDict({"dense": nn.Linear(hidden, hidden, dtype=dtype),
                                             "out_proj": nn.Linear(hidden, labels, dtype=dtype)})
        else:
            self.pooler = nn.ModuleDict({"dense": nn.Linear(hidden, hidden, dtype=dtype)})
            self.classifier = nn.Linear(hidden, labels, dtype=dtype)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """The CLS row's final hidden state ``[..., hidden]`` -> float32 logits ``[..., num_labels]``."""
        hidden = hidden.to(self.word_embeddings.weight.dtype)
        if isinstance(self.classifier, nn.ModuleDict):
            return self.classifier["out_proj"](torch.tanh(self.classifier["dense"](hidden))).float()
        return self.classifier(torch.tanh(self.pooler["dense"](hidden))).float()

    def token_classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every prompt row ``[T, hidden]`` -> float32 logits ``[T, num_labels]`` (``token_classify``), as vLLM's
        ``DispatchPooler.for_seq_cls`` computes them: the ``classifier`` alone on each row for BERT (its ``pooler``
        reads the CLS row only), RoBERTa's and XLM-R's whole ``classifier`` head (dense, tanh, out_proj)."""
        hidden = hidden.to(self.word_embeddings.weight.dtype)
        if isinstance(self.classifier, nn.ModuleDict):
            return self.classify(hidden)
        return self.classifier(hidden).float()


class BertForTokenClassification(BertEmbeddingModel):
    """A token classifier (NER and other taggers): the encoder, then ``classifier`` (a linear layer over
    ``num_labels``) on every token's final hidden state, as transformers' ``BertForTokenClassification`` (whose
    checkpoint has no ``pooler``). It serves ``token_classify`` only, every prompt row (vLLM's ALL pooling); the
    head is small: every rank keeps all of it."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.classifier = nn.Linear(hf_config.hidden_size, hf_config.num_labels, dtype=kwargs["dtype"])

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[..., hidden]`` -> float32 logits ``[..., num_labels]``, row by row."""
        return self.classifier(hidden.to(self.word_embeddings.weight.dtype)).float()

    token_classify = classify
