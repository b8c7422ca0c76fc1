"""LightOnOCR served from a config.json as vLLM-era tooling wrote it (vLLM's ``LightOnOCRForConditionalGeneration``,
``model_type`` "mistral3"): the engine's prompt and greedy tokens equal transformers' on the same checkpoint under
transformers 5's names (tests/unit/test_lighton_ocr_alias.py: the load itself)."""

from __future__ import annotations

import json
import shutil

import pytest
from lighton_ocr_utils import IMAGE, hf_lighton_ocr_greedy, make_tiny_lighton_ocr
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_a_vllm_era_config_serves_the_same_model(tmp_path):
    tiny = make_tiny_lighton_ocr(tmp_path / "ours")
    shutil.copytree(tiny, tmp_path / "vllm_era")
    config = json.loads((tmp_path / "vllm_era" / "config.json").read_text())
    config.update(architectures=["LightOnOCRForConditionalGeneration"], model_type="mistral3")
    (tmp_path / "vllm_era" / "config.json").write_text(json.dumps(config))
    images, text = [make_image(100, 60, seed=1)], f"look {IMAGE} please"
    async with AsyncEngine(str(tmp_path / "vllm_era"), disable_log_stats=True, block_size=4, max_num_seqs=2) as engine:
        out = await engine.generate({"prompt": text, "images": images}, SamplingParams(max_tokens=8, temperature=0.0))
    hf_prompt, hf_tokens = hf_lighton_ocr_greedy(tiny, text, images, 8)
    assert out.prompt_token_ids == hf_prompt and out.outputs[0].token_ids == hf_tokens
