"""`SyncEngine`'s forms of vLLM's API that `AsyncEngine` has: `chat(sampling_params=...)`, `abort` from another thread,
`get_tokenizer`, `default_sampling_params`, `add_lora` / `remove_lora` (the tiny Llama), `classify` / `score` (a tiny
one-label Qwen3 cross-encoder against transformers). The async forms: tests/engine/test_vllm_api_gaps.py."""

from __future__ import annotations

import math
import threading

import pytest
from transformers import AutoTokenizer

from asyncllm import InvalidRequestError, LoRARequest, SamplingParams
from asyncllm.integrations.sync import SyncEngine
from classifier_utils import hf_classifier_logits, tiny_classifier
from lora_utils import make_adapter

SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama: str):
    engine = SyncEngine(tiny_llama, enable_lora=True, max_loras=1, disable_log_stats=True)
    yield engine
    engine.close()


def test_get_tokenizer_and_default_sampling_params_start_the_engine(engine: SyncEngine, tiny_llama: str) -> None:
    tokenizer = engine.get_tokenizer()
    assert engine.engine.started and tokenizer is engine.engine.tokenizer
    assert tokenizer("import os").input_ids == AutoTokenizer.from_pretrained(tiny_llama)("import os").input_ids
    assert engine.default_sampling_params() == engine.engine.default_sampling_params()


def test_chat_takes_vllms_sampling_params(engine: SyncEngine) -> None:
    deltas = list(engine.chat([{"role": "user", "content": "hi"}], sampling_params=SHORT))
    assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].finish_reason == "length"


def test_abort_from_another_thread_ends_that_stream_only(engine: SyncEngine) -> None:
    stream = engine.stream("def main():", LONG, request_id="sync-victim")
    deltas = [next(stream)]
    aborter = threading.Thread(target=engine.abort, args=(["sync-victim", "unknown"],))
    aborter.start()
    aborter.join()
    deltas += list(stream)
    assert deltas[-1].finish_reason == "abort" and sum(len(d.token_ids) for d in deltas) < 400
    assert len(engine.generate("import os", SHORT).token_ids) == 5  # the engine serves on
    engine.abort("sync-victim")  # finished: a no-op


def test_add_and_remove_lora(engine: SyncEngine, tiny_llama: str, tmp_path) -> None:
    lora = LoRARequest("sync-adapter", 7, make_adapter(tiny_llama, str(tmp_path / "adapter"), seed=5))
    base = engine.generate([3, 4, 5, 6], SHORT).token_ids
    engine.add_lora(lora)
    assert engine.generate([3, 4, 5, 6], SHORT, lora_request=lora).token_ids != base  # the adapter changes them
    assert engine.remove_lora(7) is True
    assert engine.remove_lora(7) is False  # unknown now, as vLLM's
    with pytest.raises(InvalidRequestError) as info:
        engine.add_lora(LoRARequest("missing", 8, str(tmp_path / "nothing")))
    assert info.value.field.startswith("lora")


def test_classify_and_score_equal_transformers(tiny_qwen3: str, tmp_path_factory) -> None:
    reranker = tiny_classifier(tiny_qwen3, str(tmp_path_factory.mktemp("sync-reranker")), num_labels=1, seed=3)
    prompt = [5, 17, 42, 99, 3]
    with SyncEngine(reranker, disable_log_stats=True) as engine:
        out = engine.classify(prompt, request_id="classify-0")
        assert out.request_id == "classify-0" and out.label == "class_0"
        assert abs(out.logits[0] - hf_classifier_logits(reranker, prompt)[0]) < 1e-5
        pair = AutoTokenizer.from_pretrained(reranker)("what is up", "the sky").input_ids
        scores = engine.score("what is up", ["the sky", "nothing"])
        assert len(scores) == 2 and scores[0].prompt_token_ids == pair
        assert abs(scores[0].score - 1 / (1 + math.exp(-hf_classifier_logits(reranker, pair)[0]))) < 1e-5
        rows = engine.encode(prompt, pooling_task="token_classify", request_id="encode-0")  # vLLM's LLM.encode
        assert rows.request_id == "encode-0" and len(rows.data) == len(prompt)
        assert abs(rows.data[-1][0] - 1 / (1 + math.exp(-out.logits[0]))) < 1e-5  # the last row: classify's
