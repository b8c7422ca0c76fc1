"""The model runner's embedding hook: the embedding requests, and their embeddings from a step's hidden states.

An embedding request (`asyncllm.pooling`) samples one token like any other;
the step that samples it (its prompt's last token computed) also returns the
final hidden state of that token, truncated to ``dimensions`` and L2-normalized
as asked, in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.request_fields import RequestField

__all__ = ["Pooler"]


class Pooler:
    """Which requests of this rank want an embedding."""

    def __init__(self) -> None:
        self.requests: RequestField = RequestField("pooling")
        """Request id -> its `PoolingParams` (embedding requests only)."""

    def update_states(self, sched_out: SchedulerOutput) -> None:
        self.requests.update_states(sched_out)

    def samples_any(self, req_ids: list[str], sample_indices: list[int]) -> bool:
        """Whether an embedding request samples this step (its embedding goes out with the step's output)."""
        return bool(self.requests) and any(req_ids[i] in self.requests for i in sample_indices)

    def embeddings(self, req_ids: list[str], sample_indices: list[int], selected: torch.Tensor) -> dict[str, bytes]:
        """The embeddings of the step's sampling embedding requests; ``selected`` holds one hidden row per
        sampling request, in ``sample_indices`` order."""
        out = {}
        for row, index in enumerate(sample_indices):
            params = self.requests.get(req_ids[index])
            if params is None:
                continue
            vector = selected[row, : params.dimensions].float()
            if params.normalize:
                vector = F.normalize(vector, dim=0)
            out[req_ids[index]] = vector.cpu().numpy().astype("<f4").tobytes()
        return out
