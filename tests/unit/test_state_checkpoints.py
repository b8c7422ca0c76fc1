"""Prefix caching for hybrid models: the core's checkpoint slots (asyncllm/kv/state_checkpoints.py) cut hits back to
saved points, make a step's saves usable from the next step, replace the least recently used, key async saves late
and release what never gets keyed; the state layers (asyncllm/models/row_states.py) save mid-chunk the states of a
run stopped there, and a load resumes from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from asyncllm import protocol
from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.config import EngineConfig
from asyncllm.kv.state_checkpoints import StateCheckpoints
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint

BLOCK, GRID = 4, 8


@dataclass
class _Request:
    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)


def _hashes(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(count)]


def _step(new: dict[str, int] | None = None, cached: dict[str, int] | None = None,
          scheduled: dict[str, int] | None = None) -> protocol.SchedulerOutput:
    """A step admitting ``new`` (req -> tokens computed before it) and running ``cached``."""
    new, cached = new or {}, cached or {}
    return protocol.SchedulerOutput(
        step_id=0,
        new_reqs=[protocol.NewRequestData(req_id=r, token_ids=[], num_prompt_tokens=0, params=SamplingParams(),
                                          block_ids=[], num_computed_tokens=c) for r, c in new.items()],
        cached_reqs=protocol.CachedRequestData(req_ids=list(cached), num_computed_tokens=list(cached.values())),
        num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()))


def test_no_point_is_planned_inside_a_step_s_drafts() -> None:
    """A drafted decode at 14 computed tokens verifies its token 15 and three drafts (16, 17, 18): the point at 16
    is a draft's, which may be rejected, so it is not saved; without the drafts it is."""
    checkpoints = StateCheckpoints(GRID, BLOCK, num_slots=4)
    requests = {"a": _Request("a", _hashes("x", 3))}
    out = _step(cached={"a": 14}, scheduled={"a": 4})
    out.spec_token_ids = {"a": [7, 8, 9]}
    checkpoints.plan(out, requests)
    assert out.state_saves == {}
    out = _step(cached={"a": 14}, scheduled={"a": 4})
    checkpoints.plan(out, requests)
    assert out.state_saves == {"a": [[16, 0]]}


def test_saves_are_planned_at_each_point_and_hits_cut_back_to_them() -> None:
    checkpoints = StateCheckpoints(GRID, BLOCK, num_slots=4)
    a = _Request("a", _hashes("x", 5))  # 20 tokens hashed
    requests = {"a": a}
    assert checkpoints.cut_hit(a, [None] * 5) == 0  # nothing saved yet
    out = _step(new={"a": 0}, scheduled={"a": 20})
    checkpoints.plan(out, requests)
    assert out.state_saves == {"a": [[8, 0], [16, 1]]} and out.state_loads == {}
    b = _Request("b", _hashes("x", 5))  # the same prefix
    assert checkpoints.cut_hit(b, [None] * 5) == 4  # 16 tokens: the last saved point in 20
    assert checkpoints.cut_hit(b, [None] * 3) == 2  # 12 hit tokens: back to 8
    out = _step(new={"b": 8}, scheduled={"b": 13})  # admitted on that hit: computes 8 .. 21
    checkpoints.plan(out, {"b": b})
    assert out.state_loads == {"b": 0}
    assert out.state_saves == {}  # 16 is saved already


def test_a_step_cannot_hit_its_own_saves() -> None:
    checkpoints = StateCheckpoints(GRID, BLOCK, num_slots=4)
    a, b = _Request("a", _hashes("x", 2)), _Request("b", _hashes("x", 2))
    out = _step(new={"a": 0}, scheduled={"a": 9})
    assert checkpoints.cut_hit(b, [None] * 2) == 0  # b looked up in the step that saves 8: none yet
    checkpoints.plan(out, {"a": a})
    assert out.state_loads == {}
    assert checkpoints.cut_hit(b, [None] * 2) == 2  # usable from the next step


def test_a_lookup_without_admission_loads_nothing() -> None:
    checkpoints = StateCheckpoints(GRID, BLOCK, num_slots=4)
    a, b = _Request("a", _hashes("x", 2)), _Request("b", _hashes("x", 2))
    checkpoints.plan(_step(new={"a": 0}, scheduled={"a": 9}), {"a": a})
    assert checkpoints.cut_hit(b, [None] * 2) == 2
    out = _step()  # b found no blocks: not admitted
    checkpoints.plan(out, {})
    assert out.state_loads == {}


