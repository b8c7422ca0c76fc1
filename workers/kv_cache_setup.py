"""The model runner's paged KV cache: how many blocks fit (a profile step under the memory budget), their
allocation, and the CPU swap space (`KVCacheSetup`, a mixin of `ModelRunner`); `profile_step`, the largest step
the scheduler can send.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.registry import KVCacheSpec
from asyncllm.protocol import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.cuda_graphs import CudaGraphRunner, capture_decode_graphs
from asyncllm.workers.decode_warmup import warm_up_decodes
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.mm_runner import MultiModalRunner, encoder_cache_bytes, request_states_reserve
from asyncllm.workers.sampler import Sampler
from asyncllm.workers.swap import CPUSwapSpace, num_swap_blocks

if TYPE_CHECKING:
    from asyncllm.workers.draft_runner import DraftModelRunner

__all__ = ["KVCacheSetup", "profile_step"]

_PROFILE_STEP_ID = -1
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                                 frequency_penalty=0.1, logprobs=20, prompt_logprobs=20)
"""Every filter, penalty and logprobs on, so profiling measures the sampler's largest buffers
(the sort, the penalty tables, prompt-logprobs slices)."""

class KVCacheSetup:
    """Mixin of `ModelRunner`: the KV cache's size, allocation and swap space."""

    config: EngineConfig
    device: torch.device
    model: Any
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    input_batch: InputBatch
    sampler: Sampler
    kv_cache_dtype: torch.dtype | None
    kv_spec: KVCacheSpec | None
    kv_caches: list[torch.Tensor]
    swap_space: CPUSwapSpace | None
    mm_runner: MultiModalRunner | None
    cuda_graphs: CudaGraphRunner | None
    drafter: DraftModelRunner | None

    if TYPE_CHECKING:
        def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput: ...

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block on this rank: all layers, K and V (one byte per element with an fp8 cache), the
        draft model's too."""
        assert self.kv_spec is not None and self.kv_cache_dtype is not None, "load_model() first"
        draft = self.drafter.bytes_per_block if self.drafter is not None else 0
        return self.kv_spec.bytes_per_block(self.block_size, self.kv_cache_dtype) + draft

    @property
    def kv_budget_field(self) -> str:
        """What sizes this rank's KV cache: kv_cache_memory_bytes when set, else gpu_memory_utilization on a GPU and
        ASYNCLLM_CPU_KVCACHE_SPACE_GB on the CPU (which ignores gpu_memory_utilization)."""
        if self.config.kv_cache_memory_bytes is not None:
            return "kv_cache_memory_bytes"
        return "gpu_memory_utilization" if self.device.type == "cuda" else envs.CPU_KVCACHE_SPACE_GB.name

    def determine_num_available_blocks(self) -> int:
        """How many KV blocks fit this rank's memory budget (the core takes the min over ranks)."""
        value: object
        field = self.kv_budget_field
        if field == "kv_cache_memory_bytes":  # the user's size: no profile step
            budget = value = self.config.kv_cache_memory_bytes
        elif field == "gpu_memory_utilization":  # a multimodal model's encoder cache is not the KV cache's
            encoder_cache = self.mm_runner is not None and self.mm_runner.encodes
            budget = self._profile_cuda_kv_budget() - (encoder_cache_bytes(self.config) if encoder_cache else 0)
            budget -= request_states_reserve(getattr(self.model, "causal_lm", self.model), self.config, budget)
            value = self.config.gpu_memory_utilization
        else:
            value = envs.CPU_KVCACHE_SPACE_GB.get()
            budget = int(value * 2**30)
        if self.drafter is not None:  # the draft's scratch blocks for its proposals (workers/draft_runner.py)
            budget -= self.drafter.scratch_bytes
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ConfigError(field, value, f"room for at least one KV block ({self.bytes_per_block} bytes); "
                                            f"{self._budget_left(field, budget)}")
        return int(num_blocks)

    def _budget_left(self, field: str, budget: int) -> str:
        """What a budget too small for one block came from, and the advice (the CPU's and kv_cache_memory_bytes's
        budget is the setting itself, not what a profile step left)."""
        draft = " (less the draft model's scratch blocks)" if self.drafter is not None else ""
        if field == "gpu_memory_utilization":
            return (f"{budget} bytes are left after the weights and activations{draft}: raise it, or lower "
                    "max_num_batched_tokens")
        return f"it gives {budget} bytes{draft}: raise it"

    def determine_num_cpu_blocks(self) -> int:
        """KV blocks that fit in swap_space GiB of CPU memory on this rank."""
        return num_swap_blocks(self.config.swap_space, self.bytes_per_block)

    def determine_num_offload_blocks(self) -> int:
        """KV blocks of the CPU prefix-cache tier: kv_offloading_size GiB shared by the ranks, each holding its
        part of every block."""
        config = self.config
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        return num_swap_blocks(config.kv_offloading_size / ranks, self.bytes_per_block)

    def init_swap_space(self, num_cpu_blocks: int) -> None:
        """Allocate the CPU swap space (after `init_cache`: it takes the KV cache's layout)."""
        self.swap_space = CPUSwapSpace(num_cpu_blocks, self._all_kv_caches())

    def init_cache(self, num_gpu_blocks: int) -> None:
        """Allocate the paged KV cache: per layer ``[2, blocks, block_size, kv_heads, head_dim]``."""
        self.kv_caches = self._allocate_kv_caches(num_gpu_blocks)
        if self.drafter is not None:
            self.drafter.allocate(num_gpu_blocks)
        self.cuda_graphs = capture_decode_graphs(self)  # the graphs bake in the KV cache's addresses
        warm_up_decodes(self)  # graphs off: the decode batches' Triton compiles happen now, not mid-serving

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        assert self.kv_spec is not None and self.kv_cache_dtype is not None, "load_model() first"
        return self.kv_spec.allocate(num_blocks, self.block_size, self.kv_cache_dtype, self.device)

    def _all_kv_caches(self) -> list[torch.Tensor]:
        """The target's KV cache layers, then the draft model's (they share block ids: swapped together)."""
        return self.kv_caches + (self.drafter.kv_caches if self.drafter is not None else [])

    def _profile_cuda_kv_budget(self) -> int:
        """Bytes left for the KV cache after a worst-case step, under gpu_memory_utilization.

        The peak of torch's allocator during a max_num_batched_tokens step (weights,
        activations, logits, sampler) plus memory outside torch (CUDA context, cuBLAS,
        NCCL, other processes) is what the KV cache cannot have.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_cache_bytes = self.run_profile_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - profile_cache_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return int(total * self.config.gpu_memory_utilization) - peak - non_torch

    def run_profile_step(self) -> int:
        """Run the largest possible step on a temporary KV cache, then forget it.

        Leaves no request rows, no KV cache and a fresh sampler behind (unseeded
        draws start from the engine seed). Returns the temporary cache's bytes.
        """
        spec = self.config.scheduler_config.speculative
        sched_out, num_blocks = profile_step(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                                             self.block_size, spec.num_speculative_tokens if spec is not None else 0)
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)
        try:
            self.execute_model(sched_out)
        except torch.cuda.OutOfMemoryError as exc:
            raise ConfigError(
                "max_num_batched_tokens", self.max_num_batched_tokens,
                "a step size whose activations fit in GPU memory next to the weights: lower it "
                "(or max_num_seqs), or raise tensor_parallel_size",
            ) from exc
        finally:
            self.kv_caches = []
            if self.drafter is not None:
                self.drafter.kv_caches = []
            for req_id in sched_out.num_scheduled_tokens:
                self.input_batch.remove_request(req_id)
        self.sampler = Sampler(self.config.seed, self.device, self.config.logprobs_mode)
        return num_blocks * self.bytes_per_block + (self.drafter.scratch_bytes if self.drafter is not None else 0)


def profile_step(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int, num_drafts: int = 0
) -> tuple[SchedulerOutput, int]:
    """The largest step the scheduler can send: as many tokens and sampling requests as allowed, each with
    ``num_drafts`` drafts where it is long enough (speculative decoding: 1 + num_drafts logits rows each).

    Returns the step and the number of KV blocks it needs (ids 0..n-1).
    """
    num_reqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_reqs * max_model_len)
    base, extra = divmod(num_tokens, num_reqs)
    new_reqs, next_block, spec_token_ids = [], 0, {}
    for i in range(num_reqs):
        length = base + (1 if i < extra else 0)
        blocks = -(-length // block_size)
        drafts = num_drafts if length > num_drafts else 0
        if drafts:
            spec_token_ids[f"profile-{i}"] = [0] * drafts
        new_reqs.append(
            NewRequestData(
                req_id=f"profile-{i}",
                token_ids=[0] * (length - drafts),
                num_prompt_tokens=length - drafts,
                params=_PROFILE_PARAMS,
                block_ids=list(range(next_block, next_block + blocks)),
                num_computed_tokens=0,
            )
        )
        next_block += blocks
    scheduled = {new.req_id: len(new.token_ids) + len(spec_token_ids.get(new.req_id, ())) for new in new_reqs}
    step = SchedulerOutput(_PROFILE_STEP_ID, new_reqs, CachedRequestData(), scheduled, num_tokens,
                           spec_token_ids=spec_token_ids)
    return step, next_block
