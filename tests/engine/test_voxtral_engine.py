"""Voxtral end to end (asyncllm/models/voxtral.py, docs/multimodal.md#voxtral): prompt ids and greedy tokens equal
transformers' for one audio and for two (one past 30 s: two windows) in one prompt, batched, their placeholders split
across prefill chunks; a repeated audio reuses the prefix cache past its placeholders and another audio of the same
length does not; a chat audio part; two tensor-parallel ranks and two pipeline stages; a decoder LoRA adapter equals
PEFT's and a tower adapter is refused; the speech-to-text route refuses Voxtral."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from audio_utils import SAMPLING_RATE, make_audio
from voxtral_utils import AUDIO, MARK, WINDOW_ROWS, hf_voxtral_greedy, hf_voxtral_inputs, make_tiny_voxtral

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_voxtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_voxtral(tmp_path_factory.mktemp("voxtral"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_voxtral: str):
    engine = AsyncEngine(tiny_voxtral, disable_log_stats=True, max_num_batched_tokens=256, max_num_seqs=4,
                         limit_mm_per_prompt={"audio": 2}, max_model_len=2048, enable_lora=True)
    await engine.start()
    yield engine
    await engine.aclose()


async def test_one_and_two_audios_match_transformers_batched_and_chunked(engine, tiny_voxtral):
    one, two = [make_audio(1.3, seed=1)], [make_audio(31.0, seed=2), make_audio(0.6, seed=3)]
    texts = [f"Audio: {MARK} what is it?", f"First {MARK} then {MARK} compare"]
    outs = await asyncio.gather(*(engine.generate({"prompt": text, "multi_modal_data": {"audio": [
        (a, SAMPLING_RATE) for a in audios]}}, GREEDY) for text, audios in zip(texts, (one, two))))
    for out, text, audios in zip(outs, texts, (one, two)):
        prompt_ids, tokens = hf_voxtral_greedy(tiny_voxtral, text, audios, 8)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    audio_id = engine.tokenizer.convert_tokens_to_ids(AUDIO)
    assert outs[0].prompt_token_ids.count(audio_id) == WINDOW_ROWS > 256  # split across two prefill chunks
    assert outs[1].prompt_token_ids.count(audio_id) == 3 * WINDOW_ROWS  # 31 s: two windows, then 0.6 s: one


async def test_a_repeated_audio_hits_the_prefix_cache_and_another_does_not(engine, tiny_voxtral):
    first, other = make_audio(2.0, seed=11), make_audio(2.0, seed=12)
    text = f"again {MARK} and again"
    prompt = {"prompt": text, "audios": [(first, SAMPLING_RATE)]}
    expected = hf_voxtral_greedy(tiny_voxtral, text, [first], 8)
    assert (await engine.generate(prompt, GREEDY)).outputs[0].token_ids == expected[1]
    again = await engine.generate(prompt, GREEDY)
    assert again.outputs[0].token_ids == expected[1]
    start = again.prompt_token_ids.index(engine.tokenizer.convert_tokens_to_ids(AUDIO))
    assert again.num_cached_tokens > start + WINDOW_ROWS - 16  # past the audio's placeholders
    changed = await engine.generate({"prompt": text, "audios": [(other, SAMPLING_RATE)]}, GREEDY)
    assert changed.num_cached_tokens <= start  # another audio: nothing from its placeholders on
    assert changed.outputs[0].token_ids == hf_voxtral_greedy(tiny_voxtral, text, [other], 8)[1]


async def test_chat_audio_part_renders_the_mark(engine, tiny_voxtral):
    audio = make_audio(0.8, seed=4)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (audio, SAMPLING_RATE)},
                                             {"type": "text", "text": "what?"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    text = f"<|user|>{MARK}what?<|eos|><|assistant|>"  # the template's rendering (no BOS)
    prompt_ids, hf_tokens = hf_voxtral_greedy(tiny_voxtral, text, [audio], 8, add_special_tokens=False)
    assert stream.collector.prompt_token_ids == prompt_ids
    assert tokens == hf_tokens


async def test_transcription_is_refused(engine):
    """``engine.transcribe`` and the OpenAI speech-to-text routes (integrations/openai_audio.py: a 400) refuse an
    engine without ``speech_to_text``."""
    assert engine.speech_to_text is None
    with pytest.raises(InvalidRequestError, match="does not transcribe"):
        async for _ in engine.transcribe((make_audio(0.5, seed=5), SAMPLING_RATE)):
            pass


@pytest.mark.parametrize("fields", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
async def test_two_ranks_or_two_stages_give_transformers_tokens(tiny_voxtral, fields: dict):
    """Two tensor-parallel ranks (the encoder whole on each, the decoder split), or two pipeline stages (the encoder
    on the first, one decoder layer on each)."""
    audio = make_audio(1.9, seed=8)
    text = f"two ranks {MARK} hear"
    async with AsyncEngine(tiny_voxtral, disable_log_stats=True, max_num_batched_tokens=256, **fields) as split:
        out = await split.generate({"prompt": text, "audios": [(audio, SAMPLING_RATE)]}, GREEDY)
    assert out.outputs[0].token_ids == hf_voxtral_greedy(tiny_voxtral, text, [audio], 8)[1]


async def test_lora_adapters_on_the_decoder_equal_peft_and_tower_adapters_are_refused(engine, tiny_voxtral, tmp_path):
    import torch
    from lora_utils import make_adapter
    from peft import PeftModel
    from transformers import VoxtralForConditionalGeneration as HFVoxtral

    from asyncllm import LoRARequest

    decoder = make_adapter(tiny_voxtral, str(tmp_path / "decoder"), seed=3, rank=4, alpha=8,
                           targets=r".*language_model.*\.(q_proj|v_proj|down_proj)", auto_class=HFVoxtral)
    tower = make_adapter(tiny_voxtral, str(tmp_path / "tower"), seed=3, rank=4, targets=r".*audio_tower.*\.q_proj",
                         auto_class=HFVoxtral)
    audio, text = make_audio(1.5, seed=3), f"x {MARK} y"
    prompt = {"prompt": text, "audios": [(audio, SAMPLING_RATE)]}
    adapted, base = await asyncio.gather(
        engine.generate(prompt, GREEDY, lora_request=LoRARequest("decoder", 1, decoder)),
        engine.generate(prompt, GREEDY))
    with pytest.raises(InvalidRequestError, match="adapters on the audio tower are not built"):
        await engine.generate(prompt, GREEDY, lora_request=LoRARequest("tower", 2, tower))
    peft = PeftModel.from_pretrained(HFVoxtral.from_pretrained(tiny_voxtral), decoder).eval()
    inputs = hf_voxtral_inputs(tiny_voxtral, text, [audio])
    with torch.no_grad():
        expected = peft.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert adapted.outputs[0].token_ids == expected.tolist() != base.outputs[0].token_ids
