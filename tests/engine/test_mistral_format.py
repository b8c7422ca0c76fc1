"""Mistral's own checkpoint format, params.json + consolidated.safetensors (vLLM's config_format / load_format
"mistral"): served with greedy tokens equal to transformers' on the same model (asyncllm/models/mistral_format.py)."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from hf_reference import hf_greedy
from mistral_utils import mistral_format_checkpoint

pytestmark = pytest.mark.asyncio

PROMPT = "Beautiful is better than ugly. Explicit is better than implicit."
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


async def _greedy(path: str, **options) -> tuple[list[int], list[int]]:
    async with AsyncEngine(path, disable_log_stats=True, max_model_len=256, **options) as engine:
        out = await engine.generate(PROMPT, GREEDY)
    return out.prompt_token_ids, out.token_ids


@pytest.mark.parametrize("window, tp", [(None, 1), (8, 2)], ids=["full", "window8-tp2"])
async def test_a_mistral_only_checkpoint_equals_transformers(tmp_path, window: int | None, tp: int) -> None:
    hf = tiny_checkpoint("mistral", sliding_window=window)
    folder = mistral_format_checkpoint(hf, str(tmp_path / "mistral"))
    prompt_ids, token_ids = await _greedy(folder, tensor_parallel_size=tp, block_size=8)
    assert len(prompt_ids) > 2 * 8 and token_ids == hf_greedy(hf, prompt_ids, 10)


async def test_the_formats_are_chosen_by_config_format_and_load_format(tmp_path) -> None:
    """A folder with both formats, each of another model: auto serves config.json's, mistral params.json's."""
    mistral_model, hf_model = tiny_checkpoint("mistral"), tiny_checkpoint("mistral", seed=1)
    folder = str(tmp_path / "both")
    mistral_format_checkpoint(mistral_model, folder)
    mistral_format_checkpoint(hf_model, str(tmp_path / "other"), keep_hf=True)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "other" / name).rename(tmp_path / "both" / name)
    prompt_ids, hf_tokens = await _greedy(folder)
    assert hf_tokens == hf_greedy(hf_model, prompt_ids, 10)
    _, mistral_tokens = await _greedy(folder, config_format="mistral", load_format="mistral")
    assert mistral_tokens == hf_greedy(mistral_model, prompt_ids, 10) != hf_tokens
