"""LoRA adapters end to end: greedy outputs equal PEFT's, token for token, in batches that mix adapters and the
base model, under chunked prefill, max_loras, slot eviction, the CPU cache and tensor parallelism; prefix caching
never shares KV across adapters; a bad adapter is the request's error and the engine serves on; Phi-3's fused
adapters and Gemma's (their logits, and the fused split over two ranks: tests/unit/test_lora_models.py); sleep mode
frees the adapter slots and sets every adapter again after the wake-up."""

from __future__ import annotations

import asyncio
import threading

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, LoRARequest, SamplingParams, lora_checker
from asyncllm.tiny import tiny_checkpoint
from engine_helpers import random_prompts
from hf_reference import hf_greedy
from lora_utils import make_adapter, peft_greedy

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    """Three adapters of the tiny Llama: every projection at rank 8; attention only at rank 4; MLP only, rsLoRA."""
    specs = [dict(rank=8), dict(rank=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
             dict(rank=16, alpha=4, targets=["gate_proj", "up_proj", "down_proj"], use_rslora=True)]
    return [LoRARequest(f"adapter{i}", i, make_adapter(tiny_llama, str(tmp_path_factory.mktemp(f"a{i}")), seed=i,
                                                        **spec))
            for i, spec in enumerate(specs, start=1)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora_engine(tiny_llama: str):
    """One tiny-Llama engine with adapters (async scheduling, sleep mode) shared by the tests that need no other
    settings: three adapters for two slots (max_loras=2) and two CPU-cached ones (max_cpu_loras=2)."""
    async with AsyncEngine(tiny_llama, enable_lora=True, max_loras=2, max_cpu_loras=2, max_num_batched_tokens=32,
                           enable_sleep_mode=True, disable_log_stats=True) as engine:
        yield engine


def _lora_info(engine: AsyncEngine) -> dict[str, str]:
    """The labels of the engine's asyncllm:lora_requests_info sample."""
    for family in engine.metrics_registry.collect():
        if family.name == "asyncllm:lora_requests_info":
            return dict(family.samples[0].labels) if family.samples else {}
    raise AssertionError("no asyncllm:lora_requests_info family")


def _reference(base: str, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
    return hf_greedy(base, prompt, MAX_TOKENS) if lora is None else peft_greedy(base, lora.lora_path, prompt, MAX_TOKENS)


async def test_mixed_batches_equal_peft_with_max_loras_and_slot_eviction(tiny_llama: str, lora_engine: AsyncEngine,
                                                                        adapters: list[LoRARequest]) -> None:
    """Four variants of five prompts at once: three adapters for two slots (max_loras=2), so the scheduler holds
    requests back and the workers evict slots; max_cpu_loras=2 makes them read an evicted adapter again."""
    prompts = random_prompts(5, seed=11, max_len=60)
    variants: list[LoRARequest | None] = [None, *adapters]
    outs = await asyncio.gather(*(lora_engine.generate(p, GREEDY, lora_request=v) for p in prompts for v in variants))
    got = iter(outs)
    for prompt in prompts:
        for variant in variants:
            assert next(got).token_ids == _reference(tiny_llama, variant, prompt), (variant, prompt)


async def test_a_bfloat16_adapter_on_a_float32_model_equals_peft(tiny_llama: str, lora_engine: AsyncEngine,
                                                                 tmp_path) -> None:
    """An adapter saved in bfloat16 (as PEFT saves one trained in bfloat16) on the float32 model: PEFT upcasts its
    matrices, so B is scaled (16 / 6 here) in float32, not rounded to bfloat16 first (8 of these 24 prompts' tokens
    differed from PEFT's)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = make_adapter(tiny_llama, str(tmp_path / "bf16"), seed=41, rank=6, alpha=16)
    weights = f"{path}/adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
    lora = LoRARequest("bf16", 61, path)  # an id of its own on the shared engine
    prompts = random_prompts(24, seed=7, max_len=40)
    outs = await asyncio.gather(*(lora_engine.generate(p, GREEDY, lora_request=lora) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == peft_greedy(tiny_llama, path, prompt, MAX_TOKENS), prompt


async def test_prefix_cache_hits_only_under_the_same_adapter(tiny_llama: str, lora_engine: AsyncEngine,
                                                             adapters: list[LoRARequest], tmp_path) -> None:
    prompt = random_prompts(2, seed=12, stem_len=40, max_len=45)[1]  # 43 to 45 tokens: two full blocks, unseen
    a1, a2 = adapters[:2]
    engine = lora_engine
    first = await engine.generate(prompt, GREEDY, lora_request=a1)
    again = await engine.generate(prompt, GREEDY, lora_request=a1)
    other = await engine.generate(prompt, GREEDY, lora_request=a2)
    base = await engine.generate(prompt, GREEDY)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert (other.num_cached_tokens, base.num_cached_tokens) == (0, 0)
    for out, lora in [(again, a1), (other, a2), (base, None)]:
        assert out.token_ids == _reference(tiny_llama, lora, prompt)

    # vLLM's lora_requests_info names the adapters of the running requests while they run
    stream = engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                           lora_request=a2)
    async with stream:
        async for _ in stream:
            info = _lora_info(engine)
            if info.get("running_lora_adapters"):
                break
    assert info == {"max_lora": "2", "running_lora_adapters": "adapter2", "waiting_lora_adapters": "",
                    "model_name": info["model_name"], "engine": "0"}

    # bad adapters: the request's typed error, and the engine serves on
    high_rank = make_adapter(tiny_llama, str(tmp_path / "r32"), seed=9, rank=32)
    with pytest.raises(InvalidRequestError, match="max_lora_rank=16"):
        await engine.generate(prompt, GREEDY, lora_request=LoRARequest("big", 7, high_rank))
    with pytest.raises(InvalidRequestError, match="got None"):
        await engine.add_lora(None)
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        await engine.add_lora(LoRARequest("empty", 8, str(tmp_path)))
    with pytest.raises(InvalidRequestError, match="one id, one adapter"):
        await engine.generate(prompt, GREEDY, lora_request=LoRARequest("other", a1.lora_int_id, a2.lora_path))
    await engine.add_lora(adapters[2])
    outs = await engine.generate_many([prompt, prompt], GREEDY, lora_request=[adapters[2], None])
    assert [o.token_ids for o in outs] == [_reference(tiny_llama, adapters[2], prompt), base.token_ids]
    with pytest.raises(InvalidRequestError, match="got 1 LoRARequests for 2 prompts"):
        await engine.generate_many([prompt, prompt], GREEDY, lora_request=[a1])

    # sleep mode: the slots' memory goes with the weights at both levels; after the wake-up each adapter is
    # set again from the CPU cache (or its folder) and its tokens are PEFT's again
    expected = [_reference(tiny_llama, a1, prompt), _reference(tiny_llama, adapters[2], prompt)]
    for level in (1, 2):
        await engine.sleep(level=level)
        await engine.wake_up(tags=["weights"])
        if level == 2:
            await engine.update_weights(tiny_llama)
        await engine.wake_up(tags=["kv_cache"])
        outs = await engine.generate_many([prompt, prompt], GREEDY, lora_request=[a1, adapters[2]])
        assert [o.token_ids for o in outs] == expected, level


async def test_remove_lora_forgets_the_id_and_running_requests_finish_with_it(
        tiny_llama: str, lora_engine: AsyncEngine, adapters: list[LoRARequest]) -> None:
    """`remove_lora` and `list_loras` (vLLM's; `pin_lora`: test_lora_pin_engine.py): add/remove cycles leave no id
    in the host's checker (the core's map: the unit test);
    an unknown id is False; a request running with the removed id, and one with another adapter, finish with
    PEFT's tokens; the id added again for another folder serves that folder, not the old weights."""
    a1, a2 = adapters[:2]
    checked = lora_engine._processor._lora._checked
    known = len(checked)
    for i in range(4):
        await lora_engine.add_lora(LoRARequest(f"cycle{i}", 100 + i, a1.lora_path))
        assert 100 + i in await lora_engine.list_loras()
        assert await lora_engine.remove_lora(100 + i) is True
        assert 100 + i not in await lora_engine.list_loras()
    assert len(checked) == known and await lora_engine.remove_lora(100) is False
    assert await lora_engine.list_loras() == set(checked)
    prompt = random_prompts(1, seed=13, max_len=30)[0]
    moved = LoRARequest("moved", 200, a1.lora_path)
    other = asyncio.ensure_future(lora_engine.generate(prompt, GREEDY, lora_request=a2))
    stream = lora_engine.stream(prompt, GREEDY, lora_request=moved)
    async with stream:
        tokens = [t async for delta in _first(stream) for t in delta.token_ids]
        assert await lora_engine.remove_lora(200) is True and 200 not in checked
        tokens += [t async for delta in stream for t in delta.token_ids]
    assert tokens == _reference(tiny_llama, a1, prompt)
    assert (await other).token_ids == _reference(tiny_llama, a2, prompt)
    again = await lora_engine.generate(prompt, GREEDY, lora_request=LoRARequest("moved", 200, a2.lora_path))
    assert again.token_ids == _reference(tiny_llama, a2, prompt)
    with pytest.raises(InvalidRequestError, match="lora_id"):
        await lora_engine.remove_lora("200")


async def _first(stream):
    """The stream's first delta only (the request runs on)."""
    async for delta in stream:
        yield delta
        return


async def test_an_adapter_without_enable_lora_is_refused(tiny_llama: str, adapters: list[LoRARequest]) -> None:
    async with AsyncEngine(tiny_llama, disable_log_stats=True) as engine:
        with pytest.raises(InvalidRequestError, match="enable_lora=True"):
            await engine.generate([5, 6, 7], GREEDY, lora_request=adapters[0])
        assert (await engine.generate([5, 6, 7], GREEDY)).token_ids == hf_greedy(tiny_llama, [5, 6, 7], MAX_TOKENS)


async def test_a_slow_adapter_read_stalls_no_other_stream(tiny_llama: str, lora_engine: AsyncEngine, tmp_path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter's first check (a hub download, a NaN scan) runs on a worker thread: the processor thread streams
    everyone else meanwhile, and the request runs once its adapter is read."""
    started, release, readers, read = threading.Event(), threading.Event(), [], lora_checker.read_adapter
    def slow_read(path: str):
        readers.append(threading.current_thread().name)
        started.set()
        assert release.wait(60)
        return read(path)

    monkeypatch.setattr(lora_checker, "read_adapter", slow_read)
    slow = LoRARequest("slow", 41, make_adapter(tiny_llama, str(tmp_path), seed=41, rank=4))
    task = asyncio.create_task(lora_engine.generate([5, 6, 7], GREEDY, lora_request=slow))
    try:
        assert await asyncio.to_thread(started.wait, 60)
        base = await asyncio.wait_for(lora_engine.generate([8, 9], GREEDY), 60)  # served while the read waits
        assert base.outputs[0].token_ids == hf_greedy(tiny_llama, [8, 9], MAX_TOKENS) and not task.done()
    finally:
        release.set()
    assert (await task).outputs[0].token_ids == peft_greedy(tiny_llama, slow.lora_path, [5, 6, 7], MAX_TOKENS)
    assert readers and not {"asyncllm-processor", threading.main_thread().name} & set(readers)


async def test_tensor_parallel_adapters_equal_peft(tiny_qwen3: str, tmp_path) -> None:
    """Qwen3 (explicit head_dim, q/k norms) on two ranks: column-parallel B rows and row-parallel A columns. Then an
    adapter gone before the workers read it: both ranks settle their reads (workers/rank_failures.py), its requests
    fail with rank 0's error, the others and the engine go on."""
    lora = LoRARequest("q", 1, make_adapter(tiny_qwen3, str(tmp_path / "q"), seed=5, rank=8))
    prompts = random_prompts(3, seed=13, max_len=40)
    async with AsyncEngine(tiny_qwen3, tensor_parallel_size=2, enable_lora=True, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY, lora_request=v) for v in (None, lora) for p in prompts))
        error = await _an_adapter_gone(engine, tiny_qwen3, tmp_path, engine.config.async_scheduling)
        assert "(rank 0: " in str(error)
    got = iter(outs)
    for variant in (None, lora):
        for prompt in prompts:
            assert next(got).token_ids == _reference(tiny_qwen3, variant, prompt), (variant, prompt)


async def test_pipeline_stages_each_apply_their_layers_adapters(tiny_llama: str, adapters: list[LoRARequest],
                                                             tmp_path) -> None:
    """Two stages of one layer each: each stage puts its own layers' matrices of an adapter in its slots (the
    other stage's are skipped) and masks its tokens; four variants in micro-batches, three adapters for two
    slots, equal peft's tokens."""
    prompts = random_prompts(3, seed=17, max_len=40)
    variants: list[LoRARequest | None] = [None, *adapters]
    async with AsyncEngine(tiny_llama, pipeline_parallel_size=2, enable_lora=True, max_loras=2,
                           max_num_batched_tokens=32, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY, lora_request=v) for p in prompts for v in variants))
        # an adapter gone before the workers read it: both stages settle their reads, its requests fail alone
        assert "(rank 0: " in str(await _an_adapter_gone(engine, tiny_llama, tmp_path, engine.config.async_scheduling))
    got = iter(outs)
    for prompt in prompts:
        for variant in variants:
            assert next(got).token_ids == _reference(tiny_llama, variant, prompt), (variant, prompt)


