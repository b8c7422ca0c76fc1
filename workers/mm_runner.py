"""The model runner's multimodal hooks: request items in, input embeddings out (asyncllm/mm/embeddings.py).

Encoder outputs are cached across requests by item hash, under
``mm_encoder_cache_gb`` (asyncllm/mm/encoder_cache.py). With
``mm_encoder_tp_mode="data"`` and more than one rank, the images a step must
encode are split across the ranks and gathered (workers/mm_encoder.py); with
"weights" every rank encodes every image with its shard of the encoder
(asyncllm/models/clip.py, asyncllm/models/llava.py).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.mm.embeddings import EncodeFn, EncoderOutputCache, ScheduledSpan
from asyncllm.models.layers import TensorParallel
from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.input_batch import InputBatch, StepInputs
from asyncllm.workers.mm_encoder import DataParallelEncoder

__all__ = ["MultiModalRunner", "encoder_cache_bytes", "is_multimodal"]


def is_multimodal(model: Any) -> bool:
    """Whether ``model`` has an encoder whose outputs go into its embeddings."""
    return callable(getattr(model, "embed_multimodal", None))


def encoder_cache_bytes(config: EngineConfig) -> int:
    """The encoder cache's byte budget (``mm_encoder_cache_gb`` GiB)."""
    return int(config.mm_encoder_cache_gb * 2**30)


def _encode_fn(model: Any, config: EngineConfig, tp: TensorParallel, device: torch.device) -> EncodeFn | None:
    """The data-parallel encoder when asked for and useful; None = every rank encodes every image."""
    if config.mm_encoder_tp_mode != "data" or tp.size == 1:
        return None
    if not getattr(model, "supports_encoder_data_parallel", False):
        raise NotBuiltError("mm_encoder_tp_mode", "data", f"data-parallel encoding for {type(model).__name__}")
    return DataParallelEncoder(model, device, tp)


class MultiModalRunner:
    """Keeps each request's images on this rank and builds the embeddings of steps that reach them."""

    def __init__(self, model: Any, device: torch.device, config: EngineConfig, tp: TensorParallel) -> None:
        self.cache = EncoderOutputCache(model, device, encoder_cache_bytes(config), _encode_fn(model, config, tp, device))
        self._reported = (0, 0)
        """(queries, hits) already reported in a `ModelRunnerOutput`."""

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

    def forget_encoder_outputs(self) -> None:
        """After new weights or a sleep: drop every cached encoder output and request (the core recomputes every
        running request, which comes back as new; its images are encoded again with the weights then served)."""
        self.cache.clear()

    def take_stats(self) -> tuple[int, int]:
        """Encoder-cache (queries, hits) since the last call (they ride on the step's `ModelRunnerOutput`)."""
        now = (self.cache.num_queries, self.cache.num_hits)
        delta = (now[0] - self._reported[0], now[1] - self._reported[1])
        self._reported = now
        return delta
