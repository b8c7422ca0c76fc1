"""`request_params_max_tokens` and the span's ``gen_ai.request.max_tokens`` on a replica whose core fitted a longer
max_model_len than the engine serves (data parallelism's least): the caller's max_tokens, as vLLM records it, not
the room the processor cut ``max_tokens`` to (`prompt_tokens.length_capped`); an unset one as vLLM fills it, the
served max_model_len less the prompt."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.metrics.tracing import tracing_available


def _max_tokens(engine: AsyncEngine) -> tuple[float, float]:
    registry, labels = engine.metrics_registry, {"model_name": engine._observer.stats.model_name, "engine": "0"}
    return tuple(registry.get_sample_value(f"asyncllm:request_params_max_tokens_{part}", labels) or 0
                 for part in ("count", "sum"))


async def _serve(engine: AsyncEngine, max_model_len: int) -> None:
    """The replica's processor serves `max_model_len`, less than its core's (another replica's fit)."""
    prompts = engine._replicas[0].processor._prompts
    engine._replicas[0].processor.serve_max_model_len(max_model_len)
    deadline = time.monotonic() + 5
    while prompts.max_model_len != max_model_len:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_longer_core_records_the_callers_max_tokens(tiny_llama: str) -> None:
    async with AsyncEngine(tiny_llama, max_model_len=128, disable_log_stats=True) as engine:
        await engine.generate([5, 6], SamplingParams(max_tokens=1))  # started
        await _serve(engine, 32)
        spans = _record_spans(engine)
        prompt = list(range(10, 20))  # 10 tokens: 22 left to the served length
        before = _max_tokens(engine)
        out = await engine.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
        assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (22, "length")
        count, total = _max_tokens(engine)
        assert (count - before[0], total - before[1]) == (1, 100)  # the caller's, not 22
        out = await engine.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 22
        assert (_max_tokens(engine)[0] - count, _max_tokens(engine)[1] - total) == (1, 22)  # served 32 - 10
        if spans is not None:
            assert [span.attributes["gen_ai.request.max_tokens"] for span in spans.get_finished_spans()] == [100, 22]


def _record_spans(engine: AsyncEngine):
    """An in-memory exporter of the replica's request spans (None without OpenTelemetry)."""
    if not tracing_available():
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = engine._replicas[0].observer._tracer
    if tracer is None:
        return None
    tracer._tracer = provider.get_tracer("test")
    return exporter