async def test_an_adapter_gone_before_the_workers_read_it_fails_its_requests_only(tiny_llama: str, tmp_path,
                                                                                   lora_engine: AsyncEngine) -> None:
    """The folder passes the host's check, then its weights are corrupted before a worker loads them: the
    requests with that adapter end with InvalidRequestError, the base model's request in the same batch and the
    engine go on, and the adapter's id works again once its folder is good (nothing cached a failure).
    Overlapped steps (async scheduling, the module's engine); synchronous ones below."""
    await _an_adapter_gone(lora_engine, tiny_llama, tmp_path, True)


async def test_an_adapter_gone_fails_its_requests_only_without_async_scheduling(tiny_llama: str, tmp_path) -> None:
    async with AsyncEngine(tiny_llama, enable_lora=True, async_scheduling=False, disable_log_stats=True) as engine:
        await _an_adapter_gone(engine, tiny_llama, tmp_path, False)


async def _an_adapter_gone(engine: AsyncEngine, tiny_llama: str, tmp_path, async_scheduling: bool) -> BaseException:
    """The request's error."""
    import shutil

    assert engine.config.async_scheduling is async_scheduling
    folder = make_adapter(tiny_llama, str(tmp_path / "flaky"), seed=6, rank=4)
    good = str(tmp_path / "good.safetensors")
    weights = f"{folder}/adapter_model.safetensors"
    shutil.copy(weights, good)
    lora = LoRARequest("flaky", 11, folder)  # an id the module's adapters do not use
    prompt = [5, 6, 7, 8]
    await engine.add_lora(lora)  # checked by the host now
    with open(weights, "wb") as f:
        f.write(b"not safetensors")
    results = await asyncio.gather(engine.generate(prompt, GREEDY, lora_request=lora),
                                   engine.generate(prompt, GREEDY), return_exceptions=True)
    assert isinstance(results[0], InvalidRequestError) and "could not load the adapter" in str(results[0])
    assert results[0].field == "lora_request"
    assert results[1].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
    shutil.copy(good, weights)
    out = await engine.generate(prompt, GREEDY, lora_request=lora)
    assert out.token_ids == _reference(tiny_llama, lora, prompt)
    return results[0]


