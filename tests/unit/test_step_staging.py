"""`StepStaging` (workers/step_staging.py): a step's integer inputs in one buffer, each section aligned, none
overlapping, at the same addresses every time a layout comes back, and the padding of a decode batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm.workers.step_staging import StepStaging, pad_decode, padded_size

CPU = torch.device("cpu")
DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
          "request_rows": torch.int64, "query_start_loc": torch.int32, "seq_lens": torch.int32,
          "logits_indices": torch.int64}


@pytest.mark.parametrize("num_tokens, num_reqs", [(1, 1), (3, 3), (7, 2), (8, 8), (33, 5), (64, 16)])
def test_sections_are_aligned_apart_and_sized(num_tokens: int, num_reqs: int) -> None:
    staging = StepStaging(64, 16, CPU)
    layout = staging.layout(num_tokens, num_reqs)
    base = staging.device.data_ptr()
    sizes = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
             "request_rows": num_reqs, "query_start_loc": num_reqs + 1, "seq_lens": num_reqs}
    spans = []
    for name, tensor in layout.device.items():
        assert tensor.dtype == DTYPES[name] and layout.host[name].dtype == tensor.numpy().dtype, name
        assert (tensor.data_ptr() - base) % 16 == 0, f"{name} is not 16-byte aligned: Triton would specialize again"
        assert tensor.shape[0] == sizes.get(name, tensor.shape[0]), name
        assert layout.host[name].ctypes.data == tensor.data_ptr(), "the CPU's device tensors are the host buffer"
        spans.append((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), name))
    spans.sort()
    for (_, end, name), (start, _, after) in zip(spans, spans[1:]):
        assert end <= start, f"{name} overlaps {after}"
    assert spans[-1][2] == "logits_indices" and spans[-1][1] == base + staging.capacity * 8
    assert layout.device["logits_indices"].shape[0] >= 64  # room for a logits row per token
    assert staging.layout(num_tokens, num_reqs) is layout


def test_a_layout_has_the_same_addresses_when_it_comes_back() -> None:
    staging = StepStaging(32, 8, CPU)
    first = {name: t.data_ptr() for name, t in staging.layout(4, 4).device.items()}
    staging._layouts.clear()  # as when the table of prefill shapes is cleared
    assert {name: t.data_ptr() for name, t in staging.layout(4, 4).device.items()} == first


def test_views_cut_a_layout_to_the_step() -> None:
    staging = StepStaging(32, 8, CPU)
    layout = staging.layout(8, 8)
    layout.host["seq_lens"][:] = np.arange(8)
    views = layout.views(3, 3)
    assert views["seq_lens"].tolist() == [0, 1, 2] and views["query_start_loc"].shape[0] == 4
    assert views["input_ids"].data_ptr() == layout.device["input_ids"].data_ptr()
    assert layout.views(3, 3) is views  # steady decoding cuts the same views
    with pytest.raises(AssertionError):
        layout.views(9, 3)


def test_padding_a_decode_batch() -> None:
    staging = StepStaging(16, 8, CPU)
    layout = staging.layout(4, 4)
    host = layout.host
    for name in host:
        host[name][:] = 7
    host["query_start_loc"][:4] = [0, 1, 2, 3]
    pad_decode(host, 3)
    assert host["input_ids"].tolist() == [7, 7, 7, 0] and host["positions"].tolist() == [7, 7, 7, 0]
    assert host["slot_mapping"].tolist() == [7, 7, 7, -1] and host["request_rows"].tolist() == [7, 7, 7, 0]
    assert host["query_start_loc"].tolist() == [0, 1, 2, 3, 3] and host["seq_lens"].tolist() == [7, 7, 7, 0]
    assert padded_size(3, [1, 2, 4, 8]) == 4 and padded_size(9, [1, 2, 4, 8]) is None


def test_a_layout_past_the_capacity_is_refused() -> None:
    staging = StepStaging(16, 4, CPU)
    with pytest.raises(AssertionError):
        staging.layout(17, 4)
    with pytest.raises(AssertionError):
        staging.layout(4, 5)
