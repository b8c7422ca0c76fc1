"""The model runner's decode-graph path, run on the CPU with recorded graphs: the triton backend's kernels in Triton's
interpreter, and `CudaGraphRunner.capture_one` replaced by a recording that replays the captured call on the tensors
it was captured with (as a replayed CUDA graph reads its inputs where they were at capture).

Greedy decode steps replay the graph with the LM head and argmax in it (`GREEDY_CAPTURE_MAX`) and give
transformers' greedy tokens; a step with a sampled request replays the forward-only graph and samples eagerly, giving
the eager runner's tokens, seed for seed; padded batches (3 requests in the graph of 4) too. With a GPU the same
runner captures real graphs (tests/unit/test_token_feedback.py, tests/kernels/test_gpu_bf16_model.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import recorded_graphs
from kernel_testing import HAS_CUDA
from model_utils import save_tiny_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.cuda_graphs import decode_graphs
from asyncllm.workers.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the CPU stand-in for graphs (with a GPU the real ones run)")

CPU = torch.device("cpu")
PROMPTS = {"a": [5, 17, 33, 2, 9], "b": [40, 41, 42, 43, 44, 45, 46], "c": [70, 71]}
NUM_DECODES = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _runner(path: str, monkeypatch: pytest.MonkeyPatch | None) -> ModelRunner:
    config = EngineConfig.create(path, max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                 device="cpu", attention_backend="triton")
    runner = ModelRunner(config, rank=0, tp_size=1, device=CPU)
    runner.load_model()
    runner.init_cache(40)
    if monkeypatch is not None:  # what capture_decode_graphs does on a GPU
        recorded_graphs.install(monkeypatch)
        runner.cuda_graphs = decode_graphs(runner)
        with torch.inference_mode():
            runner.cuda_graphs.capture(num_warmups=0)
    return runner


def _generate(runner: ModelRunner, params: dict[str, SamplingParams], decodes: list[list[str]]) -> dict[str, list[int]]:
    """Prefill every prompt in one step, then each decode step of ``decodes``; the tokens each request sampled."""
    blocks = iter(range(40))
    new = [NewRequestData(r, p, len(p), params[r], [next(blocks) for _ in range(6)], 0) for r, p in PROMPTS.items()]
    out = runner.execute_model(SchedulerOutput(0, new, CachedRequestData(), {r: len(p) for r, p in PROMPTS.items()},
                                               sum(map(len, PROMPTS.values()))))
    tokens = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids)}
    for step, order in enumerate(decodes, 1):
        computed = [len(PROMPTS[r]) + len(tokens[r]) - 1 for r in order]
        step_out = runner.execute_model(SchedulerOutput(step, [], CachedRequestData(list(order), computed, {}),
                                                        dict.fromkeys(order, 1), len(order)))
        for req_id, sampled in zip(step_out.req_ids, step_out.sampled_token_ids):
            tokens[req_id] += sampled
    return tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = str(tmp_path_factory.mktemp("llama"))
    model = save_tiny_checkpoint(path, "llama")
    model.generation_config.eos_token_id = None
    return path, model


def _hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=num_tokens)
    return ids[0, len(prompt):].tolist()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_greedy_decodes_replay_the_graph_with_the_head(checkpoint: tuple[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path, hf_model = checkpoint
    runner = _runner(path, monkeypatch)
    graphs = runner.cuda_graphs
    assert sorted(graphs.greedy_graphs) == sorted(graphs.graphs) == [1, 2, 4]
    decodes = [list(PROMPTS)] * NUM_DECODES + [["c", "a"]]  # 3 requests padded to 4; then 2, exactly a size
    tokens = _generate(runner, dict.fromkeys(PROMPTS, GREEDY), decodes)
    assert graphs.num_replays == graphs.num_greedy_replays == len(decodes)
    for req_id, prompt in PROMPTS.items():
        assert tokens[req_id] == _hf_greedy(hf_model, prompt, len(tokens[req_id])), req_id


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_sampled_request_keeps_the_step_off_the_greedy_graph(checkpoint: tuple[str, Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = checkpoint
    params = {"a": GREEDY, "b": SamplingParams(temperature=0.9, seed=7, max_tokens=16), "c": GREEDY}
    decodes = [list(PROMPTS)] * NUM_DECODES
    expected = _generate(_runner(path, None), params, decodes)  # eager
    runner = _runner(path, monkeypatch)
    assert _generate(runner, params, decodes) == expected
    assert runner.cuda_graphs.num_replays == NUM_DECODES and runner.cuda_graphs.num_greedy_replays == 0
