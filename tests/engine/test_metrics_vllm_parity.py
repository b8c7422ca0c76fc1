"""Metrics counted as vLLM's V1 counts them, on a real engine: prefix-cache queries of requests that skip the cache,
an n > 1 request's samples in the request histograms, and the `model_name` label (and the OpenAI server's model name)
of a host attached to the core.

One engine for the module, started with a hub id (a hub cache made here, read offline) so that the model as named
("acme/tiny-llama") differs from the folder it resolves to, with one sequence at a time (a second sample queues)
and MEAN pooling for embeddings.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="module")

HUB_ID = "acme/tiny-llama"
_REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: str, checkpoint: str) -> None:
    """huggingface_hub's cache layout for `HUB_ID` at `_REVISION`, holding `checkpoint`'s files."""
    repo = os.path.join(root, "models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(checkpoint, os.path.join(repo, "snapshots", _REVISION))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as ref:
        ref.write(_REVISION)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    cache = str(tmp_path_factory.mktemp("hub"))
    _hub_cache(cache, tiny_llama)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_HUB_CACHE", cache)
        engine = AsyncEngine(HUB_ID, max_model_len=128, max_num_seqs=1, disable_log_stats=True,
                             pooler_config={"pooling_type": "MEAN"})  # embeddings pool every prompt row
        async with engine:
            assert engine.config.model.startswith(cache)  # resolved to the snapshot folder
            yield engine


def _value(engine: AsyncEngine, name: str) -> float | None:
    return engine.metrics_registry.get_sample_value(name, {"model_name": HUB_ID, "engine": "0"})


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_requests_that_skip_prefix_cache_reads_are_no_queries(engine: AsyncEngine) -> None:
    """vLLM's KVCacheManager records no prefix-cache query for a request that skips reading the cache."""
    prompt, other = list(range(10, 30)), list(range(40, 53))
    await engine.generate(prompt, SamplingParams(max_tokens=1))
    await _wait_for(lambda: engine.stats().num_requests_running == 0)
    queries = engine.stats().prefix_cache_queries
    hits = engine.stats().prefix_cache_hits
    out = await engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert out.outputs[0].token_ids and out.prompt_logprobs is not None
    await engine.embed(prompt)
    await engine.generate(other, SamplingParams(max_tokens=1))  # a query: the counters are the core's after it
    await _wait_for(lambda: engine.stats().prefix_cache_queries >= queries + len(other))
    assert (engine.stats().prefix_cache_queries, engine.stats().prefix_cache_hits) == (queries + len(other), hits)
    assert _value(engine, "asyncllm:prefix_cache_queries_total") == queries + len(other)


