"""The model runner of one worker rank: model, paged KV cache, one step at a time.

`execute_model` applies the step's diffs to the persistent `InputBatch`,
runs the model over the flattened step, computes logits only for the
requests whose known tokens are all computed after this step, samples, and
appends the sampled tokens to the rows (the worker keeps its own copy of the
outputs, so a decode step needs no token ids from the core).

Every tensor parallel rank runs the same steps with the same inputs and the
same sampler state, so all ranks sample identical tokens; the worker main
sends rank 0's output back.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.checkpoint import served_hf_config
from asyncllm.models.loader import load_model, resolve_dtype, resolve_model_path
from asyncllm.models.registry import KVCacheSpec, kv_cache_spec, kv_cache_torch_dtype, text_config_of
from asyncllm.models.row_states import RowStates
from asyncllm.models.st_dense import load_dense_projection
from asyncllm.protocol import LogprobsArrays, ModelRunnerOutput, SchedulerOutput
from asyncllm.structured.bitmask import apply_grammar_bitmask
from asyncllm.workers.cuda_graphs import CudaGraphRunner, attention_backend_name
from asyncllm.workers.draft_runner import DraftModelRunner
from asyncllm.workers.eagle_runner import EagleRunner, MTPRunner
from asyncllm.workers.generation_rules import GenerationRules
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.input_types import StepInputs
from asyncllm.workers.kv_cache_setup import KVCacheSetup
from asyncllm.workers.logits_processors import EXHAUSTED_ERROR
from asyncllm.workers.logprobs import compute_prompt_logprobs, join_logprobs
from asyncllm.workers.lora_runner import LoRARunner
from asyncllm.workers.pooler import Pooler
from asyncllm.workers.rank_failures import host_group
from asyncllm.workers.mm_runner import MultiModalRunner, is_multimodal
from asyncllm.workers.prompt_embeds import PromptEmbedsRunner
from asyncllm.workers.sampler import Sampler, SamplerOutput
from asyncllm.workers.spec_decode import exhausted_after_drafts, verify_drafts
from asyncllm.workers.swap import CPUSwapSpace
from asyncllm.workers.token_feedback import InFlightStep

__all__ = ["ModelRunner"]

logger = logging.getLogger(__name__)


class ModelRunner(KVCacheSetup):
    """Owns the model, the KV cache, the persistent input batch and the sampler of one rank."""

    def __init__(self, config: EngineConfig, rank: int, tp_size: int, device: torch.device) -> None:
        assert config.max_model_len is not None, "the host resolves max_model_len before starting workers"
        self.config = config
        self.rank = rank
        self.tp_size = tp_size
        self.device = device
        self.block_size: int = config.block_size
        self.max_model_len: int = config.max_model_len
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens
        self.max_num_seqs: int = config.max_num_seqs
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            device=device,
        )
        self.sampler = Sampler(config.seed, device, config.logprobs_mode)
        self.model: Any = None
        self.hf_config: Any = None
        """The checkpoint's config: the host's, set by the worker before `load_model`, else read there."""
        self.dtype: torch.dtype | None = None
        self.kv_cache_dtype: torch.dtype | None = None
        """The KV cache's element type: the model dtype, or an fp8 type (kv_cache_dtype; docs/fp8-kv-cache.md)."""
        self.kv_spec: KVCacheSpec | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.swap_space: CPUSwapSpace | None = None
        """CPU copies of preempted requests' blocks (preemption_mode='swap')."""
        self.mm_runner: MultiModalRunner | None = None
        self.prompt_embeds: PromptEmbedsRunner | None = None
        """Prompts given as embeddings (enable_prompt_embeds only; workers/prompt_embeds.py)."""
        """Images and encoder outputs, for multimodal models only."""
        self.cuda_graphs: CudaGraphRunner | None = None
        """Captured decode forwards (workers/cuda_graphs.py); None when the runner stays eager."""
        self.pooler = Pooler()
        """The embedding requests (asyncllm/pooling.py)."""
        self.lora_runner: LoRARunner | None = None
        """Adapter slots and each request's adapter (enable_lora only; workers/lora_runner.py)."""
        self.drafter: DraftModelRunner | None = None
        """The draft model or EAGLE head (speculative decoding with one; workers/draft_runner.py,
        workers/eagle_runner.py)."""

    # ------------------------------------------------------------ setup
    def load_model(self) -> None:
        """Load this rank's shard of the weights onto the device."""
        hf_config = self.hf_config
        if hf_config is None:  # no config from the host (a runner built directly): read it
            hf_config = served_hf_config(resolve_model_path(self.config.model, self.config.revision),
                                         self.config.hf_overrides, self.config.trust_remote_code)
        dtype = resolve_dtype(self.config.dtype, hf_config, self.device, self.config.runner == "pooling")
        model = load_model(self.config, hf_config, self.device, dtype, self.rank, self.tp_size)
        self.attach_model(model, kv_cache_spec(hf_config, self.tp_size), dtype)
        if self.config.load_format != "dummy":  # sentence-transformers Dense modules after pooling
            path = resolve_model_path(self.config.model, self.config.revision)
            self.pooler.projection = load_dense_projection(path, self.device, dtype)
        self.hf_config = hf_config
        self.input_batch.generation_rules = GenerationRules.of(  # suppress_tokens, Whisper's timestamps
            self.config.generation_config, resolve_model_path(self.config.model, self.config.revision),
            getattr(text_config_of(hf_config), "vocab_size", None), self.device, hf_config)
        spec = self.config.scheduler_config.speculative
        if spec is not None and spec.uses_draft_model:  # a draft model, or an EAGLE head reading the target
            runner_cls = {"eagle": EagleRunner, "eagle3": EagleRunner, "mtp": MTPRunner}.get(spec.method, DraftModelRunner)
            self.drafter = runner_cls(self.config, spec, self.device)
            self.drafter.load_model(dtype, self.kv_cache_dtype, self.rank, self.tp_size)  # type: ignore[arg-type]
            if isinstance(self.drafter, EagleRunner):
                self.drafter.share_target(model, self.mm_runner)

    def attach_model(self, model: Any, kv_spec: KVCacheSpec, dtype: torch.dtype) -> None:
        """Use an already built model (`load_model` ends here; tests pass their own)."""
        self.model = model
        self.kv_spec = kv_spec
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_torch_dtype(self.config.kv_cache_dtype, dtype)
        _check_kv_cache_dtype_runs(self.config.kv_cache_dtype, self.kv_cache_dtype, self.device, model)
        tp = TensorParallel(self.rank, self.tp_size, getattr(getattr(model, "stage", None), "tp_group", None))
        core = getattr(model, "causal_lm", model)  # a pipeline stage's: the whole model's hooks, its own layers
        embeds = getattr(model, "embeds_inputs", True)  # a pipeline stage after the first takes hidden states
        self.mm_runner = MultiModalRunner(core, self.device, self.config, tp, embeds) if is_multimodal(core) else None
        self.prompt_embeds = (PromptEmbedsRunner(core, self.device, dtype)
                              if self.config.enable_prompt_embeds and embeds else None)
        self.input_batch.keeps_states = bool(getattr(model, "keeps_request_states", False))
        self.takes_token_types = bool(getattr(model, "takes_token_types", False))
        """BERT: a score pair's second text is token type 1 (read once: a module's missing attribute costs ~10 us)."""
        self.row_states = [m.states for m in model.modules() if isinstance(getattr(m, "states", None), RowStates)]
        """The state layers' per-request states (hybrids: asyncllm/models/row_states.py)."""
        snapshot_bytes = sum(t.numel() * t.element_size() for s in self.row_states for t in s.snapshots.values())
        if snapshot_bytes:
            logger.info("speculative decoding keeps %.2f GiB of recurrent-state snapshots (num_speculative_tokens "
                        "per seat of max_num_seqs): lower max_num_seqs for more KV cache", snapshot_bytes / 2**30)
        self.pooler.classifier = getattr(model, "classify", None)  # *ForSequenceClassification: its score head
        if self.config.enable_lora:
            self.lora_runner = LoRARunner(core, self.config.lora_config, dtype, self.device, host_group())

    # ------------------------------------------------------------ steps
    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; every scheduled request gets an entry ([] for a prefill chunk)."""
        result = self.launch_step(sched_out, defer=False)
        assert isinstance(result, ModelRunnerOutput)
        return result

    def finish_step(self, step: InFlightStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled ids; its output (workers/token_feedback.py)."""
        sampled = self.input_batch.feedback.resolve(step.pending)
        return self._output(step.sched_out, step.inputs, sampled, None, {})

    @torch.inference_mode()
    def launch_step(self, sched_out: SchedulerOutput, defer: bool = True) -> ModelRunnerOutput | InFlightStep:
        """Run one step up to its sampled ids; with ``defer``, return before they reach the host.

        A deferred step comes back as an `InFlightStep` (its sampled ids stay on
        the device and feed the next step's inputs): pass it to `finish_step`,
        typically after launching the next step. Steps with logprobs, prompt
        logprobs, a grammar or images are never deferred.
        """
        if sched_out.blocks_to_swap_out or sched_out.blocks_to_swap_in:
            assert self.swap_space is not None, "a swap step without a swap space"
            self.swap_space.swap(self._all_kv_caches(), sched_out.blocks_to_swap_out, sched_out.blocks_to_swap_in)
        batch = self.input_batch
        batch.update_states(sched_out)
        if batch.feedback.pending is not None and self._needs_host_tokens():
            batch.feedback.resolve(batch.feedback.pending)  # its InFlightStep's finish_step gets the same ids
        if self.mm_runner is not None:
            self.mm_runner.update_states(sched_out)
        if self.prompt_embeds is not None:
            self.prompt_embeds.update_states(sched_out)
        if self.lora_runner is not None:
            self.lora_runner.update_states(sched_out)
        self.pooler.update_states(sched_out)
        if not sched_out.num_scheduled_tokens:
            return ModelRunnerOutput(sched_out.step_id, [], [])
        inputs = batch.prepare_inputs(sched_out)
        embeds, positions = (self.mm_runner.inputs_embeds(sched_out, batch, inputs) if self.mm_runner is not None
                             else (None, inputs.positions))  # M-RoPE's [3, T] positions for Qwen2-VL
        if self.prompt_embeds is not None and embeds is None:  # (image-text models take no embedded prompts)
            embeds = self.prompt_embeds.inputs_embeds(sched_out, batch, inputs)
        extra = {} if embeds is None else {"inputs_embeds": embeds}
        if self.takes_token_types:
            extra["token_type_starts"] = self.pooler.token_type_starts(inputs.req_ids)
        failed = self.lora_runner.prepare(inputs.req_ids, sched_out.num_scheduled_tokens) if self.lora_runner else {}
        if self.mm_runner is not None:  # items whose placeholders disagree with their data: their requests fail
            failed.update(self.mm_runner.take_failed())
        failed.update(inputs.failed)  # no allowed token left to sample
        with_lora = self.lora_runner is not None and self.lora_runner.context.mask is not None
        graphs = self.cuda_graphs if embeds is None and not with_lora else None  # adapters run eagerly
        greedy = None  # the step's tokens when a graph computed them (its LM head and argmax)
        if graphs is not None and positions.dim() == 1 and graphs.can_run(inputs):  # a decode batch: replay it
            hidden, greedy = graphs.forward(inputs, positions, self._argmax_only(inputs, sched_out))
        else:
            hidden = self.model(inputs.input_ids, positions, self.kv_caches, inputs.attn_metadata, **extra)
        if self.pooler.pools_all:  # MEAN / CLS / ALL pooling: every prompt row of theirs, chunk by chunk
            self.pooler.observe(inputs.req_ids, inputs.attn_metadata.query_start_loc_cpu, hidden)
        prompt_logprobs: dict[str, LogprobsArrays] = {}
        if inputs.prompt_logprobs_jobs:
            prompt_logprobs = compute_prompt_logprobs(hidden, inputs.prompt_logprobs_jobs, self.model.compute_logits)
        sampled: list[int] = []
        sampler_out = None
        embeddings: dict[str, bytes] = {}
        if inputs.sample_indices:
            selected = hidden if inputs.every_token_samples else hidden.index_select(0, inputs.logits_indices)
            if self.pooler.samples_any(inputs.req_ids, inputs.sample_indices):
                embeddings = self.pooler.embeddings(inputs.req_ids, inputs.sample_indices, selected)
            sampler_out = SamplerOutput(greedy) if greedy is not None else self._sample(sched_out, inputs, selected)
            if defer and not failed and not embeddings and self._may_defer(sched_out, sampler_out):
                pending = batch.defer_step(inputs, sched_out, sampler_out.sampled_token_ids)
                return InFlightStep(sched_out, inputs, pending)
            sampled = sampler_out.sampled_token_ids.tolist()
        verified = None
        if inputs.drafted:  # speculative decoding: the draft rows follow the usual ones
            verified = verify_drafts(sampled, inputs.drafted)
            failed.update((inputs.req_ids[inputs.sample_indices[sample]], EXHAUSTED_ERROR)
                          for sample in exhausted_after_drafts(verified, inputs.exhausted_drafts))
            del sampled[len(inputs.sample_indices) :]
            self._roll_back_states(inputs, verified)
            self._count_penalized_outputs(inputs, verified)
        batch.finish_step(inputs, sched_out, sampled, verified)
        output = self._output(sched_out, inputs, sampled, sampler_out, prompt_logprobs, verified)
        output.failed_requests = failed
        output.embeddings = embeddings
        if self.drafter is not None:  # the draft's KV of this step's tokens, and the next step's drafts
            output.draft_token_ids = self._propose_drafts(inputs, failed, hidden, positions)
        return output

    def _sample(self, sched_out: SchedulerOutput, inputs: StepInputs, selected: torch.Tensor) -> SamplerOutput:
        """The logits of the sampling rows' hidden states, masked by the grammar where one is given, sampled."""
        logits = self.model.compute_logits(selected)
        if sched_out.grammar_bitmask is not None:  # structured output: only the grammar's tokens may be sampled
            drafted = {inputs.req_ids[inputs.sample_indices[r.sample]]: (r.first_row, len(r.drafts))
                       for r in inputs.drafted}
            apply_grammar_bitmask(logits, sched_out.grammar_bitmask,
                                  [inputs.req_ids[i] for i in inputs.sample_indices], drafted)
        return self.sampler(logits, inputs.sampling_metadata)

    @staticmethod
    def _argmax_only(inputs: StepInputs, sched_out: SchedulerOutput) -> bool:
        """Whether the step's tokens are its logits' argmax, one per scheduled token (a decode graph with the LM
        head may compute them: workers/cuda_graphs.py)."""
        return (inputs.every_token_samples and inputs.sampling_metadata.argmax_only
                and sched_out.grammar_bitmask is None and not inputs.prompt_logprobs_jobs)

    def _roll_back_states(self, inputs: StepInputs, verified: dict[int, list[int]]) -> None:
        """The state layers' rows as they were after each drafted request's accepted drafts."""
        for (row, num_drafts), request in zip(inputs.attn_metadata.state_drafts or (), inputs.drafted):
            for states in self.row_states:
                states.rollback(row, num_drafts, len(verified[request.sample]) - 1)

    def _count_penalized_outputs(self, inputs: StepInputs, verified: dict[int, list[int]]) -> None:
        """The penalty tables count a drafted request's output tokens once they are verified."""
        for request in inputs.drafted:
            state = self.input_batch.requests[inputs.req_ids[inputs.sample_indices[request.sample]]]
            if state.logits_params is not None and state.logits_params.penalized:
                self.sampler.penalty_tables.record_tokens(state.row, verified[request.sample])

    def _propose_drafts(self, inputs: StepInputs, failed: dict[str, str], hidden: torch.Tensor,
                        positions: torch.Tensor) -> dict[str, list[int]]:
        assert self.drafter is not None
        batch, req_ids = self.input_batch, inputs.req_ids
        sampled = [batch.requests[req_ids[i]] for i in inputs.sample_indices
                   if req_ids[i] not in failed and req_ids[i] not in self.pooler.requests]
        return self.drafter.step(inputs, sampled, batch, hidden, positions)  # M-RoPE's, for an image-text target

    def _may_defer(self, sched_out: SchedulerOutput, sampler_out: SamplerOutput) -> bool:
        """No logprobs, grammar, images or drafts, and no prompt logprobs row (one computed this step is still in the set)."""
        return (sampler_out.logprobs is None and sched_out.grammar_bitmask is None and not self._embeds_rows()
                and not self.input_batch.prompt_logprobs_req_ids and not sched_out.spec_token_ids
                and self.drafter is None)

    def _needs_host_tokens(self) -> bool:
        """Whether building a step reads rows' output tokens on the host (penalties, prompt logprobs, images)."""
        batch = self.input_batch
        return bool(batch.num_logits_params_rows or batch.prompt_logprobs_req_ids or self._embeds_rows())

    def _embeds_rows(self) -> bool:
        """Whether steps may pass input embeddings (images; prompts given as embeddings running)."""
        return self.mm_runner is not None or self.prompt_embeds is not None and bool(self.prompt_embeds.requests)

    def _output(self, sched_out: SchedulerOutput, inputs: StepInputs, sampled: list[int],
                sampler_out: SamplerOutput | None, prompt_logprobs: dict[str, LogprobsArrays],
                verified: dict[int, list[int]] | None = None) -> ModelRunnerOutput:
        if len(sampled) == len(inputs.req_ids):  # every request sampled (sample_indices are 0, 1, ...): a decode batch
            sampled_token_ids = [[token] for token in sampled]
        else:
            sampled_token_ids = [[] for _ in inputs.req_ids]
            for i, token in zip(inputs.sample_indices, sampled):
                sampled_token_ids[i] = [token]
        for sample, tokens in (verified or {}).items():  # a drafted request: its accepted drafts and one token
            sampled_token_ids[inputs.sample_indices[sample]] = tokens
        logprobs = _logprobs_by_request(inputs, sampler_out, verified or {}) if sampler_out is not None else {}
        output = ModelRunnerOutput(sched_out.step_id, inputs.req_ids, sampled_token_ids, logprobs, prompt_logprobs)
        if self.mm_runner is not None:
            output.mm_encoder_cache_queries, output.mm_encoder_cache_hits = self.mm_runner.take_stats()
        return output


