"""The model runner's sampling extras end to end on one worker: logprobs, prompt logprobs, penalties.

Driven by hand-written scheduler steps over `test_model_runner`'s fake model,
whose logits at every position have a cache-free reference: chunked prefill,
preemption and the persistent penalty tables must not change any value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from asyncllm.workers.model_runner import ModelRunner
from test_model_runner import FAKE_SPEC, FakeModel, make_config
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from asyncllm.protocol import CachedRequestData, LogprobsArrays, ModelRunnerOutput, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams

CPU = torch.device("cpu")
PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]
EOS = [21]


@pytest.fixture
def runner(tmp_path: Path) -> ModelRunner:
    runner = ModelRunner(make_config(tmp_path), rank=0, tp_size=1, device=CPU)
    runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
    runner.init_cache(80)
    return runner


def reference_logits(model: FakeModel, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position, without any cache: [len(token_ids), vocab]."""
    ids = torch.tensor(token_ids)
    return model.compute_logits(model.features(ids, torch.arange(len(ids))).cumsum(0))


def unpack(arrays: LogprobsArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.frombuffer(arrays.token_ids, "<i4").reshape(-1, arrays.width)
    return ids, np.frombuffer(arrays.logprobs, "<f4").reshape(-1, arrays.width), np.frombuffer(arrays.ranks, "<i4")


def check_rows(arrays: LogprobsArrays, logprobs: torch.Tensor, tokens: list[int]) -> None:
    """Row i of `arrays` is token tokens[i] under the distribution logprobs[i]."""
    ids, values, ranks = unpack(arrays)
    assert ids[:, 0].tolist() == tokens
    for i, token in enumerate(tokens):
        assert values[i, 0] == pytest.approx(float(logprobs[i, token]), abs=1e-5)
        assert ranks[i] == int((logprobs[i] >= logprobs[i, token]).sum())
        top = logprobs[i].topk(arrays.width - 1)
        assert ids[i, 1:].tolist() == top.indices.tolist()
        np.testing.assert_allclose(values[i, 1:], top.values.numpy(), atol=1e-5)


class Driver:
    """One request through prefill chunks, decodes and recompute preemptions."""

    def __init__(self, runner: ModelRunner, params: SamplingParams) -> None:
        self.runner, self.params = runner, params
        self.tokens, self.computed, self.step_id = list(PROMPT), 0, 0
        self.blocks: list[int] = []
        self.sent = False
        self.preempted: list[str] = []

    def step(self, num: int) -> ModelRunnerOutput:
        needed = -(-(self.computed + num) // 4) - len(self.blocks)
        new_blocks = list(range(len(self.blocks) + 10, len(self.blocks) + 10 + needed))
        self.blocks += new_blocks
        if self.sent:
            new, cached = [], CachedRequestData(["r"], [self.computed], {"r": new_blocks} if new_blocks else {})
        else:
            new = [NewRequestData("r", list(self.tokens), len(PROMPT), self.params, list(self.blocks), self.computed, EOS)]
            cached, self.sent = CachedRequestData(), True
        out = self.runner.execute_model(SchedulerOutput(self.step_id, new, cached, {"r": num}, num,
                                                        preempted_req_ids=self.preempted))
        self.step_id, self.preempted = self.step_id + 1, []
        self.computed += num
        self.tokens += out.sampled_token_ids[0]
        return out

    def preempt(self) -> None:
        self.blocks, self.computed, self.sent, self.preempted = [], 0, False, ["r"]


def test_prompt_logprobs_over_chunks_and_a_preemption(runner: ModelRunner) -> None:
    driver = Driver(runner, SamplingParams(temperature=0.0, prompt_logprobs=3, logprobs=2))
    reference = reference_logits(runner.model, PROMPT).log_softmax(-1)
    first = driver.step(5)
    assert first.prompt_logprobs["r"].start == 1 and not first.logprobs
    check_rows(first.prompt_logprobs["r"], reference[0:5], PROMPT[1:6])
    driver.preempt()  # before the first token: recomputed from 0, the same rows again
    again = driver.step(5)
    assert again.prompt_logprobs["r"] == first.prompt_logprobs["r"]
    second = driver.step(5)
    assert second.prompt_logprobs["r"].start == 6
    check_rows(second.prompt_logprobs["r"], reference[5:10], PROMPT[6:11])
    last = driver.step(3)  # positions 10..12: prompt tokens 11 and 12, then the first sampled token
    assert last.prompt_logprobs["r"].start == 11 and len(unpack(last.prompt_logprobs["r"])[2]) == 2
    check_rows(last.prompt_logprobs["r"], reference[10:12], PROMPT[11:13])
    decode = driver.step(1)
    assert not decode.prompt_logprobs and runner.input_batch.prompt_logprobs_req_ids == set()
    full = reference_logits(runner.model, driver.tokens).log_softmax(-1)
    check_rows(last.logprobs["r"], full[12:13], [driver.tokens[13]])
    check_rows(decode.logprobs["r"], full[13:14], [driver.tokens[14]])


def test_minus_one_logprobs_cover_the_whole_vocabulary(runner: ModelRunner) -> None:
    """vLLM's logprobs=-1 / prompt_logprobs=-1: every token of the vocabulary, in rank order."""
    driver = Driver(runner, SamplingParams(temperature=0.0, prompt_logprobs=-1, logprobs=-1))
    out = driver.step(len(PROMPT))
    vocab = runner.model.lm_head.shape[1]
    reference = reference_logits(runner.model, driver.tokens).log_softmax(-1)
    for arrays, rows, tokens in ((out.prompt_logprobs["r"], reference[:12], PROMPT[1:]),
                                 (out.logprobs["r"], reference[12:13], driver.tokens[13:])):
        ids, values, _ = unpack(arrays)
        assert arrays.width == vocab + 1 and ids[:, 0].tolist() == tokens
        assert all(sorted(row[1:].tolist()) == list(range(vocab)) for row in ids)
        np.testing.assert_allclose(np.sort(values[:, 1:], axis=1)[:, ::-1], rows.sort(-1, descending=True).values,
                                   atol=1e-5)


def test_penalties_and_min_tokens_survive_preemption(runner: ModelRunner) -> None:
    """Greedy with every penalty and min_tokens equals transformers' processors on the cache-free logits."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4,
                            min_tokens=6, logit_bias={EOS[0]: 100.0})  # the bias makes EOS win once allowed
    driver = Driver(runner, params)
    driver.step(len(PROMPT))
    for num_steps in range(7):
        if num_steps == 3:
            driver.preempt()
            driver.step(len(driver.tokens))
        else:
            driver.step(1)
    expected = list(PROMPT)
    for _ in range(8):
        logits = reference_logits(runner.model, expected)[-1:].clone()
        logits[0, EOS[0]] += 100.0
        outputs = expected[len(PROMPT):]
        if len(outputs) < 6:
            logits[0, EOS[0]] = float("-inf")
        logits = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([expected]), logits)[0]
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=logits.shape[0])
        logits = logits - 0.6 * counts - 0.4 * (counts > 0)
        expected.append(int(logits.argmax()))
    outputs = driver.tokens[len(PROMPT):]
    assert outputs == expected[len(PROMPT):]
    assert EOS[0] not in outputs[:6] and outputs[6] == EOS[0]
