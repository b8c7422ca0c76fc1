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

import numpy as np
import torch

from asyncllm.attention.metadata import CrossImages
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.embeddings import EncodeFn, EncoderOutputCache, ScheduledSpan
from asyncllm.models.layers import TensorParallel
from asyncllm.models.rotary import RotaryEmbedding
from asyncllm.models.vision_language import image_limit
from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.input_types import StepInputs
from asyncllm.workers.mm_encoder import DataParallelEncoder

__all__ = ["MRopePositions", "MultiModalRunner", "attend_limit", "encoder_cache_bytes", "is_multimodal",
           "request_states_reserve"]


def is_multimodal(model: Any) -> bool:
    """Whether ``model`` has an encoder whose outputs go into its embeddings."""
    return callable(getattr(model, "embed_multimodal", None))


def encoder_cache_bytes(config: EngineConfig) -> int:
    """The encoder cache's byte budget (``mm_encoder_cache_gb`` GiB)."""
    return int(config.mm_encoder_cache_gb * 2**30)


def request_states_reserve(model: Any, config: EngineConfig, budget: int) -> int:
    """Bytes of ``budget`` (the KV cache's, profiled) kept for the states a model allocates as its requests start
    (Mllama's cross-attention states: ``image_state_bytes`` an image): every seat of ``max_num_seqs`` holding
    `image_limit` images. `ConfigError` naming max_num_seqs when they would take over half of ``budget``."""
    per_image = getattr(model, "image_state_bytes", 0)
    if not per_image:
        return 0
    per_row = per_image * image_limit(type(model), config.multimodal_config.limit_mm_per_prompt)
    if config.max_num_seqs * per_row > budget // 2:
        raise ConfigError("max_num_seqs", config.max_num_seqs, f"at most {max(1, budget // 2 // per_row)} on this "
                          f"device: each request's cross-attention states take up to {per_row / 2**20:.0f} MB "
                          f"(limit_mm_per_prompt's images), reserved per seat out of {budget / 2**30:.1f} GiB")
    return config.max_num_seqs * per_row


def _encode_fn(model: Any, config: EngineConfig, tp: TensorParallel, device: torch.device) -> EncodeFn | None:
    """The data-parallel encoder when asked for and useful; None = every rank encodes every image."""
    if config.mm_encoder_tp_mode != "data" or tp.size == 1:
        return None
    if not getattr(model, "supports_encoder_data_parallel", False):
        raise NotBuiltError("mm_encoder_tp_mode", "data", f"data-parallel encoding for {type(model).__name__}")
    return DataParallelEncoder(model, device, tp)


def attend_limit(items: dict[str, list[Any]], spans: list[ScheduledSpan], flat: np.ndarray, num_rows: int,
                 device: torch.device) -> torch.Tensor | None:
    """``[num_rows]`` int32: the last position each query token of the step may attend to, for a step that reaches
    an item's bidirectional rows (Gemma 3's images: each row sees its whole image; `AttentionMetadata.attend_limit`),
    else None. Other tokens keep their own position (causal); ``flat`` holds the step's positions."""
    limit = None
    for span in spans:
        for item in items.get(span.req_id, ()):
            if not item.bidirectional:
                continue
            start, stop = item.offset + item.bidirectional[0], item.offset + item.bidirectional[1]
            lo, hi = max(span.start, start), min(span.start + span.length, stop)
            if lo >= hi:
                continue
            if limit is None:
                limit = np.zeros(num_rows, np.int32)
                limit[: len(flat)] = flat
            limit[span.flat_offset + lo - span.start : span.flat_offset + hi - span.start] = stop - 1
    return None if limit is None else torch.from_numpy(limit).to(device)


