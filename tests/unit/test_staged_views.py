"""`StagedBuffer.to_device` (workers/input_types.py) reuses its views while the step's length stays the same."""

from __future__ import annotations

import torch

from asyncllm.workers.input_types import StagedBuffer


def test_views_follow_the_length() -> None:
    staged = StagedBuffer((8,), torch.int64, torch.device("cpu"))
    staged.np[:5] = [1, 2, 3, 4, 5]
    assert staged.to_device(3).tolist() == [1, 2, 3]
    assert staged.to_device(3) is staged.to_device(3)  # steady decoding: no new view
    assert staged.to_device(3).data_ptr() == staged.cpu.data_ptr()  # on a CPU device: the host buffer, no copy
    assert staged.to_device(5).tolist() == [1, 2, 3, 4, 5]  # a new length: new views
    staged.np[0] = 9
    assert staged.to_device(5).tolist() == [9, 2, 3, 4, 5]  # views of the buffer: a later write shows
    assert staged.to_device(2).tolist() == [9, 2]

