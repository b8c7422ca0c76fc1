"""`BlockTable`: the device mirror takes the host table's diffs, and steps gather their rows from it.

On the CPU the mirror is forced on (`BlockTable.MIRROR_ON_CPU`), so the diff
path (queued writes, one indexed write, growth) runs here; the fake model
reads its whole context back from the KV cache, so a wrong block id changes
the tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import test_model_runner as tmr
from test_model_runner import CPU, FAKE_SPEC, FakeModel, make_config, tiny_checkpoints  # noqa: F401

from asyncllm.workers.block_table import BlockTable
from asyncllm.workers.model_runner import ModelRunner


@pytest.fixture
def mirrored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BlockTable, "MIRROR_ON_CPU", True)


def _device_rows(table: BlockTable, rows: list[int]) -> np.ndarray:
    device = table.device
    out = torch.full((len(rows) + 2, table.max_blocks_per_req), -1, dtype=torch.int32, device=device)
    return table.gather(torch.tensor(rows, dtype=torch.int64, device=device), out)[: len(rows)].cpu().numpy()


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
def test_the_mirror_follows_random_writes(mirrored: None, device: str) -> None:
    rng = random.Random(0)
    table = BlockTable(4, 6, torch.device(device))
    assert table.device_table.data_ptr() != table.table.ctypes.data  # a separate table, updated by diffs
    for _ in range(300):
        rows = len(table.num_blocks)
        op = rng.random()
        row = rng.randrange(rows)
        if op < 0.55 and table.num_blocks[row] < 6:
            table.append(row, [rng.randrange(1, 1000) for _ in range(rng.randint(1, 6 - table.num_blocks[row]))])
        elif op < 0.85:
            table.clear(row)
        elif op < 0.88:
            table.grow(rows + 2)
        if rng.random() < 0.3:  # several writes to one cell before a flush: the last one holds
            picked = rng.sample(range(len(table.num_blocks)), 3)
            assert (_device_rows(table, picked) == table.table[picked]).all()
    table.flush()
    assert (table.device_table.cpu().numpy() == table.table).all()
    assert len(table.num_blocks) > 4  # growth was exercised


def test_a_write_after_a_clear_in_one_flush_keeps_the_last_value(mirrored: None) -> None:
    table = BlockTable(2, 4, CPU)
    table.append(0, [5, 6, 7])
    table.clear(0)
    table.append(0, [9])
    table.append(1, [3])
    assert _device_rows(table, [1, 0]).tolist() == [[3, 0, 0, 0], [9, 0, 0, 0]]


def test_without_the_mirror_the_cpu_table_is_the_host_table() -> None:
    table = BlockTable(2, 4, CPU)
    table.append(1, [4, 2])
    assert table.device_table.data_ptr() == table.table.ctypes.data and not table._pending
    assert _device_rows(table, [1]).tolist() == [[4, 2, 0, 0]]
    table.grow(4)
    table.append(3, [8])
    assert _device_rows(table, [3, 1]).tolist() == [[8, 0, 0, 0], [4, 2, 0, 0]]


@pytest.mark.parametrize("model", ["fake", "llama"])
def test_a_runner_with_a_mirrored_table_gives_the_reference_tokens(
    mirrored: None, request: pytest.FixtureRequest, tmp_path: Path, model: str
) -> None:
    """Chunked prefill, a late arrival, a preemption and its recompute: steps read the gathered device rows."""
    for scenario in (tmr.test_chunked_prefill_and_late_arrival_match_reference,
                     tmr.test_preempted_request_resumes_identically):
        if model == "fake":
            runner = ModelRunner(make_config(tmp_path), rank=0, tp_size=1, device=CPU)
            runner.attach_model(FakeModel(), FAKE_SPEC, torch.float32)
            reference = runner.model.greedy
        else:
            path, reference = request.getfixturevalue("tiny_checkpoints")["llama"]
            runner = ModelRunner(make_config(path, dtype="float32"), rank=0, tp_size=1, device=CPU)
            runner.load_model()
        runner.init_cache(80)
        scenario((runner, reference))
        table = runner.input_batch.block_table
        table.flush()
        assert table._mirrored and (table.device_table.numpy() == table.table).all()


@pytest.mark.parametrize("mirror", [True, False], ids=["mirrored", "host-table"])
def test_steps_gather_again_only_when_their_requests_or_the_table_changed(monkeypatch: pytest.MonkeyPatch,
                                                                         mirror: bool) -> None:
    """`InputBatch` reuses the last gathered block-table rows while the same requests run in the same order and the
    table takes no write (decode steps between block boundaries); every step's rows are the host table's."""
    from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
    from asyncllm.sampling import SamplingParams
    from asyncllm.workers.input_batch import InputBatch

    monkeypatch.setattr(BlockTable, "MIRROR_ON_CPU", mirror)
    gathers: list[list[int]] = []
    gather = BlockTable.gather
    monkeypatch.setattr(BlockTable, "gather", lambda self, rows, out: gathers.append(rows.tolist()) or
                        gather(self, rows, out))
    batch = InputBatch(max_num_reqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4, device=CPU)
    greedy = SamplingParams(temperature=0.0)
    prefill = SchedulerOutput(0, [NewRequestData("a", [1] * 3, 3, greedy, [3, 7], 0),
                                  NewRequestData("b", [2], 1, greedy, [9], 0)], CachedRequestData(),
                              {"a": 3, "b": 1}, 4)
    steps = [prefill]
    computed = {"a": 3, "b": 1}
    plan = [(["a", "b"], {}, []), (["b", "a"], {}, []), (["b", "a"], {}, []), (["b", "a"], {"b": [11]}, []),
            (["b", "a"], {}, []), (["b", "a"], {"a": [12]}, []), (["a"], {}, ["b"])]
    for step_id, (order, new_blocks, finished) in enumerate(plan, 1):
        steps.append(SchedulerOutput(step_id, [], CachedRequestData(order, [computed[r] for r in order], new_blocks),
                                     dict.fromkeys(order, 1), len(order), finished_req_ids=finished))
        for req_id in order:
            computed[req_id] += 1
    for step in steps:
        batch.update_states(step)
        inputs = batch.prepare_inputs(step)
        rows = [batch.requests[r].row for r in inputs.req_ids]
        assert (inputs.attn_metadata.block_tables.numpy() == batch.block_table.table[rows]).all(), step.step_id
        batch.finish_step(inputs, step, [5] * len(inputs.sample_indices))
    # the prefill, the reorder, b's new block, a's new block, b's end
    assert len(gathers) == 5, gathers
