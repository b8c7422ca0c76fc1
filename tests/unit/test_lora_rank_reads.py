"""An adapter folder one rank can read and another cannot: every rank fails it alike (workers/rank_failures.py).

Two gloo ranks, each a `LoRARunner` over its tensor-parallel half of a tiny Llama with the engine's own settling
group (`host_group`). A rank's reader fails for the adapters the test marks unreadable on that rank only, with the
error a rewritten folder gives (the adapter's weights replaced by bytes that are not safetensors): the folder
rewritten between the two ranks' reads, which no engine test can time. Each rank records what the step and the pin
returned and what it holds after them; the test requires every rank to hold and answer exactly the same, and the
failures to name the rank that met them.
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from lora_utils import make_adapter
from model_utils import free_port, gloo_rank, spawn_ranks

from asyncllm import InvalidRequestError, LoRARequest
from asyncllm.config import EngineConfig, LoRAConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.protocol import PinLoRA
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers import lora_runner
from asyncllm.workers.lora_runner import LoRARunner, pin_lora
from asyncllm.workers.rank_failures import host_group

WORLD = 2


def _held(runner: LoRARunner) -> dict:
    """What a rank holds: the slots, the CPU cache, the pins, the requests kept, and the step's mask."""
    mask = runner.context.mask
    return {"slots": list(runner.slots.items()), "cpu_cache": list(runner.cpu_cache), "pinned": list(runner.pinned),
            "requests": sorted(runner.requests), "mask": None if mask is None else mask.tolist()}


def _rank(rank: int, port: int, folders: dict[int, str], corrupt: str, out_dir: str) -> None:
    with gloo_rank(rank, WORLD, port, timeout_s=60):
        path = tiny_checkpoint("llama")
        model = load_model(EngineConfig.create(path, max_model_len=64, tensor_parallel_size=WORLD),
                           load_hf_config(path), torch.device("cpu"), torch.float32, rank, WORLD)
        config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8)
        runner = LoRARunner(model, config, torch.float32, torch.device("cpu"), host_group())
        loras = {lora_id: LoRARequest(f"a{lora_id}", lora_id, folder) for lora_id, folder in folders.items()}
        unreadable: set[int] = set()
        """The adapters this rank reads as the rewritten folder."""
        real_read = lora_runner.read_adapter
        ids = {folder: lora_id for lora_id, folder in folders.items()}

        def read_adapter(folder: str):
            return real_read(corrupt if ids[folder] in unreadable else folder)

        def mark(unreadable_on: dict[int, set[int]]) -> None:
            unreadable.clear()
            unreadable.update(unreadable_on.get(rank, set()))

        def step(requests: dict[str, int | None], unreadable_on: dict[int, set[int]]) -> dict:
            mark(unreadable_on)
            new = [SimpleNamespace(req_id=req_id, lora=loras.get(lora_id)) for req_id, lora_id in requests.items()
                   if req_id not in runner.requests]
            runner.update_states(SimpleNamespace(new_reqs=new, finished_req_ids=set(), preempted_req_ids=set()))
            failed = runner.prepare(list(requests), dict.fromkeys(requests, 2))
            return {"failed": failed, **_held(runner)}

        def pin(lora_id: int, unreadable_on: dict[int, set[int]]) -> dict:
            mark(unreadable_on)
            answer = pin_lora(SimpleNamespace(lora_runner=runner), PinLoRA(f"pin{lora_id}", loras[lora_id]), rank)
            return {"error_type": answer.error_type, "error": answer.error, **_held(runner)}

        record = {}
        with mock.patch.object(lora_runner, "read_adapter", read_adapter):
            record["rank1_alone"] = step({"r0": 1, "r1": None}, {1: {1}})
            record["readable_again"] = step({"r1": None, "r2": 1}, {})
            record["pin_rank0_alone"] = pin(2, {0: {2}})
            record["pin_readable"] = pin(2, {})
            record["both_ranks"] = step({"r2": 1, "r3": 3}, {0: {3}, 1: {3}})
            record["cached_needs_no_read"] = step({"r2": 1, "r4": 2}, {0: {1, 2}, 1: {1, 2}})
            mark({1: {3}})
            try:
                runner.pin(loras[3])
            except InvalidRequestError as error:
                record["pin_error"] = {"field": error.field, "message": error.message}
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], str]:
    """Three adapters of the tiny Llama, and a copy of the first whose weights are not safetensors."""
    root = tmp_path_factory.mktemp("rank_reads")
    path = tiny_checkpoint("llama")
    folders = {lora_id: make_adapter(path, str(root / f"a{lora_id}"), seed=lora_id, rank=4) for lora_id in (1, 2, 3)}
    corrupt = str(root / "rewritten")
    shutil.copytree(folders[1], corrupt)
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not safetensors")
    return folders, corrupt


@pytest.mark.slow
def test_an_adapter_one_rank_cannot_read_fails_on_every_rank(adapters, tmp_path) -> None:
    folders, corrupt = adapters
    spawn_ranks(_rank, (free_port(), folders, corrupt, str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert ranks[0] == ranks[1], "the ranks hold or answer differently"
    got = ranks[0]

    # rank 1 alone could not read adapter 1: its request fails on both ranks, which keep nothing of it; the base
    # model's request runs (no slot, so no mask)
    one = got["rank1_alone"]
    assert list(one["failed"]) == ["r0"]
    message = one["failed"]["r0"]
    assert message.startswith(f"lora_request: the workers could not load the adapter at {folders[1]} (rank 1: ")
    assert "rewritten" in message
    assert one["cpu_cache"] == [] and one["slots"] == [] and one["requests"] == [] and one["mask"] is None

    # nothing remembers the failure: the same id, readable everywhere now, is read and set on both
    again = got["readable_again"]
    assert again["failed"] == {} and again["cpu_cache"] == [1] and again["slots"] == [(1, 0)]
    assert again["mask"] == [[0.0, 0.0]] * 2 + [[1.0, 0.0]] * 2

    # a pin rank 0 alone cannot read pins nothing anywhere, and both ranks' answers name rank 0
    refused = got["pin_rank0_alone"]
    assert refused["error_type"] == "InvalidRequestError" and refused["pinned"] == [] and refused["cpu_cache"] == [1]
    assert f"could not load the adapter at {folders[2]} (rank 0: " in refused["error"]
    assert got["pin_readable"]["error_type"] == "" and got["pin_readable"]["pinned"] == [2]
    assert got["pin_readable"]["cpu_cache"] == [1, 2]

    # both ranks failed: the lowest rank's error; adapter 1 beside it runs from its slot
    both = got["both_ranks"]
    assert list(both["failed"]) == ["r3"] and "(rank 0: " in both["failed"]["r3"]
    assert both["cpu_cache"] == [1, 2] and both["requests"] == ["r2"]

    # adapters in the CPU cache or a slot read no folder, so an unreadable folder changes nothing
    cached = got["cached_needs_no_read"]
    assert cached["failed"] == {} and sorted(cached["slots"]) == [(1, 0), (2, 1)]

    # a pin outside `pin_lora` raises the settled error (on rank 0 too, which read the folder)
    assert got["pin_error"]["field"] == "lora_id" and "(rank 1: " in got["pin_error"]["message"]
