"""The model runner and its input batch, driven by hand-written scheduler steps.

`FakeCore` plays the scheduler: it hands out shuffled block ids, sends new
requests in full and known ones as diffs, and preempts. A tiny fake model
that reads its whole context back from the paged KV cache checks the
runner's bookkeeping exactly and fast; the real-model tests check greedy
tokens against transformers.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.config import EngineConfig
from asyncllm.models.registry import KVCacheSpec
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.model_runner import ModelRunner
from model_utils import save_tiny_checkpoint  # tests/ is on sys.path (tests/conftest.py)

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


# ------------------------------------------------------------------ helpers
class FakeCore:
    """Just enough of the scheduler to drive a runner: block ids, diffs, preemption."""

    def __init__(self, runner: ModelRunner, num_blocks: int, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # scattered ids catch slot-mapping mistakes
        self.tokens: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.unsent: set[str] = set()
        self.preempted: list[str] = []
        self.step_id = 0

    def add(self, req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.tokens[req_id], self.num_prompt[req_id], self.params[req_id] = list(prompt), len(prompt), params
        self.computed[req_id], self.blocks[req_id] = 0, []
        self.unsent.add(req_id)

    def preempt(self, req_id: str) -> None:
        """Recompute preemption: free the blocks; the request is re-sent in full later."""
        self.free_blocks.extend(self.blocks[req_id])
        self.blocks[req_id], self.computed[req_id] = [], 0
        self.unsent.add(req_id)
        self.preempted.append(req_id)

    def step(self, num_scheduled: dict[str, int]) -> dict[str, list[int]]:
        new_reqs, cached_reqs = [], CachedRequestData()
        for req_id, num in num_scheduled.items():
            new_blocks = self._allocate(req_id, self.computed[req_id] + num)
            if req_id in self.unsent:
                self.unsent.discard(req_id)
                new_reqs.append(NewRequestData(req_id, list(self.tokens[req_id]), self.num_prompt[req_id],
                                               self.params[req_id], list(self.blocks[req_id]), self.computed[req_id]))
            else:
                cached_reqs.req_ids.append(req_id)
                cached_reqs.num_computed_tokens.append(self.computed[req_id])
                if new_blocks:
                    cached_reqs.new_block_ids[req_id] = new_blocks
        sched_out = SchedulerOutput(self.step_id, new_reqs, cached_reqs, dict(num_scheduled),
                                    sum(num_scheduled.values()), preempted_req_ids=self.preempted)
        self.step_id, self.preempted = self.step_id + 1, []
        out = self.runner.execute_model(sched_out)
        assert out.req_ids == list(num_scheduled)
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            self.computed[req_id] += num_scheduled[req_id]
            expect_sample = self.computed[req_id] == len(self.tokens[req_id])
            assert len(sampled) == (1 if expect_sample else 0), (req_id, sampled)
            self.tokens[req_id] += sampled
        return dict(zip(out.req_ids, out.sampled_token_ids))

    def _allocate(self, req_id: str, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(self.blocks[req_id])
        new = [self.free_blocks.pop() for _ in range(max(needed, 0))]
        self.blocks[req_id] += new
        return new

    def outputs(self, req_id: str) -> list[int]:
        return self.tokens[req_id][self.num_prompt[req_id]:]

    def decode(self, req_ids: list[str], num_steps: int) -> None:
        for _ in range(num_steps):
            self.step({req_id: 1 for req_id in req_ids})


class FakeModel(torch.nn.Module):
    """One "layer" whose output at position p is a position-weighted sum of the context.

    Keys are written through ``slot_mapping`` and read back through
    ``block_tables``/``seq_lens``, so any bookkeeping error changes the tokens.
    """

    def __init__(self, vocab_size: int = 40, hidden: int = 16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(vocab_size, hidden, generator=gen)
        self.lm_head = torch.randn(hidden, vocab_size, generator=gen)

    def features(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed[token_ids] * torch.cos(0.3 * positions.float()).unsqueeze(1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        cache = kv_caches[0]  # [2, blocks, block_size, 1, hidden]
        flat = cache[0].view(-1, cache.shape[-1])
        flat[attn_metadata.slot_mapping] = self.features(input_ids, positions)
        bs = attn_metadata.block_size
        out = []
        for i, seq_len in enumerate(attn_metadata.seq_lens_cpu):
            start, end = attn_metadata.query_start_loc_cpu[i], attn_metadata.query_start_loc_cpu[i + 1]
            pos = torch.arange(seq_len)
            slots = attn_metadata.block_tables[i].long()[pos // bs] * bs + pos % bs
            context = flat[slots].cumsum(0)
            out.append(context[positions[start:end]])
        return torch.cat(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """The reference: the same function without any cache."""
        tokens = list(prompt)
        for _ in range(num_tokens):
            ids = torch.tensor(tokens)
            hidden = self.features(ids, torch.arange(len(tokens))).sum(0)
            tokens.append(int(self.compute_logits(hidden).argmax()))
        return tokens[len(prompt):]


FAKE_SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=16)


def make_config(model: str | Path, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = dict(max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, device="cpu")
    fields.update(overrides)
    return EngineConfig.create(str(model), **fields)


@pytest.fixture
def fake_runner(tmp_path: Path) -> ModelRunner:
    runner = ModelRunner(make_config(tmp_path), rank=0, tp_size=1, device=CPU)
    runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
    runner.init_cache(80)
    return runner


PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13], "c": [20, 21]}


# ------------------------------------------------------------------ input batch, exact
def test_prepare_inputs_flattens_the_step_exactly() -> None:
    batch = InputBatch(max_num_reqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4, device=CPU)
    first = SchedulerOutput(0, [NewRequestData("a", list(range(100, 109)), 9, GREEDY, [7, 2], 0),
                                NewRequestData("b", [50, 51], 2, GREEDY, [3], 0)],
                            CachedRequestData(), {"a": 5, "b": 2}, 7)
    batch.update_states(first)
    step = batch.prepare_inputs(first)
    assert step.input_ids.tolist() == [100, 101, 102, 103, 104, 50, 51]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert step.attn_metadata.slot_mapping.tolist() == [28, 29, 30, 31, 8, 12, 13]
    assert step.attn_metadata.query_start_loc.tolist() == [0, 5, 7]
    assert step.attn_metadata.seq_lens.tolist() == [5, 2]
    assert step.attn_metadata.block_tables.tolist() == [[7, 2] + [0] * 6, [3] + [0] * 7]
    assert step.sample_indices == [1] and step.logits_indices.tolist() == [6]
    batch.finish_step(step, first, [77])
    assert batch.requests["b"].token_ids == [50, 51, 77]

    second = SchedulerOutput(1, [], CachedRequestData(["b", "a"], [2, 5], {"a": [5]}), {"b": 1, "a": 4}, 5)
    batch.update_states(second)
    step = batch.prepare_inputs(second)
    assert step.input_ids.tolist() == [77, 105, 106, 107, 108]
    assert step.positions.tolist() == [2, 5, 6, 7, 8]
    assert step.attn_metadata.slot_mapping.tolist() == [14, 9, 10, 11, 20]
    assert step.attn_metadata.block_tables.tolist()[1][:3] == [7, 2, 5]
    assert step.sample_indices == [0, 1] and step.logits_indices.tolist() == [0, 4]
    assert step.sampling_metadata.random_rows is None and not step.every_token_samples
    batch.finish_step(step, second, [78, 79])

    third = SchedulerOutput(2, [], CachedRequestData(["b", "a"], [3, 9], {}), {"b": 1, "a": 1}, 2)
    batch.update_states(third)
    step = batch.prepare_inputs(third)  # a decode batch: the logits rows are the hidden rows, no index copied
    assert step.input_ids.tolist() == [78, 79] and step.positions.tolist() == [3, 9]
    assert step.sample_indices == [0, 1] and step.every_token_samples and step.logits_indices.numel() == 0


def test_dropped_rows_are_reused_and_rows_grow_past_max_num_reqs() -> None:
    batch = InputBatch(max_num_reqs=2, max_num_batched_tokens=16, max_model_len=16, block_size=4, device=CPU)
    hot = SamplingParams(temperature=0.5, top_k=3)
    new = lambda rid, blocks, params=GREEDY: NewRequestData(rid, [1, 2], 2, params, blocks, 0)  # noqa: E731
    batch.update_states(SchedulerOutput(0, [new("a", [1]), new("b", [2])], CachedRequestData(), {}, 0))
    row_of_a = batch.requests["a"].row
    batch.update_states(SchedulerOutput(1, [new("c", [3], hot)], CachedRequestData(), {}, 0, finished_req_ids=["a"]))
    assert batch.requests["c"].row == row_of_a
    assert batch.block_table.table[batch.requests["c"].row, :2].tolist() == [3, 0]
    batch.update_states(SchedulerOutput(2, [new("d", [4]), new("e", [5])], CachedRequestData(), {}, 0))
    assert sorted(s.row for s in batch.requests.values()) == [0, 1, 2, 3]
    assert batch.temperature[batch.requests["c"].row] == 0.5 and batch.top_k[batch.requests["c"].row] == 3
    assert batch.top_p.tolist() == [1.0] * 4


# ------------------------------------------------------------------ runner: fake model and real models
Reference = Callable[[list[int], int], list[int]]


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Reference]]:
    """family -> (checkpoint folder, transformers' greedy generate as the reference)."""
    out = {}
    for family in ("llama", "qwen3"):
        path = str(tmp_path_factory.mktemp(family))
        hf_model = save_tiny_checkpoint(path, family)
        hf_model.generation_config.eos_token_id = None  # compare fixed lengths: never stop early
        out[family] = (path, functools.partial(hf_greedy, hf_model))
    return out


def hf_greedy(hf_model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=num_tokens)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(params=["fake", "llama", "qwen3"])
def runner_and_reference(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ModelRunner, Reference]:
    if request.param == "fake":
        runner = ModelRunner(make_config(tmp_path), rank=0, tp_size=1, device=CPU)
        runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
        runner.init_cache(80)
        return runner, runner.model.greedy
    path, reference = request.getfixturevalue("tiny_checkpoints")[request.param]
    runner = ModelRunner(make_config(path, dtype="float32"), rank=0, tp_size=1, device=CPU)
    runner.load_model()
    runner.init_cache(80)
    return runner, reference


def test_fake_model_reference_sanity(fake_runner: ModelRunner) -> None:
    model = fake_runner.model
    assert len(set(model.greedy(PROMPTS["b"], 12))) > 3  # the tokens vary, so order errors show


def test_prefill_then_decode_matches_reference(runner_and_reference: tuple[ModelRunner, Reference]) -> None:
    runner, reference = runner_and_reference
    core = FakeCore(runner, 80)
    for req_id, prompt in PROMPTS.items():
        core.add(req_id, prompt)
    core.step({req_id: len(p) for req_id, p in PROMPTS.items()})
    core.decode(list(PROMPTS), 9)
    for req_id, prompt in PROMPTS.items():
        assert core.outputs(req_id) == reference(prompt, 10)


def test_chunked_prefill_and_late_arrival_match_reference(runner_and_reference: tuple[ModelRunner, Reference]) -> None:
    runner, reference = runner_and_reference
    core = FakeCore(runner, 80, seed=1)
    core.add("a", PROMPTS["a"])
    core.add("b", PROMPTS["b"])
    assert core.step({"a": 3, "b": 5}) == {"a": [], "b": []}
    core.step({"b": 6, "a": 4})           # a samples its first token, b still has 2 prompt tokens
    core.add("c", PROMPTS["c"])
    core.step({"a": 1, "b": 2, "c": 1})
    core.step({"c": 1, "a": 1, "b": 1})
    core.decode(["a", "b", "c"], 5)
    assert core.outputs("a") == reference(PROMPTS["a"], 8)
    assert core.outputs("b") == reference(PROMPTS["b"], 7)
    assert core.outputs("c") == reference(PROMPTS["c"], 6)


def test_preempted_request_resumes_identically(runner_and_reference: tuple[ModelRunner, Reference]) -> None:
    runner, reference = runner_and_reference
    core = FakeCore(runner, 80, seed=2)
    for req_id, prompt in PROMPTS.items():
        core.add(req_id, prompt)
    core.step({req_id: len(p) for req_id, p in PROMPTS.items()})
    core.decode(list(PROMPTS), 3)
    core.preempt("b")
    core.decode(["a", "c"], 2)            # the step that drops b's row
    known = len(core.tokens["b"])
    core.step({"b": 5, "a": 1})           # recompute prompt + outputs in two chunks
    core.step({"b": known - 5, "c": 1})
    core.decode(["a", "b", "c"], 3)
    assert core.outputs("b") == reference(PROMPTS["b"], 8)
    assert core.outputs("a") == reference(PROMPTS["a"], 10)
    assert runner.input_batch.requests["b"].num_prompt_tokens == len(PROMPTS["b"])


def test_finished_requests_are_dropped_and_empty_steps_return_nothing(fake_runner: ModelRunner) -> None:
    core = FakeCore(fake_runner, 80)
    core.add("a", PROMPTS["a"])
    core.step({"a": 7})
    out = fake_runner.execute_model(SchedulerOutput(9, [], CachedRequestData(), {}, 0, finished_req_ids=["a"]))
    assert (out.step_id, out.req_ids, out.sampled_token_ids) == (9, [], [])
    assert fake_runner.input_batch.requests == {}


def test_seeded_request_is_reproducible_across_batches_and_preemption(tmp_path: Path) -> None:
    def run(with_others: bool, preempt: bool) -> list[int]:
        runner = ModelRunner(make_config(tmp_path, seed=int(with_others)), rank=0, tp_size=1, device=CPU)
        runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
        runner.init_cache(80)
        core = FakeCore(runner, 80, seed=int(preempt))
        core.add("s", PROMPTS["a"], SamplingParams(temperature=1.5, seed=7))
        others = ["x", "y"] if with_others else []
        for req_id in others:
            core.add(req_id, PROMPTS["b"], SamplingParams(temperature=1.0))
        core.step({"s": 7, **{r: 13 for r in others}})
        core.decode(["s", *others], 4)
        if preempt:
            core.preempt("s")
            core.step({"s": len(core.tokens["s"])})  # samples a token, like the decode it replaces
        core.decode(["s", *others], 6 - int(preempt))
        return core.outputs("s")

    alone = run(with_others=False, preempt=False)
    assert len(alone) == 11 and alone != FakeModel().greedy(PROMPTS["a"], 11)
    assert run(with_others=True, preempt=False) == alone
    assert run(with_others=True, preempt=True) == alone


def test_the_sampler_takes_the_engine_s_logprobs_mode(tmp_path: Path) -> None:
    runner = ModelRunner(make_config(tmp_path, logprobs_mode="processed_logits"), rank=0, tp_size=1, device=CPU)
    assert runner.sampler.logprobs_mode == "processed_logits"
    config = EngineConfig.from_dict(make_config(tmp_path, logprobs_mode="raw_logits").to_dict(wire=True))
    assert config.logprobs_mode == "raw_logits"  # as the workers read it


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
def test_prompt_logprobs_are_log_softmax_whatever_the_logprobs_mode(tmp_path: Path, mode: str) -> None:
    """vLLM's ``_get_prompt_logprobs_dict`` log-softmaxes prompt positions under every mode, a request's own too."""
    runner = ModelRunner(make_config(tmp_path, logprobs_mode=mode), rank=0, tp_size=1, device=CPU)
    runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
    runner.init_cache(80)
    prompt = PROMPTS["a"]
    new = [NewRequestData(req_id, prompt, 7, SamplingParams(temperature=0.0, prompt_logprobs=1, logprobs_mode=own),
                          blocks, 0) for req_id, own, blocks in (("a", None, [0, 1]), ("b", mode, [2, 3]))]
    out = runner.execute_model(SchedulerOutput(0, new, CachedRequestData(), {"a": 7, "b": 7}, 14))
    model = FakeModel()
    hidden = model.features(torch.tensor(prompt), torch.arange(7)).cumsum(0)[:-1]
    expected = model.compute_logits(hidden).log_softmax(-1)[range(6), prompt[1:]]
    for req_id in "ab":
        arrays = out.prompt_logprobs[req_id]
        values = np.frombuffer(arrays.logprobs, "<f4").reshape(-1, arrays.width)[:, 0]
        np.testing.assert_allclose(values, expected.numpy(), atol=1e-5)


# ------------------------------------------------------------------ speculative decoding
def test_a_drafted_step_keeps_the_accepted_drafts_and_the_kv_stays_right(fake_runner: ModelRunner) -> None:
    """Drafts right, then wrong (its KV written, then overwritten), then all right: the tokens stay greedy's."""
    prompt = PROMPTS["a"]  # 7 tokens: blocks 0-1
    ref = FakeModel().greedy(prompt, 9)
    out = fake_runner.execute_model(SchedulerOutput(0, [NewRequestData("a", prompt, 7, GREEDY, [0, 1], 0)],
                                                    CachedRequestData(), {"a": 7}, 7))
    assert out.sampled_token_ids == [ref[:1]]

    def drafted(step_id: int, computed: int, drafts: list[int], new_blocks: list[int]) -> list[list[int]]:
        step = SchedulerOutput(step_id, [], CachedRequestData(["a"], [computed], {"a": new_blocks} if new_blocks else {}),
                               {"a": 1 + len(drafts)}, 1 + len(drafts), spec_token_ids={"a": drafts})
        return fake_runner.execute_model(step).sampled_token_ids

    wrong = [(t + 1) % 40 for t in ref]  # the fake vocabulary has 40 tokens
    assert drafted(1, 7, [ref[1], ref[2], wrong[3]], [2]) == [ref[1:4]]  # positions 7-10; the one at 10 rejected
    state = fake_runner.input_batch.requests["a"]
    assert state.token_ids == prompt + ref[:4] and state.num_computed_tokens == 10
    assert drafted(2, 10, ref[4:6], [3]) == [ref[4:7]]  # position 10 (the rejected draft's KV) is written again
    assert drafted(3, 13, wrong[7:9], []) == [ref[7:8]]
    assert state.token_ids == prompt + ref[:8] and state.num_computed_tokens == 14


def test_the_generation_rules_come_from_the_generation_config_field(tiny_checkpoints, tmp_path: Path) -> None:
    """The runner's rules read the file the engine's ``generation_config`` names (asyncllm/generation_config.py),
    not the model folder's."""
    from asyncllm.workers.generation_rules import RulesStep

    (tmp_path / "generation_config.json").write_text('{"suppress_tokens": [4, 9]}')
    config = make_config(tiny_checkpoints["llama"][0], dtype="float32", generation_config=str(tmp_path))
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    logits = torch.zeros(1, 16)
    RulesStep(runner.input_batch.generation_rules).apply(logits)
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [4, 9]
