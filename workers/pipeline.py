"""`PipelineModelRunner`: the model runner of one rank of a pipeline-parallel engine (docs/parallelism.md).

World rank ``r`` is tensor-parallel rank ``r % tp`` of stage ``r // tp`` (vLLM's order). Each rank builds and
loads only its stage's parts (asyncllm/models/pipeline.py) and sizes its KV cache for its stage's layers (a
hybrid's: its attention layers); the core takes the minimum block count over all ranks, as with tensor
parallelism.

Every rank gets every step (the executor's broadcast), and the stages run it one after the other: stage 0
embeds and runs its layers, sends ``(hidden, residual)`` on, ..., the last stage runs its layers, the final
norm, the LM head and the sampler, and its first TP rank's output is the step's (`output_rank`). Then the last
stage broadcasts the sampled ids to every rank (on a process group of their own), so that each stage's
persistent rows hold the same tokens (the next step's input ids, positions and prompt-logprobs bookkeeping).

Micro-batches: a stage before the last does not wait for a step's sampled ids. It posts the broadcast's
receive and goes on to the next step (the core sends up to P steps of disjoint requests: asyncllm/sched/
placeholders.py), its sampling rows holding `PENDING_TOKEN` until the ids arrive (`_PendingIds`); a step
that reads one of those rows waits for them first. So stage 0 runs step N+1 while stage 1 runs step N.
No CUDA graph is captured (workers/cuda_graphs.py says why at start).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import torch
import torch.distributed as dist

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.models.checkpoint import served_hf_config
from asyncllm.models.loader import load_model, resolve_dtype, resolve_model_path
from asyncllm.models.pipeline import PipelineStage, StageChannel, StageModel
from asyncllm.models.registry import kv_cache_spec, text_config_of
from asyncllm.pipeline_parallel import get_pp_indices, output_rank
from asyncllm.protocol import ModelRunnerOutput, SchedulerOutput
from asyncllm.workers.input_types import StepInputs
from asyncllm.workers.model_runner import ModelRunner
from asyncllm.workers.token_feedback import PENDING_TOKEN, InFlightStep

__all__ = ["PipelineModelRunner", "make_stage_groups"]


def make_stage_groups(tp_size: int, pp_size: int) -> list[dist.ProcessGroup | None]:
    """Each stage's TP process group, stage order (every rank creates every group, in the same order); None per
    stage with one rank."""
    if tp_size == 1:
        return [None] * pp_size
    return [dist.new_group(list(range(p * tp_size, (p + 1) * tp_size))) for p in range(pp_size)]


class _PendingIds:
    """One step's sampled ids on their way from the last stage (an asynchronous broadcast), and the rows
    waiting for them (each ends with `PENDING_TOKEN`)."""

    __slots__ = ("work", "ids", "req_ids", "rows", "indices")

    def __init__(self, work: dist.Work, ids: torch.Tensor, req_ids: list[str], rows: list[list[int]]) -> None:
        self.work = work
        self.ids = ids
        self.req_ids = frozenset(req_ids)
        """The step's sampling requests: a later step with any of them waits for the ids first (a prefill chunk
        that samples nothing reads no id)."""
        self.rows = rows
        self.indices = [len(tokens) - 1 for tokens in rows]

    def resolve(self) -> None:
        """Wait for the ids and write them into the rows (a row dropped since keeps its list, unused)."""
        self.work.wait()
        for row, index, token in zip(self.rows, self.indices, self.ids.tolist()):
            row[index] = token


class PipelineModelRunner(ModelRunner):
    """A `ModelRunner` over one pipeline stage; ``rank`` and ``world_size`` are the world's (tp x pp)."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, device: torch.device) -> None:
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        assert world_size == tp_size * pp_size, (world_size, tp_size, pp_size)
        pp_rank, tp_rank = divmod(rank, tp_size)
        super().__init__(config, tp_rank, tp_size, device)
        self.world_rank = rank
        self.stage = PipelineStage(pp_rank, pp_size, 0, 0, make_stage_groups(tp_size, pp_size)[pp_rank])
        """Its layers are known once the checkpoint's config is (`load_model`)."""
        self.sampling_rank = output_rank(tp_size, pp_size)
        """The rank whose sampled ids every rank takes (the last stage's first)."""
        self.ids_group = dist.new_group(list(range(world_size)))
        """The sampled ids' broadcasts, in step order, apart from the stages' sends (a collective of every rank)."""
        self.pending: deque[_PendingIds] = deque()
        """A stage before the last: the steps whose sampled ids are still coming, oldest first."""

    def load_model(self) -> None:
        """Build and load this stage's parts; the KV cache holds its layers only."""
        hf_config = self.hf_config
        if hf_config is None:
            hf_config = served_hf_config(resolve_model_path(self.config.model, self.config.revision),
                                         self.config.hf_overrides, self.config.trust_remote_code)
        text_config = text_config_of(hf_config)
        stage = self.stage
        start, end = get_pp_indices(text_config.num_hidden_layers, stage.rank, stage.size,
                                    envs.PP_LAYER_PARTITION.get())
        stage = self.stage = dataclasses.replace(stage, start_layer=start, end_layer=end)
        dtype = resolve_dtype(self.config.dtype, hf_config, self.device, self.config.runner == "pooling")
        model = load_model(self.config, hf_config, self.device, dtype, self.rank, self.tp_size, pipeline=stage)
        tp = self.tp_size
        prev_rank = None if stage.is_first else self.world_rank - tp
        next_rank = None if stage.is_last else self.world_rank + tp
        channel = StageChannel(prev_rank, next_rank, text_config.hidden_size, dtype, self.device)
        stage_model = StageModel(model, stage, channel)
        kv_spec = stage_model.kv_spec(kv_cache_spec(hf_config, tp))
        self.attach_model(stage_model, kv_spec, dtype)
        self.hf_config = hf_config

    @torch.inference_mode()
    def launch_step(self, sched_out: SchedulerOutput, defer: bool = True) -> ModelRunnerOutput | InFlightStep:
        """Run this stage's share of the step; the last stage's output is the step's (never deferred: the stages
        before it wait for its sampled ids), the others return an empty one at once."""
        if not self.stage.is_last:
            return self._inner_stage_step(sched_out)
        output = super().launch_step(sched_out, defer=False)
        assert isinstance(output, ModelRunnerOutput)
        if sched_out.num_scheduled_tokens:  # the ids in sampling order (ascending rows)
            self._share_sampled([tokens[0] for tokens in output.sampled_token_ids if tokens])
        return output

    def _inner_stage_step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """A stage before the last: update the rows, run its layers (they send on), post the receive of the
        sampled ids."""
        if sched_out.blocks_to_swap_out or sched_out.blocks_to_swap_in:
            assert self.swap_space is not None, "a swap step without a swap space"
            self.swap_space.swap(self.kv_caches, sched_out.blocks_to_swap_out, sched_out.blocks_to_swap_in)
        batch = self.input_batch
        self._resolve_pending(sched_out.num_scheduled_tokens)
        batch.update_states(sched_out)
        if self.mm_runner is not None:
            self.mm_runner.update_states(sched_out)
        if self.prompt_embeds is not None:
            self.prompt_embeds.update_states(sched_out)
        if self.lora_runner is not None:
            self.lora_runner.update_states(sched_out)
        empty = ModelRunnerOutput(sched_out.step_id, [], [])
        if not sched_out.num_scheduled_tokens:
            return empty
        inputs = batch.prepare_inputs(sched_out)
        if self.lora_runner is not None:  # an adapter it cannot read: the last stage's rank reports it
            self.lora_runner.prepare(inputs.req_ids, sched_out.num_scheduled_tokens)
        embeds, positions = (self.mm_runner.inputs_embeds(sched_out, batch, inputs) if self.mm_runner is not None
                             else (None, inputs.positions))  # images: the first stage's embeddings, every stage's
        if self.prompt_embeds is not None and embeds is None:  # M-RoPE positions; prompts given as embeddings
            embeds = self.prompt_embeds.inputs_embeds(sched_out, batch, inputs)
        self.model(inputs.input_ids, positions, self.kv_caches, inputs.attn_metadata, embeds)
        if self.mm_runner is not None:  # rank 0's report: the executor adds it to the step's output
            empty.failed_requests = self.mm_runner.take_failed()
            empty.mm_encoder_cache_queries, empty.mm_encoder_cache_hits = self.mm_runner.take_stats()
        self._defer_sampled(inputs, sched_out)
        return empty

    def _resolve_pending(self, scheduled: dict[str, int]) -> None:
        """Write in the ids of the pending steps that have arrived, or that a step of ``scheduled`` reads."""
        kept: deque[_PendingIds] = deque()
        for pending in self.pending:
            if pending.work.is_completed() or not pending.req_ids.isdisjoint(scheduled):
                pending.resolve()
            else:
                kept.append(pending)
        self.pending = kept

    def _defer_sampled(self, inputs: StepInputs, sched_out: SchedulerOutput) -> None:
        """Advance the rows past this step and post the receive of its sampled ids, without waiting for them."""
        batch = self.input_batch
        batch.finish_step(inputs, sched_out, [])
        count = len(inputs.sample_indices)
        if count == 0:
            return
        ids = torch.empty(count, dtype=torch.int64, device=self.device)
        work = dist.broadcast(ids, self.sampling_rank, group=self.ids_group, async_op=True)
        sampling = [inputs.req_ids[i] for i in inputs.sample_indices]
        rows = [batch.requests[req_id].token_ids for req_id in sampling]
        for tokens in rows:
            tokens.append(PENDING_TOKEN)
        self.pending.append(_PendingIds(work, ids, sampling, rows))

    def _share_sampled(self, sampled: list[int]) -> None:
        """A last-stage rank's part in broadcasting the step's sampled ids (the sampling rank's) to every rank; the
        last stage's other TP ranks sampled the same ids and only take part."""
        if not sampled:
            return
        ids = torch.tensor(sampled, dtype=torch.int64, device=self.device)
        dist.broadcast(ids, self.sampling_rank, group=self.ids_group)