async def test_a_queued_samples_wait_is_in_no_decode_time(engine: AsyncEngine) -> None:
    """n = 2 with one sequence at a time: sample 1 waits for sample 0. vLLM observes each child request's decode
    time, its first token to its last: two observations that add up to less than the request's first to last token."""
    decode_count = _value(engine, "asyncllm:request_decode_time_seconds_count") or 0
    decode_sum = _value(engine, "asyncllm:request_decode_time_seconds_sum") or 0
    tpot_count = _value(engine, "asyncllm:request_time_per_output_token_seconds_count") or 0
    out = await engine.generate([5, 6, 7, 8], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    assert [len(sample.token_ids) for sample in out.outputs] == [6, 6]
    assert _value(engine, "asyncllm:request_decode_time_seconds_count") == decode_count + 2
    assert _value(engine, "asyncllm:request_time_per_output_token_seconds_count") == tpot_count + 2
    samples_decode = _value(engine, "asyncllm:request_decode_time_seconds_sum") - decode_sum
    assert 0 < samples_decode < out.metrics.decode_time  # the request's spans sample 1's wait


async def test_every_request_histogram_observes_each_sample_as_vllms_child_requests(engine: AsyncEngine) -> None:
    """n = 2 with one sequence at a time: sample 1 waits for sample 0. vLLM's V1 observes each child request, with
    its own stats from the parent's arrival, in every request histogram: two observations each."""
    names = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
             "request_prefill_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
             "request_generation_tokens")
    before = {name: [_value(engine, f"asyncllm:{name}_{part}") or 0 for part in ("count", "sum")] for name in names}
    out = await engine.generate([5, 6, 7, 8], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    observed = {name: (_value(engine, f"asyncllm:{name}_count") - count, _value(engine, f"asyncllm:{name}_sum") - total)
                for name, (count, total) in before.items()}
    assert {name: count for name, (count, _) in observed.items()} == dict.fromkeys(names, 2)
    assert (observed["request_prompt_tokens"][1], observed["request_generation_tokens"][1]) == (8, 12)
    metrics = out.metrics  # the request's: its first token is the first sample's, its end the last sample's
    assert metrics.e2e_latency < observed["e2e_request_latency_seconds"][1] < 2 * metrics.e2e_latency
    assert observed["time_to_first_token_seconds"][1] > 2 * metrics.time_to_first_token  # sample 1's waited


async def test_the_parent_request_step_and_cache_config_series_as_vllms(engine: AsyncEngine) -> None:
    """vLLM's ``request_params_n`` and ``request_max_num_generation_tokens`` once per request, ``request_params_max_tokens``
    per sample, ``iteration_tokens_total`` per step (prompt tokens as each sample's first token comes, generated ones),
    and ``cache_config_info`` (value 1, the cache settings as labels)."""
    names = ("request_params_n", "request_max_num_generation_tokens", "request_params_max_tokens",
             "iteration_tokens_total")
    before = {name: [_value(engine, f"asyncllm:{name}_{part}") or 0 for part in ("count", "sum")] for name in names}
    out = await engine.generate([5, 6, 7, 8], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    assert [len(sample.token_ids) for sample in out.outputs] == [6, 6]
    observed = {name: (_value(engine, f"asyncllm:{name}_count") - count, _value(engine, f"asyncllm:{name}_sum") - total)
                for name, (count, total) in before.items()}
    assert observed["request_params_n"] == (1, 2) and observed["request_max_num_generation_tokens"] == (1, 6)
    assert observed["request_params_max_tokens"] == (2, 12)
    steps, tokens = observed["iteration_tokens_total"]
    assert tokens == 2 * 4 + 12 and steps >= 6  # one sequence at a time: a step per token at least
    info = [s for f in engine.metrics_registry.collect() if f.name == "asyncllm:cache_config_info" for s in f.samples]
    assert [s.value for s in info] == [1]
    labels = info[0].labels
    assert (labels["model_name"], labels["engine"], labels["block_size"], labels["enable_prefix_caching"]) == (
        HUB_ID, "0", str(engine.config.cache_config.block_size), str(engine.config.cache_config.enable_prefix_caching))
    assert labels["num_gpu_blocks"] == str(engine.stats().num_gpu_blocks)


async def test_an_attached_host_labels_its_series_as_the_host_that_launched_the_core(engine: AsyncEngine) -> None:
    """vLLM labels with the model as given (or its served name), never the folder it resolved to."""
    guest = AsyncEngine.connect(engine._core.address, disable_log_stats=True)
    async with guest:
        await guest.generate([9, 8, 7, 6], SamplingParams(max_tokens=2, ignore_eos=True))
        assert guest._observer.stats.model_name == HUB_ID == engine._observer.stats.model_name
        labels = {"model_name": HUB_ID, "engine": "0"}
        assert guest.metrics_registry.get_sample_value("asyncllm:prompt_tokens_total", labels) == 4


async def test_an_attached_hosts_server_serves_the_model_as_the_core_launcher_named_it(engine: AsyncEngine) -> None:
    """No served model name: an attached host's OpenAI server names the model as the core's launcher did (the hub
    id), as vLLM's served name defaults to the model as given, never the folder it resolved to."""
    guest = AsyncEngine.connect(engine._core.address, disable_log_stats=True)
    before = create_app(guest, manage_engine=False)  # made before the host attached (it knows no model yet)
    async with guest:
        assert guest.config.model == engine.config.model != HUB_ID and guest.model_name == HUB_ID == engine.model_name
        after = create_app(guest, manage_engine=False)
        for app in (before, after):
            assert app.state.openai_server.model_names == [HUB_ID]
            async with asgi_client(app) as client:
                assert [card["id"] for card in (await client.get("/v1/models")).json()["data"]] == [HUB_ID]
                body = (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).json()
                assert body["model"] == HUB_ID