@pytest.mark.parametrize("arch, targets", [("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
                                           ("cohere", None)])
async def test_fused_phi3_and_cohere_adapters_equal_peft(arch: str, targets: list[str] | None, tmp_path) -> None:
    """Phi-3's adapters target its checkpoint's fused qkv_proj and gate_up_proj. Each prompt runs with the adapter
    and without it, in the same batches, with 16-token chunks; sequences stay within Phi-3's 64 pretrained positions.
    Command R: its q/k adapters' rows reordered with the interleaved rotary's, through the host's checks and the
    workers. (Gemma 2's adapters equal PEFT's in process: tests/unit/test_lora_models.py.)"""
    path = tiny_checkpoint(arch)
    lora = LoRARequest(arch, 1, make_adapter(path, str(tmp_path / arch), seed=7, rank=8, targets=targets))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = random_prompts(2, seed=14, max_len=40)
    async with AsyncEngine(path, max_model_len=64, max_num_batched_tokens=16, enable_lora=True,
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params, lora_request=v) for p in prompts for v in (lora, None)))
    got = iter(outs)
    for prompt in prompts:
        assert next(got).token_ids == peft_greedy(path, lora.lora_path, prompt, MAX_TOKENS, eos_token_id=None)
        assert next(got).token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None)


@pytest.mark.parametrize("arch, tp", [("qwen3_5", 2), ("qwen3_5_moe", 1)])
async def test_qwen3_5_adapters_on_every_projection_equal_peft(arch: str, tp: int, tmp_path) -> None:
    """Qwen3.5's hybrid: the gated attention (its q_proj holds queries and gates), the Gated DeltaNet's five
    projections (kept whole on every rank) and the MLP (Qwen3.5-MoE: not its experts), adapted; with and without
    the adapter in one batch."""
    path = tiny_checkpoint(arch)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "out_proj", *(["gate_proj", "up_proj", "down_proj"] if arch == "qwen3_5" else [])]
    lora = LoRARequest("q35", 1, make_adapter(path, str(tmp_path / "q35"), seed=9, rank=8, targets=targets))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = random_prompts(2, seed=15, max_len=40)
    async with AsyncEngine(path, max_num_batched_tokens=16, enable_lora=True, tensor_parallel_size=tp,
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params, lora_request=v)
                                      for p in prompts for v in (lora, None)))
    got = iter(outs)
    for prompt in prompts:
        assert next(got).token_ids == peft_greedy(path, lora.lora_path, prompt, MAX_TOKENS, eos_token_id=None)
        assert next(got).token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None)


