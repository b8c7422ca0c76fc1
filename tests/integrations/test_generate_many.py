"""`AsyncEngine.generate_many`: input order, per-prompt params, progress bar, bounded concurrency."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.engine.batch import generate_many

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = [f"value_{i} = " for i in range(9)]


async def test_results_in_input_order(bundled_engine, capsys) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5)
    outputs = await bundled_engine.generate_many(PROMPTS, params, progress=True, max_concurrency=3)
    singles = await asyncio.gather(*(bundled_engine.generate(p, params) for p in PROMPTS))
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.token_ids for o in outputs] == [s.token_ids for s in singles]
    assert "9/9" in capsys.readouterr().err  # tqdm's bar on stderr


async def test_params_per_prompt(bundled_engine) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=i + 1, ignore_eos=True) for i in range(3)]
    outputs = await bundled_engine.generate_many(PROMPTS[:3], params)
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3]
    with pytest.raises(InvalidRequestError, match="params"):
        await bundled_engine.generate_many(PROMPTS[:3], params[:2])
    with pytest.raises(InvalidRequestError, match="max_concurrency"):
        await bundled_engine.generate_many(PROMPTS[:3], max_concurrency=0)


class _CountingEngine:
    """Records how many `generate` calls overlap; fails on the prompt "boom"."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(max_num_seqs=2)
        self.in_flight = self.peak = 0
        self.cancelled = 0

    async def generate(self, prompt, params):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(0.01 if prompt != "slow" else 10)
            if prompt == "boom":
                raise InvalidRequestError("prompt", "boom")
            return SimpleNamespace(prompt=prompt)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


async def test_concurrency_is_bounded() -> None:
    engine = _CountingEngine()
    outputs = await generate_many(engine, [str(i) for i in range(20)])
    assert [o.prompt for o in outputs] == [str(i) for i in range(20)]
    assert engine.peak == 4  # default: 2 x max_num_seqs
    engine.peak = 0
    await generate_many(engine, [str(i) for i in range(20)], max_concurrency=3)
    assert engine.peak == 3


async def test_a_single_prompt_is_a_batch_of_one() -> None:
    """vLLM's LLM.generate: a str or a prompt dict is one prompt (not its characters or keys); a flat list of token
    ids too (an int is no prompt); a list of them is the batch."""
    engine = _CountingEngine()
    for prompt in ("Hello", {"prompt": "Hello"}, [0, 45, 367], (0, 45)):
        outputs = await generate_many(engine, prompt, SamplingParams(), lora_request=[None])
        assert [o.prompt for o in outputs] == [prompt]
    outputs = await generate_many(engine, [[0, 45], [367]])
    assert [o.prompt for o in outputs] == [[0, 45], [367]]
    with pytest.raises(InvalidRequestError, match="iterable of prompts, got int"):
        await generate_many(engine, 5)


async def test_first_error_cancels_the_rest() -> None:
    engine = _CountingEngine()
    with pytest.raises(InvalidRequestError, match="boom"):
        await generate_many(engine, ["slow", "boom", "slow"], max_concurrency=3)
    assert engine.cancelled == 2 and engine.in_flight == 0


async def test_a_bad_entry_of_a_per_prompt_list_refuses_the_batch_before_any_prompt_runs() -> None:
    """A params or lora_request list whose entry is no SamplingParams / LoRARequest (a dict of fields, say) fails the
    batch before any prompt runs, as a SamplingParams that does not validate: found at that prompt's turn, it would
    fail the batch after the prompts before it ran (hours of a long batch, their results lost)."""
    engine = _CountingEngine()
    with pytest.raises(InvalidRequestError, match="params: .*got dict for prompt 2"):
        await generate_many(engine, ["a", "b", "c"], [SamplingParams(), None, {"max_tokens": 2}])
    with pytest.raises(InvalidRequestError, match="lora_request: .*got str for prompt 1"):
        await generate_many(engine, ["a", "b"], SamplingParams(), lora_request=[None, "sql-adapter"])
    assert engine.peak == 0
