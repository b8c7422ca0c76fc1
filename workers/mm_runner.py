"""The model runner's multimodal hooks: request items in, input embeddings out (asyncllm/mm/embeddings.py)."""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.mm.embeddings import EncoderOutputCache, ScheduledSpan
from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.input_batch import InputBatch, StepInputs

__all__ = ["MultiModalRunner", "is_multimodal"]


def is_multimodal(model: Any) -> bool:
    """Whether ``model`` has an encoder whose outputs go into its embeddings."""
    return callable(getattr(model, "embed_multimodal", None))


class MultiModalRunner:
    """Keeps each request's images on this rank and builds the embeddings of steps that reach them."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.cache = EncoderOutputCache(model, device)

    def update_states(self, sched_out: SchedulerOutput) -> None:
        """Forget finished and preempted requests (a resumed one comes back as new), learn new ones."""
        for req_id in sched_out.finished_req_ids:
            self.cache.remove_request(req_id)
        for req_id in sched_out.preempted_req_ids:
            self.cache.remove_request(req_id)
        for new in sched_out.new_reqs:
            if new.mm_items:
                self.cache.add_request(new.req_id, new.mm_items)

    def inputs_embeds(self, sched_out: SchedulerOutput, batch: InputBatch, inputs: StepInputs) -> torch.Tensor | None:
        """Call after `prepare_inputs` and before `finish_step` (rows still hold this step's start)."""
        if not self.cache.items:
            return None
        spans, flat_offset = [], 0
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            if req_id in self.cache.items:
                spans.append(ScheduledSpan(req_id, batch.requests[req_id].num_computed_tokens, num_tokens, flat_offset))
            flat_offset += num_tokens
        return self.cache.inputs_embeds(inputs.input_ids, spans)