async def test_granite4_hybrid_adapters_on_its_attention_equal_peft_and_its_mixers_are_refused(tmp_path) -> None:
    """Granite 4.0's hybrid (Mamba2 and attention layers): an adapter on the attention's projections, with and
    without it in one batch (PEFT's tokens / transformers'); one on the Mamba2 mixer's in_proj is refused by name."""
    path = tiny_checkpoint("granitemoehybrid")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = LoRARequest("g4", 1, make_adapter(path, str(tmp_path / "g4"), seed=9, rank=8, alpha=64, targets=attention))
    mixer = LoRARequest("g4m", 2, make_adapter(path, str(tmp_path / "g4m"), seed=9, rank=8, targets=["in_proj"]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = random_prompts(1, seed=17, max_len=40)[0]
    async with AsyncEngine(path, max_num_batched_tokens=16, enable_lora=True, disable_log_stats=True) as engine:
        outs = await asyncio.gather(engine.generate(prompt, params, lora_request=lora), engine.generate(prompt, params))
        with pytest.raises(InvalidRequestError, match="mamba.in_proj"):
            await engine.generate(prompt, params, lora_request=mixer)
    assert outs[0].token_ids == peft_greedy(path, lora.lora_path, prompt, MAX_TOKENS, eos_token_id=None)
    assert outs[1].token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None)
    assert outs[0].token_ids != outs[1].token_ids


async def test_llama4_image_text_checkpoint_adapters_on_its_language_model_equal_peft(tmp_path) -> None:
    """A ``Llama4ForConditionalGeneration`` checkpoint served as text (``limit_mm_per_prompt`` of 0 images): PEFT's
    adapter of it names the language model's projections under ``language_model.model.`` and, for the same module
    names, the vision tower's, which are left out (the tower never runs; with images such an adapter is refused:
    tests/engine/test_llama4_vl_engine.py); tokens equal PEFT's on transformers' image-text model."""
    import glob
    import shutil

    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from asyncllm.models.loader import load_hf_config

    base = tiny_checkpoint("llama4")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                  vision_output_dim=64, image_size=28, patch_size=14, projector_input_dim=64, projector_output_dim=64)
    torch.manual_seed(0)
    path = str(tmp_path / "llama4_mm")
    config = Llama4Config(text_config=load_hf_config(base).to_dict(), vision_config=vision)
    Llama4ForConditionalGeneration(config).eval().save_pretrained(path)
    for name in glob.glob(f"{base}/tokenizer*") + glob.glob(f"{base}/special*"):
        shutil.copy(name, path)
    lora = LoRARequest("l4", 1, make_adapter(path, str(tmp_path / "l4"), seed=9, rank=8, alpha=32,
                                             targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             auto_class=Llama4ForConditionalGeneration))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = random_prompts(1, seed=18, max_len=30)[0]
    async with AsyncEngine(path, enable_lora=True, disable_log_stats=True,
                           limit_mm_per_prompt={"image": 0}) as engine:
        outs = await asyncio.gather(engine.generate(prompt, params, lora_request=lora), engine.generate(prompt, params))
    from hf_reference import model_greedy
    from peft import PeftModel

    hf = PeftModel.from_pretrained(Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32),
                                   lora.lora_path).eval()
    text_model = hf.base_model.model.language_model  # transformers' text-only generate of the whole model fails
    assert outs[0].token_ids == model_greedy(text_model, prompt, MAX_TOKENS, eos_token_id=None)
    with hf.disable_adapter():
        assert outs[1].token_ids == model_greedy(text_model, prompt, MAX_TOKENS, eos_token_id=None)
    assert outs[0].token_ids != outs[1].token_ids


