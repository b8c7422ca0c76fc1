"""The BERT and ModernBERT encoders in process: transformers' last hidden states for prompts laid end to end, from
checkpoint names as task models and old checkpoints write them (``bert.`` prefix, LayerNorm ``gamma`` / ``beta``);
ModernBERT's classifier logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, BertModel

from asyncllm.errors import ConfigError
from asyncllm.models.bert import BertEmbeddingModel
from asyncllm.models.layers import TensorParallel


def _pair():
    config = BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=40)
    torch.manual_seed(0)
    reference = BertModel(config).eval()
    model = BertEmbeddingModel(config, dtype=torch.float32, tp=TensorParallel(0, 1), attn_backend=None,
                               max_position=40)
    return reference, model


def _old_name(name: str) -> str:
    name = "bert." + name
    if "LayerNorm" in name:
        name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
    return name


def test_prompts_end_to_end_equal_transformers_from_prefixed_and_old_names() -> None:
    reference, model = _pair()
    weights = [(_old_name(name), tensor) for name, tensor in reference.state_dict().items()]
    assert model.load_weights(weights) == model.checkpoint_weight_names()
    prompts = [[2, 17, 40, 8, 3], [2, 9, 3], [2, 33, 12, 60, 61, 5, 3]]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    starts = [0, 5, 8, 15]
    with torch.no_grad():
        out = model(ids, positions, [], SimpleNamespace(query_start_loc_cpu=starts))
        for prompt, start, end in zip(prompts, starts, starts[1:]):
            expected = reference(torch.tensor([prompt])).last_hidden_state[0]
            torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=0)
    assert torch.equal(model.compute_logits(out[:2]), torch.zeros(2, 90))


def test_bert_token_types_are_one_for_a_pairs_second_text_only() -> None:
    """A single text containing [SEP] (id 3) is all type 0 (as transformers' tokenizer gives it); a pair's second
    text, from the start the host sends, type 1."""
    from asyncllm.pooling import PoolingParams
    from asyncllm.workers.pooler import Pooler

    reference, model = _pair()
    model.load_weights(reference.state_dict().items())
    assert model.takes_token_types
    prompts, types = [[2, 17, 3, 8, 9, 3], [2, 9, 3, 40, 3]], [[0] * 6, [0, 0, 0, 1, 1]]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    pooler = Pooler()
    pooler.requests.update({"single": PoolingParams(), "pair": PoolingParams(task="classify", token_type_start=3)})
    starts = pooler.token_type_starts(["single", "pair"])
    assert starts == [None, 3] and pooler.token_type_starts(["single"]) is None
    with torch.no_grad():
        out = model(ids, positions, [], SimpleNamespace(query_start_loc_cpu=[0, 6, 11]), token_type_starts=starts)
        for prompt, type_ids, rows in zip(prompts, types, (out[:6], out[6:])):
            expected = reference(torch.tensor([prompt]), token_type_ids=torch.tensor([type_ids])).last_hidden_state[0]
            torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0)


def test_a_token_type_start_before_its_prompt_marks_no_other_prompts_rows() -> None:
    from asyncllm.models.bert import _token_types

    types = _token_types(torch.arange(7), [(0, 3), (3, 7)], [None, -2])
    assert types.tolist() == [0, 0, 0, 1, 1, 1, 1]


def test_unknown_and_misshapen_weights_are_refused_by_name() -> None:
    reference, model = _pair()
    with pytest.raises(ConfigError, match="unexpected weights: encoder.layer.0.crossattention.x"):
        model.load_weights([("encoder.layer.0.crossattention.x.weight", torch.zeros(1))])
    with pytest.raises(ConfigError, match="encoder.layer.1.output.dense.weight"):
        model.load_weights([("encoder.layer.1.output.dense.weight", torch.zeros(32, 63))])


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_modernbert_classifier_equals_transformers_past_its_local_window(pooling: str) -> None:
    """ModernBERT (rotary per layer type, 8-token local windows, GLU) with its head over the mean of the rows or
    the CLS row: transformers' logits for a 20-token prompt beside a 3-token one."""
    from transformers import ModernBertConfig
    from transformers import ModernBertForSequenceClassification as HfClassifier

    from asyncllm.models.modernbert import ModernBertForSequenceClassification

    config = ModernBertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                              intermediate_size=48, max_position_embeddings=64, local_attention=8, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, num_labels=2,
                              classifier_pooling=pooling)
    torch.manual_seed(0)
    reference = HfClassifier(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.3)
    model = ModernBertForSequenceClassification(config, dtype=torch.float32, tp=TensorParallel(0, 1),
                                                attn_backend=None, max_position=64)
    assert model.load_weights(reference.state_dict().items()) == model.checkpoint_weight_names()
    prompts = [list(range(3, 23)), [5, 9, 11]]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    with torch.no_grad():
        out = model(ids, positions, [], SimpleNamespace(query_start_loc_cpu=[0, 20, 23]))
        for prompt, rows in zip(prompts, (out[:20], out[20:])):
            pooled = rows.mean(0) if pooling == "mean" else rows[0]
            expected = reference(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(model.classify(pooled), expected, atol=1e-5, rtol=0)


def test_embeddinggemma_reads_transformers_bidirectional_window_from_a_loaded_config_and_the_workers_copy() -> None:
    """transformers' Gemma 3 config converts config.json's ``sliding_window`` (512 -> 257: keys less than 257 away)
    on load and writes the unconverted value back; the workers' copy of the config holds that unconverted one."""
    from transformers import Gemma3TextConfig

    from asyncllm.models.checkpoint import hf_config_from_json, hf_config_json
    from asyncllm.models.embedding_gemma import bidirectional_window

    config = Gemma3TextConfig(sliding_window=512, use_bidirectional_attention=True)
    assert config.sliding_window == 257
    assert bidirectional_window(config) == bidirectional_window(hf_config_from_json(hf_config_json(config))) == 257


def test_a_dense_module_whose_activation_is_not_applied_is_refused_by_name(tmp_path) -> None:
    import json

    from asyncllm.errors import NotBuiltError
    from asyncllm.models.st_dense import dense_modules, embedding_width

    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (tmp_path / "2_Dense").mkdir()
    config = {"in_features": 8, "out_features": 4, "bias": True}  # sentence-transformers' default: Tanh
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps(config))
    assert [(m.out_features, m.bias, m.activation) for m in dense_modules(str(tmp_path))] == [(4, True, "tanh")]
    assert embedding_width(str(tmp_path), 8) == 4 and embedding_width(None, 8) == 8
    config["activation_function"] = "torch.nn.modules.activation.ReLU"
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotBuiltError, match="Dense module with torch.nn.modules.activation.ReLU"):
        dense_modules(str(tmp_path))