class MRopePositions:
    """Each image-holding request's M-RoPE positions (asyncllm/models/mrope.py), and a step's ``[axes, T]`` positions
    (3 axes; HunYuan VL's XD-RoPE 3 or 4).

    Requests without images keep ``[T]`` positions: their axes are equal, so the ordinary rope is theirs."""

    def __init__(self, model: Any, max_model_len: int | None = None) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.requests: dict[str, tuple[np.ndarray, int]] = {}
        """request id -> (its prompt's ``[axes, prompt_len]`` positions, the delta of every later token)."""
        modules = model.modules() if callable(getattr(model, "modules", None)) else ()
        self.table_rows: int | None = min((m.max_position for m in modules if isinstance(m, RotaryEmbedding)),
                                          default=None)
        """Rows of the decoder's rotary table (max(max_position_embeddings, max_model_len)): a position past it has
        no rotation (None: not known, unchecked)."""

    def add_request(self, req_id: str, num_prompt_tokens: int, items: list[Any],
                    max_tokens: int | None = None) -> str | None:
        """Lay out the request's positions; the error when its items' placeholders disagree with their grids, or when
        its positions, up to its last token's (`_last_position`), pass the rotary table (a video's time axis at a low
        frame rate): the request fails, its positions are the plain ones meanwhile."""
        try:
            table, delta = self.model.mrope_positions(num_prompt_tokens, items)
        except ValueError as exc:
            return f"mm_items: {exc}"
        if self.table_rows is not None and table.size:
            last = self._last_position(table, delta, num_prompt_tokens, max_tokens)
            if last >= self.table_rows or int(table.min()) < 0:
                return (f"mm_items: its rotary positions reach {last}, past the {self.table_rows} rows of the model's "
                        "rotary table (max_position_embeddings or max_model_len, the larger): a video's frame rate "
                        "(its fps metadata) spaces its temporal patches that far apart; give its frames at a higher "
                        "rate, or fewer max_tokens")
        self.requests[req_id] = (table, delta)
        return None

    def _last_position(self, table: np.ndarray, delta: int, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The largest position the request rotates by: its prompt's, or its last input token's, ``delta`` past its
        index (at most ``prompt + max_tokens - 1``, drafts included, within ``max_model_len``; neither known: the
        prompt's alone)."""
        ends = [end for end in (self.max_model_len, None if max_tokens is None else num_prompt_tokens + max_tokens)
                if end is not None]
        return max(int(table.max()), min(ends) - 1 + delta) if ends else int(table.max())

    def positions(self, spans: list[ScheduledSpan], flat: np.ndarray, device: torch.device) -> torch.Tensor | None:
        """The rope positions of a step whose token indices are ``flat``: None when no span has images; ``[T]``
        (``index + delta``) when none of theirs is in its prompt (decode steps: the CUDA graphs take them);
        else ``[axes, T]`` (the model's table's rows)."""
        spans = [span for span in spans if span.req_id in self.requests]
        if not spans:
            return None
        if all(flat[span.flat_offset] >= self.requests[span.req_id][0].shape[1] for span in spans):
            out = flat.copy()
            for span in spans:  # after the prompt: the three axes are equal, one shifted position
                out[span.flat_offset : span.flat_offset + span.length] += self.requests[span.req_id][1]
            return torch.from_numpy(out).to(device)
        axes = self.requests[spans[0].req_id][0].shape[0]  # 3 for M-RoPE; HunYuan VL's XD-RoPE: 3 or 4
        out = np.repeat(flat[None, :], axes, axis=0)
        for span in spans:
            table, delta = self.requests[span.req_id]
            index = flat[span.flat_offset : span.flat_offset + span.length]
            inside = index < table.shape[1]
            out[:, span.flat_offset : span.flat_offset + span.length] = np.where(
                inside, table[:, np.minimum(index, table.shape[1] - 1)], index + delta)
        return torch.from_numpy(out).to(device)

    def prompt_rows(self, spans: list[ScheduledSpan], flat: np.ndarray, num_rows: int,
                    device: torch.device) -> torch.Tensor | None:
        """``[num_rows]`` bool: the step's rows inside their request's prompt, of the requests with images; None
        when there are none (`AttentionMetadata.mm_prompt_rows`)."""
        rows = np.zeros(num_rows, bool)
        for span in spans:
            if span.req_id in self.requests:
                end = span.flat_offset + span.length
                rows[span.flat_offset : end] = flat[span.flat_offset : end] < self.requests[span.req_id][0].shape[1]
        return torch.from_numpy(rows).to(device) if rows.any() else None


class MultiModalRunner:
    """Keeps each request's images on this rank and builds the embeddings of steps that reach them."""

    def __init__(self, model: Any, device: torch.device, config: EngineConfig, tp: TensorParallel,
                 encodes: bool = True) -> None:
        self.encodes = encodes
        """False on a pipeline stage after the first: it keeps the requests' items for their positions (M-RoPE,
        bidirectional rows) but encodes nothing (the first stage's hidden states carry the images)."""
        self.cache = EncoderOutputCache(model, device, encoder_cache_bytes(config) if encodes else 0,
                                        _encode_fn(model, config, tp, device) if encodes else None)
        self._reported = (0, 0)
        """(queries, hits) already reported in a `ModelRunnerOutput`."""
        self.mrope = (MRopePositions(model, config.max_model_len) if callable(getattr(model, "mrope_positions", None))
                      else None)
        """M-RoPE models' positions (Qwen2-VL): None for the others."""
        self.routes_prompt_rows = bool(getattr(model, "mm_routes_prompt_rows", False))
        """Whether the model reads `AttentionMetadata.mm_prompt_rows` (ERNIE 4.5 VL's modality experts)."""
        self.cross_attention = bool(getattr(model, "mm_cross_attention", False))
        """An encoder-decoder model (Whisper): a request's encoder output feeds its cross-attention states, computed
        when it starts on this worker (`_encoder_outputs`), not its input embeddings."""
        self.cross_images = bool(getattr(model, "mm_cross_images", False))
        """A model whose images feed cross-attention layers (Mllama): each step lists its requests with images and
        the ones starting on this worker with their images' encoder outputs (`_cross_images`)."""
        self._starting: set[str] = set()
        """Such a model's requests new on this worker whose cross-attention states are still to be computed."""
        self._prompt_lens: dict[str, int] = {}
        """A cross-attention image model's requests' prompt lengths (which tokens see which image)."""
        self._state_rows: dict[str, int] = {}
        """A cross-attention image model's requests whose states it keeps, by worker row: freed when they finish, are
        aborted or preempted (``free_cross_images``), before the row serves another request."""

    def update_states(self, sched_out: SchedulerOutput) -> None:
        """Forget finished and preempted requests (a resumed one comes back as new; a cross-attention image model
        drops their states, and those of a request sent again as new, whose row may change), learn new ones."""
        gone = (*sched_out.finished_req_ids, *sched_out.preempted_req_ids)
        freed = [self._state_rows.pop(req_id) for req_id in (*gone, *(new.req_id for new in sched_out.new_reqs))
                 if req_id in self._state_rows]
        if freed:
            self.cache.model.free_cross_images(freed)
        for req_id in gone:
            self.cache.remove_request(req_id)
            self._starting.discard(req_id)
            self._prompt_lens.pop(req_id, None)
            if self.mrope is not None:
                self.mrope.requests.pop(req_id, None)
        for new in sched_out.new_reqs:
            if new.mm_items:
                self.cache.add_request(new.req_id, new.mm_items)
                if self.cross_attention or self.cross_images:
                    self._starting.add(new.req_id)
                    self._prompt_lens[new.req_id] = new.num_prompt_tokens
                if self.mrope is not None and (error := self.mrope.add_request(
                        new.req_id, new.num_prompt_tokens, new.mm_items, new.params.max_tokens)):
                    self.cache.failed[new.req_id] = error

    def _spans(self, sched_out: SchedulerOutput, batch: InputBatch) -> list[ScheduledSpan]:
        """The step's requests with images, where their tokens start and lie in the flat batch."""
        spans, flat_offset = [], 0
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            if req_id in self.cache.items:
                spans.append(ScheduledSpan(req_id, batch.requests[req_id].num_computed_tokens, num_tokens, flat_offset))
            flat_offset += num_tokens
        return spans

    def inputs_embeds(self, sched_out: SchedulerOutput, batch: InputBatch,
                      inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the step's input embeddings, or None when no image is reached; its rope positions: ``inputs.positions``,
        or M-RoPE's when a request with images runs: `MRopePositions.positions`). Call after `prepare_inputs` and
        before `finish_step` (rows still hold this step's start)."""
        if not self.cache.items:
            return None, inputs.positions
        if self.cross_attention:
            inputs.attn_metadata.encoder_outputs = self._encoder_outputs(sched_out, batch)
            return None, inputs.positions
        if self.cross_images:
            inputs.attn_metadata.cross_images = self._cross_images(sched_out, batch)
            return None, inputs.positions
        spans = self._spans(sched_out, batch)
        positions = None
        flat = batch.layout.host["positions"][: inputs.num_tokens]
        if self.mrope is not None:
            positions = self.mrope.positions(spans, flat, inputs.positions.device)
            if self.routes_prompt_rows:
                inputs.attn_metadata.mm_prompt_rows = self.mrope.prompt_rows(spans, flat, inputs.input_ids.shape[0],
                                                                             inputs.positions.device)
        ends = self.cache.ends
        spans = [span for span in spans if span.start < ends[span.req_id]]  # the others are past their items
        inputs.attn_metadata.attend_limit = attend_limit(self.cache.items, spans, flat, inputs.input_ids.shape[0],
                                                         inputs.positions.device)
        embeds = self.cache.inputs_embeds(inputs.input_ids, spans) if self.encodes else None
        return embeds, inputs.positions if positions is None else positions

    def _encoder_outputs(self, sched_out: SchedulerOutput, batch: InputBatch) -> list[tuple[int, torch.Tensor]] | None:
        """(worker row, encoder output) of the step's requests that start on this worker (new, or resumed after a
        preemption: their cross-attention states are computed again), whatever their first chunk (a prefix-cache
        hit starts past the audio's token)."""
        starting = [req_id for req_id in sched_out.num_scheduled_tokens if req_id in self._starting]
        if not starting:
            return None
        self._starting.difference_update(starting)
        outputs = self.cache.whole_outputs(starting, *self.cache.model.encoder_output_spec())
        return [(batch.requests[req_id].row, rows) for req_id, rows in zip(starting, outputs)
                if len(rows)]  # an output the encoder refused fails its request (`EncoderOutputCache.failed`)

    def _cross_images(self, sched_out: SchedulerOutput, batch: InputBatch) -> CrossImages:
        """The step's requests with images (row, flat span, first position) and, for those starting on this worker,
        their image items (those the model's ``mm_cross_item`` takes) with their encoder outputs."""
        spans = self._spans(sched_out, batch)
        starts = []
        model = self.cache.model
        for span in spans:
            if span.req_id not in self._starting:
                continue
            self._starting.discard(span.req_id)
            wanted = [(span.req_id, index, item) for index, item in enumerate(self.cache.items[span.req_id])
                      if model.mm_cross_item(item)]
            outputs = self.cache.read_whole(wanted, *model.encoder_output_spec())
            if span.req_id in self.cache.failed:  # an image the encoder refused: no states, until the core ends it
                continue
            row = self._state_rows[span.req_id] = batch.requests[span.req_id].row
            starts.append((row, [item for _, _, item in wanted], outputs, self._prompt_lens[span.req_id]))
        rows = [(batch.requests[s.req_id].row, s.flat_offset, s.length, s.start) for s in spans
                if s.req_id in self._state_rows]
        return CrossImages(starts, rows)

    def forget_encoder_outputs(self) -> None:
        """After new weights or a sleep: drop every cached encoder output and request (the core recomputes every
        running request, which comes back as new; its images are encoded again with the weights then served), and a
        cross-attention image model's states."""
        self.cache.clear()
        if self.cross_images:
            self.cache.model.free_cross_images(None)
            self._state_rows.clear()
        if self.mrope is not None:
            self.mrope.requests.clear()

    def take_failed(self) -> dict[str, str]:
        """The requests whose items this rank found malformed since the last call, with the error
        (`EncoderOutputCache.failed`; they ride on the step's `ModelRunnerOutput.failed_requests`)."""
        failed, self.cache.failed = self.cache.failed, {}
        return failed

    def take_stats(self) -> tuple[int, int]:
        """Encoder-cache (queries, hits) since the last call (they ride on the step's `ModelRunnerOutput`)."""
        now = (self.cache.num_queries, self.cache.num_hits)
        delta = (now[0] - self._reported[0], now[1] - self._reported[1])
        self._reported = now
        return delta