async def test_qwen3_5_saved_states_are_keyed_by_adapter(tmp_path) -> None:
    """Hybrid prefix caching under LoRA: the states saved for a prompt under an adapter serve the same prompt under
    that adapter only (the adapter keys the blocks, so the saved points too); tokens equal PEFT's / transformers'."""
    path = tiny_checkpoint("qwen3_5")
    lora = LoRARequest("q35", 1, make_adapter(path, str(tmp_path / "q35"), seed=9, rank=8))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = random_prompts(1, seed=16, max_len=40)[0] + list(range(10, 30))
    async with AsyncEngine(path, max_num_batched_tokens=16, enable_lora=True, block_size=4, mamba_block_size=8,
                           disable_log_stats=True) as engine:
        first = await engine.generate(prompt, params, lora_request=lora)
        base = await engine.generate(prompt, params)
        again = await engine.generate(prompt, params, lora_request=lora)
    assert (first.num_cached_tokens, base.num_cached_tokens) == (0, 0) and again.num_cached_tokens > 0
    assert first.token_ids == again.token_ids == peft_greedy(path, lora.lora_path, prompt, MAX_TOKENS,
                                                             eos_token_id=None)
    assert base.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None)


async def test_deepseek_latent_attention_adapters_on_two_ranks_equal_peft(tmp_path) -> None:
    """DeepSeek-V3's latent attention on two ranks: adapters on q_a / q_b, kv_a_proj_with_mqa, o_proj and kv_b_proj
    (whose expansions are absorbed: its adapters apply per head beside them) and, as PEFT turns gate / up / down of a
    mixture of experts into, its experts' stacked parameters; with and without the adapter in one batch, chunked.
    An adapter naming a projection latent attention lacks (k_proj) is refused by name."""
    path = tiny_checkpoint("deepseek_v3")
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoRARequest("mla", 1, make_adapter(path, str(tmp_path / "mla"), seed=4, rank=8, targets=targets))
    wrong = LoRARequest("k", 2, make_adapter(tiny_checkpoint("llama"), str(tmp_path / "k"), seed=4, rank=8,
                                              targets=["k_proj"]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = random_prompts(2, seed=19, max_len=40)
    async with AsyncEngine(path, max_num_batched_tokens=16, enable_lora=True, tensor_parallel_size=2,
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params, lora_request=v) for p in prompts for v in (lora, None)))
        with pytest.raises(InvalidRequestError, match="has no k_proj to adapt"):
            await engine.generate(prompts[0], params, lora_request=wrong)
    assert outs[0].token_ids != outs[1].token_ids
    got = iter(outs)
    for prompt in prompts:
        assert next(got).token_ids == peft_greedy(path, lora.lora_path, prompt, MAX_TOKENS, eos_token_id=None)
        assert next(got).token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None)
