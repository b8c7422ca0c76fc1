"""The scheduler's counters and gauges as the `SchedulerStats` the core sends its hosts with each step's outputs.

KV cache use, queue lengths, preemptions, prefix-cache and encoder-cache hits, token totals; the adapters in use
(LoRA on only) and the speculative decoding counters (asyncllm/spec/stats.py; speculative decoding on only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm import protocol

if TYPE_CHECKING:
    from asyncllm.sched.scheduler import Scheduler

__all__ = ["scheduler_stats"]


def scheduler_stats(sched: Scheduler) -> protocol.SchedulerStats:
    """`Scheduler.get_stats`: the scheduler's stats now."""
    kv = sched.kv_cache_manager
    return protocol.SchedulerStats(
        num_requests_running=len(sched.running),
        num_requests_waiting=len(sched.waiting),
        num_gpu_blocks=kv.num_gpu_blocks,
        num_used_blocks=kv.num_used_blocks,
        num_preemptions_total=sched.preemptor.num_preemptions_total,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_requests=kv.prefix_cache_requests,
        prefix_cache_hits=kv.prefix_cache_hits,
        cpu_prefix_cache_hits=kv.cpu_prefix_cache_hits,
        preempted_prefix_cache_hits=kv.preempted_prefix_cache_hits,
        prompt_tokens_total=sched.prompt_tokens_total,
        generation_tokens_total=sched.generation_tokens_total,
        num_steps_total=sched.num_steps_total,
        num_waiting_tokens=sched.waiting.num_tokens,
        num_swapped_total=sched.preemptor.num_swapped_total,
        mm_encoder_cache_queries=sched.mm_encoder_cache_queries,
        mm_encoder_cache_hits=sched.mm_encoder_cache_hits,
        **(_lora_stats(sched) if sched.max_loras else {}),
        **(_spec_stats(sched) if sched.proposer is not None else {}),
    )


def _spec_stats(sched: Scheduler) -> dict[str, Any]:
    spec = sched.spec_stats
    return {"spec_decode_num_drafts": spec.num_drafts, "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_decode_accepted_per_pos": list(spec.accepted_per_pos)}


def _lora_stats(sched: Scheduler) -> dict[str, Any]:
    """The adapters of the running and the waiting requests, by name (vLLM's lora_requests_info).

    The running ones are at most `max_num_seqs`; the queue counts its own (`RequestQueue.lora_names`), so a long
    queue costs nothing per step.
    """
    running = sorted({r.lora.lora_name for r in sched.running if r.lora is not None})
    return {"max_lora": sched.max_loras, "running_lora_adapters": running,
            "waiting_lora_adapters": sched.waiting.lora_names}
