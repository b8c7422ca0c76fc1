"""LoRA adapters on Whisper's cross-attention keys and values (asyncllm/models/whisper.py).

The step's adapter mask (`LoRAContext.mask`) has a row per decoder token; a request's cross-attention keys and
values are computed once, when it starts on the worker, from its encoder rows (``max_source_positions`` of them).
`cross_adapters` gives those rows the mask row of their request (its adapter's slot, or none) while they go through
the ``key`` / ``value`` projections' LoRA layers, as vLLM's Whisper applies the decoder's adapter to the
cross-attention's projections of the encoder output.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from asyncllm.attention.metadata import AttentionMetadata

__all__ = ["cross_adapters"]


@contextlib.contextmanager
def cross_adapters(projection: Any, metadata: AttentionMetadata, length: int) -> Iterator[None]:
    """While the starting requests' encoder rows (``metadata.encoder_outputs``, ``length`` rows each) are
    projected: the shared LoRA mask (``projection``'s LoRA layer's context) with each request's first token's row
    repeated over its encoder rows; the step's mask again after. Nothing without adapters in the step."""
    context = getattr(getattr(projection, "lora", None), "context", None)
    mask = None if context is None else context.mask
    if mask is None:
        yield
        return
    rows, starts = metadata.request_rows_cpu, metadata.query_start_loc_cpu
    assert rows is not None and metadata.encoder_outputs, "a step that starts requests lists its rows"
    firsts = [starts[rows.index(row)] for row, _ in metadata.encoder_outputs]
    context.mask = mask[firsts].repeat_interleave(length, dim=0)
    try:
        yield
    finally:
        context.mask = mask
