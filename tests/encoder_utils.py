"""Tiny random BERT-family encoders with a WordPiece tokenizer, saved as transformers saves them, and their
sentence embeddings from transformers (the reference of tests/engine/test_encoder_embeddings.py)."""

from __future__ import annotations

import json
import string
from pathlib import Path

__all__ = ["make_tiny_encoder", "hf_pair_logits", "hf_sentence_embedding"]

_WORDS = ["the", "a", "is", "of", "paged", "attention", "engine", "token", "model", "query", "document", "what"]


def _tokenizer(token_types: bool):
    """A lower-casing WordPiece tokenizer that writes ``[CLS] text [SEP]``, as BERT's does; with ``token_types``
    it returns them too (BERT's does, XLM-R's does not)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *string.ascii_lowercase,
                                *string.digits, *string.punctuation,
                                *(f"##{c}" for c in string.ascii_lowercase + string.digits)]))  # ids 0..n-1: once each
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"][
                                       slice(None) if token_types else slice(0, None, 2)])


def make_tiny_encoder(folder: str | Path, kind: str = "bert", pooling: str | None = None, seed: int = 0,
                      num_labels: int | None = None, dense: tuple[int, ...] = ()) -> str:
    """A ``BertModel`` (``kind="bert"``), ``XLMRobertaModel`` (``"xlm-roberta"``), ``RobertaForMaskedLM``
    (``"roberta-mlm"``), ``ModernBertModel``
    (``"modernbert"``), ``NomicBertModel`` (``"nomic"``), ``GteModel`` (``"gte"``) or EmbeddingGemma's ``Gemma3TextModel`` (``"embeddinggemma"``) of random weights in
    ``folder``; with ``num_labels`` their ``*ForSequenceClassification``; ``pooling`` ("mean", "cls") writes a
    sentence-transformers Pooling module choosing it, ``dense`` (widths) Dense modules after it (bias-free,
    Identity, as EmbeddingGemma's; 32 -> dense[0] -> ...)."""
    import torch
    from transformers import (BertConfig, BertForSequenceClassification, BertModel, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification, XLMRobertaModel)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(token_types=kind in ("bert", "nomic"))
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=66)
    if num_labels is not None:
        shape["num_labels"] = num_labels
    if kind == "bert":
        model = (BertModel if num_labels is None else BertForSequenceClassification)(BertConfig(**shape, pad_token_id=0))
    elif kind == "modernbert":  # 8-token local windows (a token sees 4 either side) in 2 of 3 layers
        from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel

        config = ModernBertConfig(**{**shape, "num_hidden_layers": 3}, local_attention=8, pad_token_id=0,
                                  bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
                                  classifier_pooling="mean")
        model = (ModernBertModel if num_labels is None else ModernBertForSequenceClassification)(config)
    elif kind == "embeddinggemma":  # 4-position bidirectional windows in 2 of 3 layers, grouped KV heads
        from transformers import Gemma3TextConfig, Gemma3TextModel

        config = Gemma3TextConfig(**{**shape, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=8,
                                  query_pre_attn_scalar=8, sliding_window=4, use_bidirectional_attention=True,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                  pad_token_id=0, bos_token_id=2, eos_token_id=3)
        model = Gemma3TextModel(config)
    elif kind == "nomic":  # NomicBERT: rotary positions, SwiGLU, no biases (saved under the remote code's names)
        from transformers import NomicBertConfig, NomicBertModel

        model = NomicBertModel(NomicBertConfig(**shape, pad_token_id=0))
    elif kind == "gte":  # GTE: NomicBERT's layout with biases and a GELU gate (saved under Alibaba's names)
        from transformers import GteConfig, GteForSequenceClassification, GteModel

        config = GteConfig(**shape, pad_token_id=0, type_vocab_size=1)
        model = (GteModel if num_labels is None else GteForSequenceClassification)(config)
    elif kind == "roberta-mlm":  # RoBERTa as its masked-LM pretraining saves it (an LM head, no pooler)
        from transformers import RobertaConfig, RobertaForMaskedLM

        model = RobertaForMaskedLM(RobertaConfig(**shape, pad_token_id=0, type_vocab_size=1))
    else:
        config = XLMRobertaConfig(**shape, pad_token_id=0, type_vocab_size=1)  # positions from 1
        model = (XLMRobertaModel if num_labels is None else XLMRobertaForSequenceClassification)(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.1 if "LayerNorm" in name or "norm" in name
                          else 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        for i, (n_in, n_out) in enumerate(zip((32,) + dense[:-1], dense)):
            sub = f"{i + 2}_Dense"
            modules.append({"idx": i + 2, "name": str(i + 2), "path": sub, "type": "sentence_transformers.models.Dense"})
            (folder / sub).mkdir()
            (folder / sub / "config.json").write_text(json.dumps(
                {"in_features": n_in, "out_features": n_out, "bias": False,
                 "activation_function": "torch.nn.modules.linear.Identity"}))
            from safetensors.torch import save_file

            save_file({"linear.weight": torch.randn(n_out, n_in) * n_in**-0.5}, str(folder / sub / "model.safetensors"))
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # vLLM normalizes only with it listed
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
             "pooling_mode_mean_tokens": pooling == "mean"}))
    return str(folder)


def hf_sentence_embedding(folder: str, text: str, pooling: str, dimensions: int | None = None,
                          max_length: int | None = None) -> list[float]:
    """transformers' normalized sentence embedding of ``text`` (cut by the tokenizer to ``max_length`` tokens, as
    sentence-transformers cuts): the mean or the first of the last hidden states, through the folder's Dense
    modules, its first ``dimensions``; ``pooling`` "all": every token's row so (``token_embed``), one list each."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
        hidden = model(**tokenizer(text, return_tensors="pt", **cut)).last_hidden_state[0]
    vector = hidden if pooling == "all" else hidden.mean(0) if pooling == "mean" else hidden[0]
    modules = json.loads((Path(folder) / "modules.json").read_text()) if (Path(folder) / "modules.json").exists() else []
    for module in modules:  # sentence-transformers' Dense projections (bias-free, Identity) after the pooling
        if module["type"].endswith(".Dense"):
            from safetensors.torch import load_file

            vector = vector @ load_file(str(Path(folder) / module["path"] / "model.safetensors"))["linear.weight"].T
    return torch.nn.functional.normalize(vector[..., :dimensions], dim=-1).tolist()


def hf_pair_logits(folder: str, text_1: str, text_2: str | None = None) -> list[float]:
    """transformers' classifier logits for one text or a pair (its tokenizer's token types)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**tokenizer(text_1, text_2, return_tensors="pt")).logits[0].tolist()
