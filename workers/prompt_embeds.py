"""The model runner's hook for prompts given as embeddings (``enable_prompt_embeds``): their rows in place of the
token embeddings of the prompt positions a step runs (asyncllm/engine/prompt_embeds.py is the host side).

Each such request's rows stay on the device while it runs (a preempted request comes back as new, with them).
A step that reaches none runs as before (token ids, CUDA graphs); one that does passes ``inputs_embeds``: the
step's token embeddings with those rows written over them. The rows are transformers' ``get_input_embeddings()``
output; a model whose forward scales ``inputs_embeds`` (Granite's ``embedding_multiplier``, which our embedding
module applies to the token rows) scales them as they arrive, by its ``scale_prompt_embeds``.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.protocol import PromptEmbeds, SchedulerOutput
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.input_types import StepInputs

__all__ = ["PromptEmbedsRunner", "embeds_tensor"]


def embeds_tensor(embeds: PromptEmbeds) -> torch.Tensor:
    """The wire's bytes as the ``[tokens, hidden]`` tensor the host sent."""
    return torch.frombuffer(bytearray(embeds.data), dtype=getattr(torch, embeds.dtype)).view(*embeds.shape)


class PromptEmbedsRunner:
    """Keeps the running requests' prompt embeddings on this rank and builds the steps' input embeddings."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.requests: dict[str, torch.Tensor] = {}
        self.scale = getattr(model, "scale_prompt_embeds", None)
        """The model's hook for the rows as given (None: they are what its token embeddings are)."""

    def update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in (*sched_out.finished_req_ids, *sched_out.preempted_req_ids):
            self.requests.pop(req_id, None)
        for new in sched_out.new_reqs:
            if new.prompt_embeds is not None:
                rows = embeds_tensor(new.prompt_embeds).to(self.device, self.dtype)
                self.requests[new.req_id] = rows if self.scale is None else self.scale(rows)

    def inputs_embeds(self, sched_out: SchedulerOutput, batch: InputBatch, inputs: StepInputs) -> torch.Tensor | None:
        """The step's input embeddings, or None when it runs no embedded prompt row. Call after `prepare_inputs`
        and before `finish_step` (rows still hold this step's start)."""
        if not self.requests:
            return None
        pieces, flat = [], 0
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            embeds = self.requests.get(req_id)
            if embeds is not None:
                start = batch.requests[req_id].num_computed_tokens
                stop = min(start + num_tokens, embeds.shape[0])
                if start < stop:
                    pieces.append((flat, embeds[start:stop]))
            flat += num_tokens
        if not pieces:
            return None
        out = self.model.embed_input_ids(inputs.input_ids)
        for row, rows in pieces:
            out[row:row + rows.shape[0]] = rows
        return out
