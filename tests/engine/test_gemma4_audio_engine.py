"""Gemma 4 with audio end to end (asyncllm/models/gemma4_audio.py, gemma4_mm.py; docs/multimodal.md#gemma-4): each
audio token becomes ``<|audio>``, a row per real frame the tower keeps, ``<audio|>``; prompt ids and greedy tokens
equal transformers' for one and two audios of different lengths (padded to the longest there, one by one here),
batched, their rows split across 16-token prefill chunks, an image beside an audio, a chat audio part, over two
tensor-parallel ranks and two pipeline stages; ``limit_mm_per_prompt["audio"]`` bounds a prompt's audios."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from audio_utils import SAMPLING_RATE, make_audio
from gemma4_audio_utils import AUDIO, BOA, hf_gemma4_audio_greedy, make_tiny_gemma4_audio
from gemma4_mm_utils import IMAGE, make_tiny_gemma4_mm
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_gemma4_audio(tmp_path_factory.mktemp("gemma4_audio"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(gemma4: str):
    engine = AsyncEngine(gemma4, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=4, block_size=4,
                         limit_mm_per_prompt={"audio": 2})
    await engine.start()
    yield engine
    await engine.aclose()


async def test_one_and_two_audios_match_transformers_batched_and_chunked(engine, gemma4):
    one, two = [make_audio(1.3, seed=1)], [make_audio(2.1, seed=2), make_audio(0.7, seed=3)]
    texts = [f"listen {AUDIO} what is it?", f"first {AUDIO} then {AUDIO} compare"]
    outs = await asyncio.gather(*(engine.generate({"prompt": text, "multi_modal_data": {"audio": [
        (a, SAMPLING_RATE) for a in audios]}}, GREEDY) for text, audios in zip(texts, (one, two))))
    audio_id = engine.tokenizer.convert_tokens_to_ids(AUDIO)
    for out, text, audios in zip(outs, texts, (one, two)):
        prompt_ids, tokens = hf_gemma4_audio_greedy(gemma4, text, audios, 8)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    assert outs[0].prompt_token_ids.count(audio_id) == 33 > 16  # 1.3 s: 130 frames, 33 rows over three chunks
    assert outs[1].prompt_token_ids.count(audio_id) == 53 + 18
    assert outs[1].prompt_token_ids.count(engine.tokenizer.convert_tokens_to_ids(BOA)) == 2


async def test_a_chat_audio_part_and_the_limit(engine, gemma4):
    """A chat ``audio`` part renders as ``<|audio|>`` (the template's) and expands as a prompt's; three audios are
    over ``limit_mm_per_prompt["audio"]=2``, an audio too short for a row is refused: each fails its request only."""
    audio = make_audio(0.9, seed=4)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": (audio, SAMPLING_RATE)},
                                             {"type": "text", "text": "what is this?"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    text = f"<|turn>user\n{AUDIO}what is this?<turn|>\n<|turn>model\n"
    assert (stream.collector.prompt_token_ids, tokens) == hf_gemma4_audio_greedy(gemma4, text, [audio], 8,
                                                                                 add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="over limit_mm"):
        await engine.generate({"prompt": AUDIO * 3, "audios": [make_audio(0.2, seed=i) for i in range(3)]}, GREEDY)
    with pytest.raises(InvalidRequestError, match="too short"):  # 6 ms: no whole 20 ms frame, no row
        await engine.generate({"prompt": AUDIO, "audios": [make_audio(0.006, seed=5)]}, GREEDY)
    assert len((await engine.generate({"prompt": AUDIO, "audios": [audio]}, GREEDY)).outputs[0].token_ids) == 8


async def test_an_image_beside_an_audio_matches_transformers(gemma4):
    """An image (its rows both ways in the sliding layers, whole in an 80-token chunk) and an audio (causal)."""
    image, audio = make_image(40, 28, seed=5), make_audio(1.1, seed=6)
    text = f"see {IMAGE} and hear {AUDIO} then say"
    async with AsyncEngine(gemma4, disable_log_stats=True, block_size=4, max_num_batched_tokens=80) as engine:
        out = await engine.generate({"prompt": text, "images": [image], "audios": [audio]}, GREEDY)
    prompt_ids, tokens = hf_gemma4_audio_greedy(gemma4, text, [audio], 8, images=[image])
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == tokens


@pytest.mark.parametrize("fields", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
async def test_two_ranks_or_two_stages_give_transformers_tokens(tmp_path, fields: dict, monkeypatch):
    """Two tensor-parallel ranks (the towers whole on each, the decoder split), or two stages split 1 + 3 (the
    towers on the first; the decoder's layer 3 shares layer 1's cache)."""
    if "pipeline_parallel_size" in fields:  # (a partition with one stage is refused, as vLLM's)
        monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "1,3")
    path = make_tiny_gemma4_audio(tmp_path / "gemma4", num_kv_shared_layers=1)
    audios = [make_audio(1.6, seed=7), make_audio(0.5, seed=8)]
    text = f"two ranks {AUDIO} and {AUDIO} hear"
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=16, block_size=4, **fields) as split:
        out = await split.generate({"prompt": text, "audios": audios}, GREEDY)
    assert out.outputs[0].token_ids == hf_gemma4_audio_greedy(path, text, audios, 8)[1]


async def test_an_audio_limit_without_a_tower_is_refused(tmp_path):
    """An audio limit on a checkpoint without an audio tower is a `ConfigError` (LoRA on the decoder with the towers:
    tests/unit/test_lora_models.py)."""
    vision_only = make_tiny_gemma4_mm(tmp_path / "vision_only")
    with pytest.raises(ConfigError, match="no audio tower"):
        async with AsyncEngine(vision_only, limit_mm_per_prompt={"audio": 1}, disable_log_stats=True):
            pass