def test_least_recently_used_points_are_replaced_and_a_step_keeps_its_own() -> None:
    checkpoints = StateCheckpoints(GRID, BLOCK, num_slots=2)
    requests = {r: _Request(r, _hashes(r, 2)) for r in "abc"}
    for r in "ab":
        checkpoints.plan(_step(new={r: 0}, scheduled={r: 8}), requests)
    assert checkpoints.cut_hit(_Request("a2", _hashes("a", 2)), [None] * 2) == 2  # a's point used: b's is older
    out = _step(new={"c": 0}, scheduled={"c": 8})
    checkpoints.plan(out, requests)
    assert out.state_saves == {"c": [[8, 1]]}  # b's slot
    assert checkpoints.cut_hit(_Request("b2", _hashes("b", 2)), [None] * 2) == 0
    long = _Request("d", _hashes("d", 8))
    out = _step(new={"d": 0}, scheduled={"d": 32})
    checkpoints.plan(out, {"d": long})
    assert out.state_saves == {"d": [[8, 0], [16, 1]]}  # two slots: 24 and 32 would replace this step's saves


def test_async_saves_are_keyed_once_the_block_is_hashed_and_released_if_never() -> None:
    checkpoints = StateCheckpoints(GRID, BLOCK, num_slots=2)
    a = _Request("a", _hashes("x", 1))  # block 1 ends in a token not known yet
    out = _step(cached={"a": 7}, scheduled={"a": 1})
    checkpoints.plan(out, {"a": a})
    assert out.state_saves == {"a": [[8, 0]]}
    assert checkpoints.cut_hit(_Request("b", _hashes("x", 2)), [None] * 2) == 0  # not keyed yet
    a.block_hashes.append(b"x1")  # the token arrived
    checkpoints.plan(_step(), {})
    assert checkpoints.cut_hit(_Request("b", _hashes("x", 2)), [None] * 2) == 2
    lost = _Request("l", _hashes("y", 1))
    checkpoints.plan(_step(cached={"l": 15}, scheduled={"l": 1}), {"l": lost})  # slot 1, never keyed
    for _ in range(3):
        checkpoints.plan(_step(), {})
    assert checkpoints._free == [1]  # released
    checkpoints.reset()
    assert checkpoints.cut_hit(_Request("b", _hashes("x", 2)), [None] * 2) == 0


@pytest.mark.parametrize("arch,layer_name", [("qwen3_5", "linear_attn"), ("granitemoehybrid", "mamba"),
                                             ("lfm2", "conv")])
def test_state_layers_save_mid_chunk_and_resume_from_a_load(arch: str, layer_name: str) -> None:
    """One request's 12 tokens in one chunk on row 0 saving after 5 (slot 0) and 12 (slot 1) equal a run of the first
    5 on row 1; a run of the last 7 on row 2 loading slot 0 gives the whole run's last 7 outputs."""
    path = tiny_checkpoint(arch)
    config = EngineConfig.create(path, max_num_seqs=4, mamba_checkpoint_slots=2)
    model = load_model(config, load_hf_config(path), torch.device("cpu"), torch.float32)
    layer = getattr(next(layer for layer in model.model.layers if hasattr(layer, layer_name)), layer_name)
    hidden = torch.randn(12, load_hf_config(path).hidden_size, generator=torch.Generator().manual_seed(0))
    whole = layer(None, hidden, None, _metadata(0, 0, 12, saves=[(0, 5, 0), (0, 12, 1)]))
    layer(None, hidden[:5], None, _metadata(1, 0, 5))
    for name, tensor in layer.states.tensors.items():
        torch.testing.assert_close(layer.states.saved[name][0], tensor[1], msg=name)
        torch.testing.assert_close(layer.states.saved[name][1], tensor[0], msg=name)
    resumed = layer(None, hidden[5:], None, _metadata(2, 5, 7, loads=[(2, 0)]))
    torch.testing.assert_close(resumed, whole[5:], atol=1e-5, rtol=1e-5)
    fresh = layer(None, hidden[5:], None, _metadata(3, 5, 7))  # the same without the load
    assert not torch.allclose(fresh, whole[5:], atol=1e-3)


def _metadata(row: int, computed: int, n: int, loads=None, saves=None) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(slot_mapping=empty, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([computed + n], dtype=torch.int32), block_tables=empty,
                             query_start_loc_cpu=[0, n], seq_lens_cpu=[computed + n], block_size=BLOCK,
                             request_rows=torch.tensor([row]), request_rows_cpu=[row], state_loads=loads,
                             state_saves=saves)
