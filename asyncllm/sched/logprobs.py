"""Passing the workers' logprobs (and embeddings) through the core to the hosts.

The core never looks inside `protocol.LogprobsArrays` or an embedding: it
attaches each request's arrays to that request's `RequestOutputDelta` (it only
cuts the rows of tokens it drops: `LogprobsArrays.first_rows`, structured/narrowing.py). Prompt logprobs of a
prefill chunk that samples nothing get a delta of their own (no tokens), so
the host can assemble them as the prompt is computed.
"""

from __future__ import annotations

from collections.abc import Mapping

from asyncllm import protocol
from asyncllm.sched.request import Request

__all__ = ["attach_logprobs"]


def attach_logprobs(
    outputs: list[tuple[bytes, protocol.RequestOutputDelta]],
    runner_out: protocol.ModelRunnerOutput,
    requests: Mapping[str, Request],
) -> None:
    """Attach ``runner_out``'s logprobs and embeddings to the step's deltas, adding deltas for prompt-only chunks.

    Requests that finished or were aborted since the step was scheduled get nothing.
    """
    deltas = {delta.request_id: delta for _, delta in outputs}
    for req_id, arrays in runner_out.logprobs.items():
        delta = deltas.get(req_id)
        if delta is not None:
            delta.logprobs = arrays
    for req_id, embedding in runner_out.embeddings.items():
        delta = deltas.get(req_id)
        if delta is not None:
            delta.embedding = embedding
    for req_id, arrays in runner_out.prompt_logprobs.items():
        delta = deltas.get(req_id)
        if delta is None:
            request = requests.get(req_id)
            if request is None or request.is_finished:
                continue
            delta = protocol.RequestOutputDelta(req_id, [])
            outputs.append((request.client_id, delta))
        delta.prompt_logprobs = arrays
