"""GLM-ASR end to end (asyncllm/models/glmasr.py, docs/multimodal.md#glm-asr): prompt ids and greedy tokens equal
transformers' for one and two audios of different lengths (one past 30 s: two windows), their placeholders split
across prefill chunks, batched; over two tensor-parallel ranks and two pipeline stages; a LoRA adapter of the
decoder equals PEFT's, one of the audio tower is refused."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from audio_utils import SAMPLING_RATE, make_audio
from glmasr_utils import AUDIO, MARK, hf_glmasr_greedy, hf_glmasr_inputs, make_tiny_glmasr

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_glmasr(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_glmasr(tmp_path_factory.mktemp("glmasr"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_glmasr: str):
    engine = AsyncEngine(tiny_glmasr, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=4,
                         limit_mm_per_prompt={"audio": 2}, max_model_len=1024, enable_lora=True)
    await engine.start()
    yield engine
    await engine.aclose()


async def test_one_and_two_audios_match_transformers_batched_and_chunked(engine, tiny_glmasr):
    one, two = [make_audio(1.3, seed=1)], [make_audio(31.0, seed=2), make_audio(0.6, seed=3)]
    texts = [f"Audio: {MARK} what is it?", f"First {MARK} then {MARK} compare"]
    outs = await asyncio.gather(*(engine.generate({"prompt": text, "multi_modal_data": {"audio": [
        (a, SAMPLING_RATE) for a in audios]}}, GREEDY) for text, audios in zip(texts, (one, two))))
    for out, text, audios in zip(outs, texts, (one, two)):
        prompt_ids, tokens = hf_glmasr_greedy(tiny_glmasr, text, audios, 8)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    audio_id = engine.tokenizer.convert_tokens_to_ids(AUDIO)
    assert outs[0].prompt_token_ids.count(audio_id) == 16 > 8  # one audio's placeholders span two 16-token chunks
    assert outs[1].prompt_token_ids.count(audio_id) == 375 + 12 + 7  # 30 s + 1 s windows, then 0.6 s


async def test_audio_count_mismatch_fails_its_request(engine):
    with pytest.raises(InvalidRequestError, match="2 audio placeholder tokens"):
        await engine.generate({"prompt": f"a {MARK} {MARK}", "audios": [make_audio(0.5, seed=6)]}, GREEDY)


@pytest.mark.parametrize("fields", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
async def test_two_ranks_or_two_stages_give_transformers_tokens(tiny_glmasr, fields: dict):
    """Two tensor-parallel ranks (the encoder whole on each, the decoder split), or two pipeline stages (the encoder
    on the first, one decoder layer on each)."""
    audio = make_audio(1.9, seed=8)
    text = f"two ranks {MARK} hear"
    async with AsyncEngine(tiny_glmasr, disable_log_stats=True, max_num_batched_tokens=16, **fields) as split:
        out = await split.generate({"prompt": text, "audios": [(audio, SAMPLING_RATE)]}, GREEDY)
    assert out.outputs[0].token_ids == hf_glmasr_greedy(tiny_glmasr, text, [audio], 8)[1]


async def test_lora_adapters_on_the_decoder_equal_peft_and_tower_adapters_are_refused(engine, tiny_glmasr, tmp_path):
    import torch
    from lora_utils import make_adapter
    from peft import PeftModel
    from transformers import GlmAsrForConditionalGeneration as HFGlmAsr

    from asyncllm import LoRARequest

    decoder = make_adapter(tiny_glmasr, str(tmp_path / "decoder"), seed=3, rank=4, alpha=8,
                           targets=r".*language_model.*\.(q_proj|v_proj|down_proj)", auto_class=HFGlmAsr)
    tower = make_adapter(tiny_glmasr, str(tmp_path / "tower"), seed=3, rank=4, targets=["q_proj"],
                         auto_class=HFGlmAsr)
    audio, text = make_audio(1.5, seed=3), f"x {MARK} y"
    prompt = {"prompt": text, "audios": [(audio, SAMPLING_RATE)]}
    adapted, base = await asyncio.gather(
        engine.generate(prompt, GREEDY, lora_request=LoRARequest("decoder", 1, decoder)),
        engine.generate(prompt, GREEDY))
    with pytest.raises(InvalidRequestError, match="adapters on the audio tower are not built"):
        await engine.generate(prompt, GREEDY, lora_request=LoRARequest("tower", 2, tower))
    peft = PeftModel.from_pretrained(HFGlmAsr.from_pretrained(tiny_glmasr), decoder).eval()
    inputs = hf_glmasr_inputs(tiny_glmasr, text, [audio])
    with torch.no_grad():
        expected = peft.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert adapted.outputs[0].token_ids == expected.tolist() != base.outputs[0].token_ids
    assert base.outputs[0].token_ids == hf_glmasr_greedy(tiny_glmasr, text, [audio], 8)[1]
