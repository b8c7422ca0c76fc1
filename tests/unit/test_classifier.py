"""Sequence classification without an engine: a ``LlamaForSequenceClassification`` checkpoint (three labels) through
the real loader and the model runner in one process, its logits against transformers' (and with a LoRA adapter,
against PEFT's); the loader's refusal of a
checkpoint without ``score.weight``; the host's reading of a classifier's config (labels, activations, pair
encoding) and which requests each kind of model takes."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncllm import ConfigError, InvalidRequestError, NotBuiltError, PoolingParams, SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.engine.pooling_model import ClassifierHead, Matryoshka, PoolingModel, activate, pooling_model_of
from asyncllm.lora import LoRARequest
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.workers.model_runner import ModelRunner
from classifier_utils import hf_classifier_logits, tiny_classifier
from lora_utils import make_adapter

TOLERANCE = 1e-5
"""float32 logits against transformers'."""
LORA_TOLERANCE = 1e-4
"""With an adapter: its low-rank products (scale 2, logits up to ~3) add up in another order than PEFT's."""
PROMPTS = {"a": [5, 9, 14, 3, 77, 21], "b": [300, 4, 4, 17], "c": [88, 12, 250, 6, 7, 9, 10, 11, 401]}


@pytest.fixture(scope="module")
def classifier(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_classifier(tiny_llama, str(tmp_path_factory.mktemp("llama-classifier")), num_labels=3, seed=1)


def _runner(path: str, **config: object) -> ModelRunner:
    engine_config = EngineConfig.create(path, max_model_len=64, block_size=4, max_num_seqs=8,
                                        max_num_batched_tokens=64, device="cpu", dtype="float32", **config)
    runner = ModelRunner(engine_config, rank=0, tp_size=1, device=torch.device("cpu"))
    runner.load_model()
    runner.init_cache(32)
    return runner


def _classify_step(runner: ModelRunner, lora: LoRARequest | None = None) -> dict[str, np.ndarray]:
    """One prefill step of every prompt as a classification request: each one's logits."""
    classify, free = PoolingParams(task="classify"), iter(range(32))
    new = [NewRequestData(rid, prompt, len(prompt), SamplingParams(temperature=0.0, max_tokens=1),
                          [next(free) for _ in range(-(-len(prompt) // 4))], 0, lora=lora, pooling=classify)
           for rid, prompt in PROMPTS.items()]
    scheduled = {rid: len(prompt) for rid, prompt in PROMPTS.items()}
    out = runner.execute_model(SchedulerOutput(0, new, CachedRequestData(), scheduled, sum(scheduled.values())))
    assert sorted(out.embeddings) == sorted(PROMPTS)
    return {rid: np.frombuffer(data, dtype="<f4") for rid, data in out.embeddings.items()}


def test_the_runner_returns_the_score_heads_logits(classifier: str) -> None:
    runner = _runner(classifier)
    for rid, got in _classify_step(runner).items():
        want = hf_classifier_logits(classifier, PROMPTS[rid])
        assert got.shape == (3,) and np.abs(got - want).max() < TOLERANCE, (got, want)
    assert runner.model.lm_head is None  # no LM head is kept


def test_a_lora_adapter_changes_the_decoder_under_the_score_head(classifier: str, tiny_llama: str, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    adapter = make_adapter(tiny_llama, str(tmp_path / "adapter"), seed=5)  # a causal LM's adapter: same decoder
    runner = _runner(classifier, enable_lora=True, max_lora_rank=8)
    got = _classify_step(runner, LoRARequest("sql", 1, adapter))
    hf = AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, adapter).eval()
    for rid, prompt in PROMPTS.items():
        with torch.no_grad():
            want = peft(input_ids=torch.tensor([prompt])).logits[0].numpy()
        assert np.abs(got[rid] - want).max() < LORA_TOLERANCE, (got[rid], want)
        assert np.abs(want - hf_classifier_logits(classifier, prompt)).max() > 0.05  # the adapter matters


def test_a_classifier_checkpoint_without_its_score_head_is_refused(classifier: str, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "headless"
    shutil.copytree(classifier, folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["score.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="missing: score.weight"):
        _runner(str(folder))


def test_the_host_reads_labels_activations_and_pair_encoding(classifier: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(classifier)
    model = pooling_model_of(config.architectures[0], config)
    assert model.classifier == ClassifierHead(("class_0", "class_1", "class_2"))
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    assert model.encode_pair(tokenizer, "def f", "(x):")[0] == tokenizer("def f", "(x):").input_ids
    joined = ClassifierHead(("LABEL_0",), use_sep_token=False)
    assert joined.encode_pair(tokenizer, "def f", "(x):") == (tokenizer("def f(x):").input_ids, None)
    for fields, classify, score in [
        ({"problem_type": "regression"}, "identity", "classify"),
        ({"problem_type": "multi_label_classification"}, "sigmoid", "classify"),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "classify", "identity"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "classify", "classify"),
    ]:
        head = ClassifierHead.from_hf_config(SimpleNamespace(id2label={0: "yes"}, **fields))
        assert (head.classify_activation, head.score_activation) == (classify, score), fields
    with pytest.raises(NotBuiltError, match="Tanh"):
        ClassifierHead.from_hf_config(SimpleNamespace(sbert_ce_default_activation_function="torch.nn.modules.Tanh"))
    assert not ClassifierHead.from_hf_config(SimpleNamespace(use_pad_token=False)).use_sep_token


def test_activations_equal_torchs() -> None:
    logits = [0.3, -1.7, 2.25, 40.0]
    assert np.allclose(activate(logits, "classify"), torch.tensor(logits).softmax(0).tolist(), atol=1e-7)
    assert np.allclose(activate(logits, "sigmoid"), torch.tensor(logits).sigmoid().tolist(), atol=1e-7)
    assert np.allclose(activate([-3.5], "classify"), torch.tensor([-3.5]).sigmoid().tolist(), atol=1e-7)
    assert activate(logits, "identity") == logits
    assert activate([-800.0, 800.0], "classify") == [0.0, 1.0]  # no overflow


@pytest.mark.parametrize("model, allowed", [
    (PoolingModel("LlamaForCausalLM"), {"generate", "embed"}),
    (PoolingModel("LlamaModel", generates=False), {"embed"}),
    (PoolingModel("Qwen3ForSequenceClassification", False, ClassifierHead(("LABEL_0",))), {"classify"}),
])
def test_each_model_kind_takes_its_own_requests(model: PoolingModel, allowed: set[str]) -> None:
    tasks = {"generate": None, "embed": PoolingParams(), "classify": PoolingParams(task="classify")}
    for task, pooling in tasks.items():
        if task in allowed:
            model.check(pooling)
        else:
            with pytest.raises(InvalidRequestError, match=model.architecture):
                model.check(pooling)


def test_dimensions_only_for_a_matryoshka_config_as_vllm() -> None:
    """vLLM's ``is_matryoshka`` / ``matryoshka_dimensions`` (read after hf_overrides), in its words."""
    config = SimpleNamespace(matryoshka_dimensions=[8, 16])
    Matryoshka.of(config, "m").check(16)
    Matryoshka.of(SimpleNamespace(is_matryoshka=True), "m").check(5)
    with pytest.raises(InvalidRequestError) as only:
        Matryoshka.of(config, "m").check(12)
    with pytest.raises(InvalidRequestError) as none:
        Matryoshka.of(SimpleNamespace(), "m").check(8)
    assert (only.value.field, none.value.field) == ("dimensions", "dimensions")
    assert only.value.message == ('Model "m" only supports [8, 16] matryoshka dimensions, use other output '
                                  "dimensions will lead to poor results.")
    assert none.value.message == ('Model "m" does not support matryoshka representation, changing output '
                                  "dimensions will lead to poor results.")


def test_a_classification_request_takes_no_dimensions() -> None:
    with pytest.raises(InvalidRequestError, match="not to classification") as info:
        PoolingParams(task="classify", dimensions=8).validate()
    assert info.value.field == "dimensions"

