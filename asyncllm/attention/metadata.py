"""What one forward step tells every attention layer about the batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass
class AttentionMetadata:
    """The flattened batch of one step: requests laid end to end.

    Request i owns query tokens ``query_start_loc[i]:query_start_loc[i+1]``;
    its context (cached tokens plus this step's) is ``seq_lens[i]`` tokens long,
    stored in the KV-cache blocks ``block_tables[i, :ceil(seq_lens[i]/block_size)]``.
    Token t of the step is written to KV slot ``slot_mapping[t]``
    (= block_id * block_size + offset).
    ``attend_limit[t]``, when set, is the last key position (0-based, in its sequence) token t
    may attend to: its own position for an ordinary token, the last position of its image's token
    run for an image token (Gemma 3's bidirectional image attention). A sliding window still counts
    back from the token's own position. None: causal.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    attend_limit: torch.Tensor | None = None  # [num_tokens] int32, on the device of the tensors above; None: causal
    request_rows: torch.Tensor | None = None
    """[num_reqs] int64: each request's row in the worker (kept for its life there): where a linear-attention layer
    keeps its recurrent state (asyncllm/models/gated_deltanet.py). None outside the model runner's steps."""
    request_rows_cpu: list[int] | None = None
    state_loads: list[tuple[int, int]] | None = None
    """(row, checkpoint slot): requests resuming from a prefix-cache hit, whose states start as the slot's
    (asyncllm/models/row_states.py)."""
    state_saves: list[tuple[int, int, int]] | None = None
    """(row, tokens of its chunk, checkpoint slot): where this step saves a request's states for prefix caching."""
    state_drafts: list[tuple[int, int]] | None = None
    """(row, drafts): requests whose last tokens verify that many drafts (speculative decoding): the state layers
    keep their states after each (`RowStates.rollback`)."""
    encoder_outputs: list[tuple[int, torch.Tensor]] | None = None
    """(row, its audio's ``[rows, hidden]`` encoder output) of the requests starting on this worker this step, for an
    encoder-decoder model to compute their cross-attention states from (Whisper: asyncllm/models/whisper.py)."""
    cross_images: CrossImages | None = None
    """The step's requests with images, for a model whose images feed cross-attention layers (Mllama:
    asyncllm/models/mllama.py); None when it has none or the model is another."""
    mm_prompt_rows: torch.Tensor | None = None
    """[num_tokens] bool: the step's rows inside the prompt of a request with images, for a model that routes them
    by modality (ERNIE 4.5 VL's experts: asyncllm/models/ernie4_5_vl.py), set when it asks (``mm_routes_prompt_rows``)
    and some are; None otherwise (docs/moe.md)."""
    state_positions: list | None = None
    """The state layers' plan of the step's decodes and drafted requests a position at a time, built by the first
    state layer that runs the step and read by the others (asyncllm/models/row_states.py)."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class CrossImages:
    """What a cross-attention image model needs of a step (workers/mm_runner.py builds it)."""

    starts: list[tuple[int, list[Any], list[torch.Tensor], int]]
    """(row, its image items, their encoder outputs, its prompt's length) of the requests starting on this worker:
    new, or resumed after a preemption."""
    spans: list[tuple[int, int, int, int]]
    """(row, its first token in the flat batch, its tokens, the first one's position) of each request with images."""


class RotaryInputs(NamedTuple):
    """What a backend needs to rotate q and k itself (GPT-NeoX layout), e.g. fused with the KV write.

    A model with per-head q/k RMSNorm before the rotation (Qwen3) hands over the norms' weights and
    eps too, so the backend can fuse them as well; the three go together (all None without the norm).
    """

    positions: torch.Tensor  # [T] int64: each token's position in its sequence
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] float32: cos then sin (see reference.build_cos_sin_cache)
    q_norm_weight: torch.Tensor | None = None  # [head_dim]: RMSNorm of every query head, before the rotation
    k_norm_weight: torch.Tensor | None = None  # [head_dim]: the same for every key head (values are not normed)
    norm_eps: float | None = None
