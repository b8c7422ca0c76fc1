"""Qwen2-Audio end to end (asyncllm/models/qwen2_audio.py, asyncllm/mm/audios.py, docs/multimodal.md#audio): greedy
tokens equal transformers' for prompts with one and two audios of different lengths, their placeholders split across
prefill chunks, batched; vLLM's ``multi_modal_data`` pairs, OpenAI's ``input_audio`` chat parts and encoded files
(resampled) give the same tokens as the waveforms they hold; a repeated audio hits the processor cache; bad audios
fail only their request."""

from __future__ import annotations

import asyncio
import base64

import pytest
import pytest_asyncio
from audio_utils import SAMPLING_RATE, hf_audio_greedy, make_audio, make_tiny_qwen2_audio, wav_bytes

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mm.audios import read_audio

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
MARK = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture(scope="module")
def tiny_audio(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_audio: str):
    engine = AsyncEngine(tiny_audio, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=4,
                         limit_mm_per_prompt={"audio": 2}, enable_lora=True)
    await engine.start()
    yield engine
    await engine.aclose()


async def test_one_and_two_audios_match_transformers_batched_and_chunked(engine, tiny_audio):
    one, two = [make_audio(1.3, seed=1)], [make_audio(2.7, seed=2), make_audio(0.6, seed=3)]
    texts = [f"Audio 1: {MARK} what is it?", f"First {MARK} then {MARK} compare"]
    outs = await asyncio.gather(*(engine.generate({"prompt": text, "multi_modal_data": {"audio": [
        (a, SAMPLING_RATE) for a in audios]}}, GREEDY) for text, audios in zip(texts, (one, two))))
    for out, text, audios in zip(outs, texts, (one, two)):
        prompt_ids, tokens = hf_audio_greedy(tiny_audio, text, audios, 8)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    ids = outs[0].prompt_token_ids
    assert ids.count(max(set(ids), key=ids.count)) == 32 > 16  # one audio's placeholders span several chunks


async def test_chat_input_audio_parts_and_files_give_the_waveforms_tokens(engine, tiny_audio):
    """An OpenAI ``input_audio`` part (base64 WAV at 8 kHz, resampled to 16 kHz): prompt and tokens equal
    transformers' for the waveform the file decodes to; the file given as bytes expands alike."""
    data = wav_bytes(make_audio(1.0, seed=4, rate=8000), rate=8000)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": "what is this?"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    waveform = read_audio(data, "test", SAMPLING_RATE).waveform
    assert waveform.shape == (SAMPLING_RATE,)  # one second, resampled
    text = f"<|user|>Audio 1: {MARK}what is this?<|eos|><|assistant|>"  # the template's rendering (no BOS)
    prompt_ids, hf_tokens = hf_audio_greedy(tiny_audio, text, [waveform], 8, add_special_tokens=False)
    assert stream.collector.prompt_token_ids == prompt_ids
    assert tokens == hf_tokens
    plain = await engine.generate({"prompt": text, "multi_modal_data": {"audio": data}}, GREEDY)  # the file itself
    assert plain.prompt_token_ids[1:] == prompt_ids  # after the BOS a text prompt gets


async def test_a_repeated_audio_hits_the_processor_cache(engine):
    audio = (make_audio(0.8, seed=5), SAMPLING_RATE)
    first = await engine.generate({"prompt": f"a {MARK}", "multi_modal_data": {"audio": audio}}, GREEDY)
    before = engine.stats()
    again = await engine.generate({"prompt": f"a {MARK}", "multi_modal_data": {"audio": audio}}, GREEDY)
    assert engine.stats().mm_cache_hits == before.mm_cache_hits + 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": f"a {MARK}", "audios": [[[0.1, 0.2], [0.3, 0.4]]]}, "1-D"),
    ({"prompt": f"a {MARK}", "audios": [(make_audio(0.5, seed=6), 0)]}, "sampling rate"),
    ({"prompt": f"a {MARK} {MARK}", "audios": [make_audio(0.5, seed=6)]}, "2 audio placeholder tokens"),
    ({"prompt": f"{MARK}{MARK}{MARK}", "audios": [make_audio(0.2, seed=i) for i in range(3)]}, "over limit_mm"),
    ({"prompt": f"a {MARK}", "audios": [b"not an audio file"]}, "could not be decoded"),
    ({"prompt": f"a {MARK}", "audios": [make_audio(0.02, seed=6)]},  # 20 ms: no encoder row, as vLLM refuses it
     r"prompt\.audios\[0\]: the audio \(len=320\) is too short to be represented"),
    ({"prompt": "a <image>", "images": [b"x"]}, "takes no images"),
])
async def test_bad_audios_fail_only_their_request(engine, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        await engine.generate(prompt, GREEDY)
    out = await engine.generate({"prompt": f"ok {MARK}", "audios": [make_audio(0.3, seed=7)]}, GREEDY)
    assert len(out.outputs[0].token_ids) == 8


async def test_a_too_short_audio_takes_no_processor_cache_slot(engine):
    """Refused before it is recorded: the same short audio again is a cache miss, refused alike."""
    short = {"prompt": f"a {MARK}", "audios": [make_audio(0.02, seed=9)]}
    before = engine.stats().mm_cache_hits
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="too short"):
            await engine.generate(short, GREEDY)
    assert engine.stats().mm_cache_hits == before


