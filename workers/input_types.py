"""The data `InputBatch` (workers/input_batch.py) keeps and hands out, kept apart as vLLM's model-runner-v2
notes ask: `RequestState`, a request's persistent row, and `StepInputs`, one step's flattened inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.sampling import SamplingParams
from asyncllm.workers.logits_processors import RowLogitsParams
from asyncllm.workers.logprobs import PromptLogprobsJob
from asyncllm.workers.sampler import SamplingMetadata
from asyncllm.workers.spec_decode import DraftedRequest

__all__ = ["RequestState", "StepInputs"]


@dataclass
class RequestState:
    """What a worker remembers about one request between steps."""

    req_id: str
    row: int
    token_ids: list[int]
    """Prompt, then every output token (the worker appends what it samples)."""
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    logits_params: RowLogitsParams | None = None
    """logit_bias / min_tokens / penalty settings; None when the request has none."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepInputs:
    """The flattened, device-resident inputs of one step (views of `InputBatch` buffers)."""

    req_ids: list[str]
    """Scheduled requests, in the order of ``num_scheduled_tokens``."""
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_indices: list[int]
    """Indices into ``req_ids`` of the requests that sample a token this step."""
    logits_indices: torch.Tensor
    """[S + E] int64: the last token of each sampling request, then the E draft positions of `drafted`; empty (not
    copied) when `every_token_samples`."""
    sampling_metadata: SamplingMetadata
    """Settings of the logits rows: the sampling requests in ``sample_indices`` order, then the draft rows."""
    prompt_logprobs_jobs: list[PromptLogprobsJob] = field(default_factory=list)
    """Prompt logprobs to compute from this step's hidden states."""
    drafted: list[DraftedRequest] = field(default_factory=list)
    """The requests whose drafts this step verifies (speculative decoding; workers/spec_decode.py)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests that fail at this step, with their error: those with no allowed token left to sample
    (`LogitsProcessorsMetadata.exhausted`)."""
    graph_size: int | None = None
    """The CUDA graph capture size this decode batch is laid out padded to (`InputBatch.graph_sizes`), whose graph
    reads its tensors where they are; None for any other step."""
    exhausted_drafts: dict[int, int] = field(default_factory=dict)
    """Drafted requests (by sampling index) with no allowed token left at a row after j >= 1 drafts, by the first
    such j: they fail if their verified tokens reach that row (`exhausted_after_drafts`)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def every_token_samples(self) -> bool:
        """Every scheduled token samples, in order, and no drafts follow (a decode batch): the logits rows are the
        hidden rows, and ``logits_indices`` is left empty (not copied)."""
        return len(self.sample_indices) == self.num_tokens and not self.drafted
