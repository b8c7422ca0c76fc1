"""Qwen3-ASR end to end (asyncllm/models/qwen3_asr.py, docs/multimodal.md#qwen3-asr): prompt ids and greedy tokens
equal transformers' for prompts with one and two audios of different lengths (whole 1 s chunks and a part, attention
windows of 2 s, the 0.5 s minimum), their placeholders split across prefill chunks, batched; a chat prompt; two
tensor-parallel ranks, two pipeline stages; LoRA adapters on the decoder."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from audio_utils import SAMPLING_RATE, make_audio
from qwen3_asr_utils import MARK, hf_qwen3_asr_greedy, make_tiny_qwen3_asr

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_asr(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen3_asr(tmp_path_factory.mktemp("qwen3_asr"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_asr: str):
    engine = AsyncEngine(tiny_asr, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=4,
                         limit_mm_per_prompt={"audio": 2}, enable_lora=True)
    await engine.start()
    yield engine
    await engine.aclose()


async def test_one_and_two_audios_match_transformers_batched_and_chunked(engine, tiny_asr):
    """4.3 s (two attention windows), then 2.7 s and 0.3 s (padded to 0.5 s) in one prompt; all batched."""
    one, two = [make_audio(4.3, seed=1)], [make_audio(2.7, seed=2), make_audio(0.3, seed=3)]
    texts = [f"Audio: {MARK} what is it?", f"First {MARK} then {MARK} compare"]
    outs = await asyncio.gather(*(engine.generate({"prompt": text, "multi_modal_data": {"audio": [
        (a, SAMPLING_RATE) for a in audios]}}, GREEDY) for text, audios in zip(texts, (one, two))))
    for out, text, audios in zip(outs, texts, (one, two)):
        prompt_ids, tokens = hf_qwen3_asr_greedy(tiny_asr, text, audios, 8)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    pad = engine.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert outs[0].prompt_token_ids.count(pad) == 4 * 13 + 4 > 16  # whole chunks, then 30 frames' 4 rows
    assert outs[1].prompt_token_ids.count(pad) == 2 * 13 + 9 + 7  # 270 frames; 50 frames (the minimum)


async def test_chat_prompt_matches_transformers(engine, tiny_asr):
    audio = make_audio(1.6, seed=4)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (audio, SAMPLING_RATE)},
                                             {"type": "text", "text": "transcribe"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    text = f"<|im_start|>user\n{MARK}transcribe<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids, hf_tokens = hf_qwen3_asr_greedy(tiny_asr, text, [audio], 8, add_special_tokens=False)
    assert stream.collector.prompt_token_ids == prompt_ids
    assert tokens == hf_tokens


@pytest.mark.parametrize("fields", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
async def test_two_ranks_or_two_stages_give_transformers_tokens(tiny_asr, fields: dict):
    """Two tensor-parallel ranks (the encoder whole on each, the decoder split), or two pipeline stages (the encoder
    on the first, one decoder layer on each)."""
    audio = make_audio(2.3, seed=8)
    text = f"two ranks {MARK} hear"
    async with AsyncEngine(tiny_asr, disable_log_stats=True, max_num_batched_tokens=16, **fields) as split:
        out = await split.generate({"prompt": text, "audios": [(audio, SAMPLING_RATE)]}, GREEDY)
    assert out.outputs[0].token_ids == hf_qwen3_asr_greedy(tiny_asr, text, [audio], 8)[1]


async def test_lora_adapters_on_the_decoder_equal_peft_and_tower_adapters_are_refused(engine, tiny_asr, tmp_path):
    """PEFT's adapter of the language model's q / v / down projections, batched with the base model: PEFT's tokens
    and transformers'; one that also adapts the audio tower is refused."""
    import torch
    from lora_utils import make_adapter
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

    from asyncllm import LoRARequest
    from asyncllm.errors import InvalidRequestError

    decoder = make_adapter(tiny_asr, str(tmp_path / "decoder"), seed=3, rank=4, alpha=8,
                           targets=r".*language_model.*\.(q_proj|v_proj|down_proj)",
                           auto_class=Qwen3ASRForConditionalGeneration)
    tower = make_adapter(tiny_asr, str(tmp_path / "tower"), seed=3, rank=4, targets=["q_proj"],
                         auto_class=Qwen3ASRForConditionalGeneration)
    audio, text = make_audio(1.5, seed=3), f"x {MARK} y"
    prompt = {"prompt": text, "audios": [(audio, SAMPLING_RATE)]}
    adapted, base = await asyncio.gather(
        engine.generate(prompt, GREEDY, lora_request=LoRARequest("decoder", 1, decoder)),
        engine.generate(prompt, GREEDY))
    with pytest.raises(InvalidRequestError, match="adapters on the audio tower are not built"):
        await engine.generate(prompt, GREEDY, lora_request=LoRARequest("tower", 2, tower))
    peft = PeftModel.from_pretrained(Qwen3ASRForConditionalGeneration.from_pretrained(tiny_asr), decoder).eval()
    inputs = AutoProcessor.from_pretrained(tiny_asr)(text=[text], audio=[audio], sampling_rate=SAMPLING_RATE,
                                                     return_tensors="pt")
    with torch.no_grad():
        expected = peft.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert adapted.outputs[0].token_ids == expected.tolist() != base.outputs[0].token_ids
    assert base.outputs[0].token_ids == hf_qwen3_asr_greedy(tiny_asr, text, [audio], 8)[1]
