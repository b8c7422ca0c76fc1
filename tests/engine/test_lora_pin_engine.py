"""`pin_lora` (vLLM's) end to end: a pinned adapter stays in the workers' slots and CPU cache however many other
adapters pass through them, and through sleep mode (its weights corrupted on disk after the pin are never read:
its requests still equal PEFT's); the errors (an unknown id, more pins than max_loras slots, the last slot while
another adapter's request runs, a request of an unpinned adapter while every slot is pinned) are typed and the
engine serves on; `remove_lora` unpins. The core's and the scheduler's halves: tests/unit/test_lora_pin.py."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, LoRARequest, SamplingParams
from engine_helpers import random_prompts
from hf_reference import hf_greedy
from lora_utils import make_adapter, peft_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    """Five adapters of the tiny Llama (ids 1 to 5), every projection, ranks 4 and 8."""
    return [LoRARequest(f"pin{i}", i, make_adapter(tiny_llama, str(tmp_path_factory.mktemp(f"pin{i}")), seed=30 + i,
                                                   rank=4 if i % 2 else 8))
            for i in range(1, 6)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    """Two adapter slots and a CPU cache of two adapters, sleep mode on."""
    async with AsyncEngine(tiny_llama, enable_lora=True, max_loras=2, max_cpu_loras=2, enable_sleep_mode=True,
                           disable_log_stats=True) as engine:
        yield engine


def _corrupt(lora: LoRARequest) -> str:
    """Spoil the adapter's weights on disk (a worker reading them again fails the request); the good file's copy."""
    weights = f"{lora.lora_path}/adapter_model.safetensors"
    shutil.copy(weights, f"{weights}.good")
    with open(weights, "wb") as f:
        f.write(b"not safetensors")
    return weights


async def test_a_pinned_adapter_is_never_evicted_nor_read_again(tiny_llama: str, engine: AsyncEngine,
                                                               adapters: list[LoRARequest]) -> None:
    """Adapter 1 pinned, then its folder corrupted: four other adapters pass through the one unpinned slot and the
    CPU cache (LRU would have evicted it from both), alone and two at once (the scheduler holds one: the pinned
    adapter keeps its slot), and sleep mode releases the slots; adapter 1's requests still equal PEFT's, so its
    weights were never read again."""
    pinned, others = adapters[0], adapters[1:]
    prompts = random_prompts(2, seed=31, max_len=24)
    expected = {lora.lora_int_id: [peft_greedy(tiny_llama, lora.lora_path, p, MAX_TOKENS) for p in prompts]
                for lora in adapters}
    await engine.add_lora(pinned)
    assert await engine.pin_lora(pinned.lora_int_id) is True
    assert await engine.pin_lora(pinned.lora_int_id) is True  # again: nothing changes
    weights = _corrupt(pinned)
    try:
        for group in ([others[0]], [others[1], others[2]], [others[3]], [others[0], others[1]]):
            variants = [pinned, *group]
            outs = await asyncio.gather(*(engine.generate(p, GREEDY, lora_request=lora)
                                          for lora in variants for p in prompts))
            assert [o.token_ids for o in outs] == [t for lora in variants for t in expected[lora.lora_int_id]]
        await engine.sleep(level=1)
        await engine.wake_up()
        outs = await asyncio.gather(*(engine.generate(p, GREEDY, lora_request=pinned) for p in prompts))
        assert [o.token_ids for o in outs] == expected[pinned.lora_int_id]
    finally:
        shutil.copy(f"{weights}.good", weights)
    assert await engine.remove_lora(pinned.lora_int_id) is True


async def test_pin_errors_are_typed_and_the_engine_serves_on(tiny_llama: str, engine: AsyncEngine,
                                                             adapters: list[LoRARequest]) -> None:
    """An unknown id; a third pin with max_loras=2; a request of an unpinned adapter while both slots are pinned; the
    last slot while another adapter's request runs: InvalidRequestError naming why, and every other request is
    served (PEFT's tokens). `remove_lora` of a pinned id frees its slot for the others."""
    a, b, c, d = adapters[1:5]
    prompt = random_prompts(1, seed=32, max_len=20)[0]
    with pytest.raises(InvalidRequestError, match="no adapter has lora_int_id 99"):
        await engine.pin_lora(99)
    with pytest.raises(InvalidRequestError, match="lora_id"):
        await engine.pin_lora("2")
    await engine.generate(prompt, GREEDY, lora_request=a)  # used by a request: known, so it can be pinned
    assert await engine.pin_lora(a.lora_int_id) is True
    await engine.add_lora(c)
    running = engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                            lora_request=d)
    async with running:
        async for _ in running:  # d runs: pinning the last slot would leave it none
            break
        with pytest.raises(InvalidRequestError, match="pin the last of the max_loras=2 adapter slots"):
            await engine.pin_lora(c.lora_int_id)
    await engine.add_lora(b)
    assert await engine.pin_lora(b.lora_int_id) is True
    with pytest.raises(InvalidRequestError, match="cannot pin more adapters than max_loras=2"):
        await engine.pin_lora(c.lora_int_id)
    with pytest.raises(InvalidRequestError, match="every one of the max_loras=2 adapter slots holds a pinned"):
        await engine.generate(prompt, GREEDY, lora_request=d)
    outs = await asyncio.gather(*(engine.generate(prompt, GREEDY, lora_request=lora) for lora in (a, b, None)))
    assert [o.token_ids for o in outs] == [peft_greedy(tiny_llama, a.lora_path, prompt, MAX_TOKENS),
                                           peft_greedy(tiny_llama, b.lora_path, prompt, MAX_TOKENS),
                                           hf_greedy(tiny_llama, prompt, MAX_TOKENS)]
    assert await engine.remove_lora(b.lora_int_id) is True  # unpinned: a slot for the others again
    out = await engine.generate(prompt, GREEDY, lora_request=d)
    assert out.token_ids == peft_greedy(tiny_llama, d.lora_path, prompt, MAX_TOKENS)
    assert await engine.pin_lora(c.lora_int_id) is True
    for lora in (a, c):
        assert await engine.remove_lora(lora.lora_int_id) is True