def _check_kv_cache_dtype_runs(name: str, kv_cache_dtype: torch.dtype, device: torch.device, model: Any) -> None:
    """`ConfigError` for float8_e4m3fn under the triton backend on a GPU older than sm_89 (Ada, Hopper):
    Triton has no e4m3 conversions there (torch_sdpa and fp8_e5m2 work)."""
    if kv_cache_dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9) and attention_backend_name(model) == "triton":
        raise ConfigError(
            "kv_cache_dtype", name,
            f"'fp8_e5m2' on this GPU (sm_{capability[0]}{capability[1]}): Triton converts float8_e4m3fn only "
            "on sm_89 and newer (or use attention_backend='torch_sdpa', or a cache of the model dtype: "
            "kv_cache_dtype='bfloat16' or 'float16', its name; 'auto' is fp8 for a checkpoint that declares an fp8 "
            "KV cache)",
        )


def _logprobs_by_request(inputs: StepInputs, sampler_out: SamplerOutput,
                         verified: dict[int, list[int]]) -> dict[str, LogprobsArrays]:
    """The sampler's logprobs rows of the sampling requests, keyed by request id; a drafted request's are the rows
    of its output tokens: its draft positions' up to the first rejected one, then its last row if all were
    accepted."""
    meta = inputs.sampling_metadata.logprobs
    if meta is None or sampler_out.logprobs is None:
        return {}
    by_row = dict(zip(meta.row_indices, sampler_out.logprobs))
    num_sampling = len(inputs.sample_indices)  # rows past these are draft positions
    out = {inputs.req_ids[inputs.sample_indices[r]]: row for r, row in by_row.items() if r < num_sampling}
    for request in inputs.drafted:
        if request.sample in by_row:
            n, k = len(verified[request.sample]), len(request.drafts)
            rows = [request.first_row + j for j in range(min(n, k))] + ([request.sample] if n > k else [])
            out[inputs.req_ids[inputs.sample_indices[request.sample]]] = join_logprobs([by_row[r] for r in rows])
    return out
