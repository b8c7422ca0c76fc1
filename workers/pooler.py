"""The model runner's embedding hook: the embedding requests, and their embeddings from a step's hidden states.

An embedding request (`asyncllm.pooling`) samples one token like any other;
the step that samples it (its prompt's last token computed) also returns the
final hidden state of that token, truncated to ``dimensions`` and L2-normalized
as asked, in float32. A classification request (``task="classify"``) gets the
model's ``score`` head applied to that row instead: its logits, in float32
(asyncllm/models/classifier.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncllm.pooling import PoolingParams
from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.request_fields import RequestField

__all__ = ["Pooler"]


class Pooler:
    """Which requests of this rank want an embedding."""

    def __init__(self) -> None:
        self.requests: RequestField = RequestField("pooling")
        """Request id -> its `PoolingParams` (embedding and classification requests only)."""
        self.classifier: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The model's ``classify`` (hidden -> float32 logits) when it has a score head, set with the model."""

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
            out[req_ids[index]] = self._pool(params, selected[row]).cpu().numpy().astype("<f4").tobytes()
        return out

    def _pool(self, params: PoolingParams, hidden: torch.Tensor) -> torch.Tensor:
        if params.task == "classify":
            assert self.classifier is not None, "the host sends classification requests to classifiers only"
            return self.classifier(hidden)
        vector = hidden[: params.dimensions].float()
        return F.normalize(vector, dim=0) if params.normalize else vector
