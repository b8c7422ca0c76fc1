"""LoRA state across engine cores: a core killed and restarted by the supervisor gets the pinned adapters pinned
again (the host's `EnginePins`, asyncllm/engine/engine_pins.py), and the other ids its host knows added again, before
any request reaches it (`list_loras` as before the crash, their requests' tokens too); with data
parallelism each replica's host keeps its own record of adapter ids, so one replica's idle ids forgotten never drop
an id another replica's requests run with. The host's half alone: tests/unit/test_lora_pin_host.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncllm import AsyncEngine, InvalidRequestError, LoRARequest, SamplingParams
from asyncllm.lora import KEPT_LORA_IDS
from lora_utils import make_adapter, peft_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
ENGINE_KWARGS = dict(enable_lora=True, disable_log_stats=True, max_model_len=256, num_gpu_blocks_override=64)

pytestmark = pytest.mark.asyncio


async def _kill_core_and_wait_for_its_restart(engine: AsyncEngine) -> None:
    core_pid = engine._core.pid  # type: ignore[union-attr]
    os.kill(core_pid, signal.SIGKILL)
    supervisor = engine._replicas[0].supervisor
    deadline = time.monotonic() + 30
    while not supervisor.restarting:  # the processor reports the core dead within a second
        assert time.monotonic() < deadline, "the core's death went unnoticed"
        await asyncio.sleep(0.02)
    await asyncio.wait_for(supervisor.wait(), 120)
    assert engine.stats().engine_alive and engine._core.pid != core_pid  # type: ignore[union-attr]


async def test_a_restarted_core_pins_the_pinned_adapters_again(tiny_llama: str, tmp_path) -> None:
    """max_loras=1 with adapter 1 pinned: after the core is killed and restarted, the host still knows the id and
    the new core holds it pinned (a request of adapter 2 is refused: every slot holds a pinned adapter), its
    requests equal PEFT's; `remove_lora` unpins it there, and adapter 2 runs."""
    pinned = LoRARequest("pinned", 1, make_adapter(tiny_llama, str(tmp_path / "pinned"), seed=61, rank=4))
    other = LoRARequest("other", 2, make_adapter(tiny_llama, str(tmp_path / "other"), seed=62, rank=8))
    prompt = [5, 6, 7]
    async with AsyncEngine(tiny_llama, max_loras=1, max_core_restarts=1, **ENGINE_KWARGS) as engine:
        await engine.add_lora(pinned)
        assert await engine.pin_lora(1) is True
        await _kill_core_and_wait_for_its_restart(engine)
        assert await engine.list_loras() == {1}
        with pytest.raises(InvalidRequestError, match="every one of the max_loras=1 adapter slots holds a pinned"):
            await engine.generate(prompt, GREEDY, lora_request=other)
        out = await engine.generate(prompt, GREEDY, lora_request=pinned)
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama, pinned.lora_path, prompt, MAX_TOKENS)
        assert await engine.remove_lora(1) is True
        out = await engine.generate(prompt, GREEDY, lora_request=other)
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama, other.lora_path, prompt, MAX_TOKENS)


async def test_a_restarted_core_is_given_the_added_adapters_again(tiny_llama: str, tmp_path) -> None:
    """Adapters added (`add_lora`) and not pinned, one used by a request before the crash, one not: after the core
    is killed and restarted, `list_loras` lists them as before and their greedy tokens are the same (PEFT's); one
    whose folder was moved away meanwhile is refused by the new core, so forgotten (not listed), and used again it
    is checked afresh (its host's error, as for any adapter never seen)."""
    folders = [make_adapter(tiny_llama, str(tmp_path / name), seed=64 + i, rank=4) for i, name in enumerate("uag")]
    used, added, gone = (LoRARequest(name, i + 1, folder) for i, (name, folder) in enumerate(zip("uag", folders)))
    prompt = [5, 6, 7]
    async with AsyncEngine(tiny_llama, max_loras=1, max_core_restarts=1, **ENGINE_KWARGS) as engine:
        for lora in (used, added, gone):
            await engine.add_lora(lora)
        before = (await engine.generate(prompt, GREEDY, lora_request=used)).outputs[0].token_ids
        assert await engine.list_loras() == {1, 2, 3}
        os.rename(gone.lora_path, str(tmp_path / "moved"))
        await _kill_core_and_wait_for_its_restart(engine)
        assert await engine.list_loras() == {1, 2}
        assert engine._processor.lora_given(2) == added  # type: ignore[union-attr]  # known still: not read again
        for lora, expected in ((used, before), (added, peft_greedy(tiny_llama, added.lora_path, prompt, MAX_TOKENS))):
            out = await engine.generate(prompt, GREEDY, lora_request=lora)
            assert out.outputs[0].token_ids == expected, lora.lora_name
        assert before == peft_greedy(tiny_llama, used.lora_path, prompt, MAX_TOKENS)
        with pytest.raises(InvalidRequestError, match="no such folder") as raised:
            await engine.generate(prompt, GREEDY, lora_request=gone)
        assert raised.value.field == "lora_request"
        assert await engine.list_loras() == {1, 2}


async def test_each_replica_forgets_idle_ids_by_its_own_requests(tiny_llama: str, tmp_path) -> None:
    """Two replicas know adapter 1 (`add_lora`); replica 1 runs a long request with it while replica 0 uses
    `KEPT_LORA_IDS` other ids: replica 0 forgets id 1 (idle there), replica 1 keeps it, and its request and later
    ones with it equal PEFT's."""
    folder = make_adapter(tiny_llama, str(tmp_path / "a"), seed=63, rank=4)
    lora = LoRARequest("a", 1, folder)
    prompt = [5, 6, 7]
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    async with AsyncEngine(tiny_llama, data_parallel_size=2, max_loras=2, **ENGINE_KWARGS) as engine:
        await engine.add_lora(lora)
        running = engine.stream(prompt, long, lora_request=lora, data_parallel_rank=1)
        tokens: list[int] = []
        async with running:
            async for delta in running:
                tokens += delta.token_ids
                if tokens:
                    break
            one = SamplingParams(temperature=0.0, max_tokens=1)
            for first in range(2, KEPT_LORA_IDS + 2, 8):  # ids 2 .. KEPT_LORA_IDS + 1 on replica 0
                await asyncio.gather(*(engine.generate(prompt, one, lora_request=LoRARequest(f"x{i}", i, folder),
                                                       data_parallel_rank=0) for i in range(first, first + 8)))
            replica0, replica1 = (engine._replicas[i].processor for i in (0, 1))
            assert 1 not in replica0.lora_ids() and 1 in replica1.lora_ids()  # type: ignore[union-attr]
            async for delta in running:
                tokens += delta.token_ids
        expected = peft_greedy(tiny_llama, folder, prompt, MAX_TOKENS)
        assert len(tokens) == 48 and tokens[:len(expected)] == expected
        assert 1 in await engine.list_loras()
        out = await engine.generate(prompt, GREEDY, lora_request=lora, data_parallel_rank=1)
        assert out.outputs[0].token_ids == expected