@pytest.mark.parametrize("fields", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
async def test_two_ranks_or_two_stages_give_transformers_tokens(tiny_audio, fields: dict):
    """Two tensor-parallel ranks (the encoder whole on each, the decoder split), or two pipeline stages (the encoder
    on the first, one decoder layer on each)."""
    audio = make_audio(1.9, seed=8)
    text = f"two ranks {MARK} hear"
    async with AsyncEngine(tiny_audio, disable_log_stats=True, max_num_batched_tokens=16, **fields) as split:
        out = await split.generate({"prompt": text, "audios": [(audio, SAMPLING_RATE)]}, GREEDY)
    assert out.outputs[0].token_ids == hf_audio_greedy(tiny_audio, text, [audio], 8)[1]


async def test_image_settings_on_an_audio_model_are_refused(tiny_audio):
    with pytest.raises(ConfigError, match="mm_processor_kwargs"):
        async with AsyncEngine(tiny_audio, mm_processor_kwargs={"max_pixels": 100}, disable_log_stats=True):
            pass


async def test_openai_chat_completions_take_input_audio_and_audio_url_parts(engine, tiny_audio):
    """The OpenAI server: an ``input_audio`` part and vLLM's ``audio_url`` (a data: URL) give the engine's tokens."""
    from asgi_helpers import asgi_client

    from asyncllm.integrations.openai_server import create_app

    data = base64.b64encode(wav_bytes(make_audio(0.7, seed=9))).decode()
    parts = [[{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}],
             [{"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{data}"}}]]
    texts = []
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        for part in parts:
            body = {"model": tiny_audio, "max_tokens": 8, "temperature": 0.0,
                    "messages": [{"role": "user", "content": [*part, {"type": "text", "text": "which?"}]}]}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["message"]["content"])
    messages = [{"role": "user", "content": [{"type": "audio", "audio": base64.b64decode(data)},
                                             {"type": "text", "text": "which?"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    assert texts == [engine.tokenizer.decode(tokens, skip_special_tokens=True)] * 2


async def test_lora_adapters_on_the_decoder_equal_peft_and_tower_adapters_are_refused(engine, tiny_audio, tmp_path):
    """PEFT's adapter of the language model's q / v / down projections (``model.language_model.layers...``), batched
    with the base model: PEFT's tokens and transformers'; one that also adapts the audio tower is refused."""
    import torch
    from lora_utils import make_adapter
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from asyncllm import LoRARequest

    decoder = make_adapter(tiny_audio, str(tmp_path / "decoder"), seed=3, rank=4, alpha=8,
                           targets=r".*language_model.*\.(q_proj|v_proj|down_proj)",
                           auto_class=Qwen2AudioForConditionalGeneration)
    tower = make_adapter(tiny_audio, str(tmp_path / "tower"), seed=3, rank=4, targets=["q_proj"],
                         auto_class=Qwen2AudioForConditionalGeneration)
    audio, text = make_audio(1.5, seed=3), f"x {MARK} y"
    prompt = {"prompt": text, "audios": [(audio, SAMPLING_RATE)]}
    adapted, base = await asyncio.gather(
        engine.generate(prompt, GREEDY, lora_request=LoRARequest("decoder", 1, decoder)),
        engine.generate(prompt, GREEDY))
    with pytest.raises(InvalidRequestError, match="adapters on the audio tower are not built"):
        await engine.generate(prompt, GREEDY, lora_request=LoRARequest("tower", 2, tower))
    peft = PeftModel.from_pretrained(Qwen2AudioForConditionalGeneration.from_pretrained(tiny_audio), decoder).eval()
    inputs = AutoProcessor.from_pretrained(tiny_audio)(text=text, audio=[audio], sampling_rate=SAMPLING_RATE,
                                                       return_tensors="pt")
    with torch.no_grad():
        expected = peft.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert adapted.outputs[0].token_ids == expected.tolist() != base.outputs[0].token_ids
    assert base.outputs[0].token_ids == hf_audio_greedy(tiny_audio, text, [audio], 8)[1]
