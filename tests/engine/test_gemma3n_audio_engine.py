"""Gemma 3n with audio end to end (asyncllm/models/gemma3n_mm.py, gemma3n_audio.py; docs/multimodal.md#gemma-3n):
each ``<audio_soft_token>`` becomes ``"\\n\\n<start_of_audio>"``, ``audio_soft_tokens_per_image`` audio tokens,
``"<end_of_audio>\\n\\n"``; prompt ids and greedy tokens equal transformers' for an audio prompt batched with a text
prompt (the audio's rows split across 16-token prefill chunks), a text prompt holding a token of the vision
embedder's range, and the audio prompt again from the prefix cache. The audio rows (tower, embedder, padding rows)
and a prompt's logits equal transformers' within float32 noise. Images are refused by name.

The reference is transformers' own ``Gemma3nForConditionalGeneration`` and ``Gemma3nProcessor``; transformers needs
timm to build the model's MobileNetV5 vision tower, so tests/gemma3n_audio_utils.py builds it with that tower an
empty module (no audio or text prompt runs it; everything else is transformers' code and the checkpoint's weights).
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from audio_utils import SAMPLING_RATE, make_audio
from gemma3n_audio_utils import (AUDIO, SOFT_TOKENS, hf_gemma3n, hf_gemma3n_greedy, hf_gemma3n_inputs,
                                 make_tiny_gemma3n_audio)
from mm_utils import make_image
from model_utils import make_attn_metadata

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.models.gemma3n import Gemma3nTextOnly
from asyncllm.models.gemma3n_mm import Gemma3nForConditionalGeneration
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import get_model_class, kv_cache_spec

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_gemma3n_audio(tmp_path_factory.mktemp("gemma3n_audio"))


@pytest.fixture(scope="module")
def hf(gemma3n: str):
    return hf_gemma3n(gemma3n)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(gemma3n: str):
    engine = AsyncEngine(gemma3n, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    await engine.start()
    yield engine
    await engine.aclose()


def _audio_prompt(text: str, audio) -> dict:
    return {"prompt": text, "multi_modal_data": {"audio": [(audio, SAMPLING_RATE)]}}


async def test_audio_and_text_prompts_match_transformers_then_a_prefix_hit(engine, gemma3n, hf):
    """A text prompt alone (its ``<end_of_image>`` embedded by the vision embedder in the decoder's own embedding
    step), then batched with an audio prompt (the step's embeddings made with the audio rows'), then the audio prompt
    again (its audio rows' blocks from the prefix cache)."""
    text = "look <end_of_image> and say"
    out = await engine.generate(text, GREEDY)
    expected_text = hf_gemma3n_greedy(hf, gemma3n, text, [], 8)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected_text
    audio = make_audio(1.3, seed=1)
    prompt = _audio_prompt(f"listen {AUDIO} what is it?", audio)
    outs = await asyncio.gather(engine.generate(prompt, GREEDY), engine.generate(text, GREEDY))
    expected = [hf_gemma3n_greedy(hf, gemma3n, prompt["prompt"], [audio], 8), expected_text]
    for out, (prompt_ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    assert outs[0].prompt_token_ids.count(engine.tokenizer.convert_tokens_to_ids(AUDIO)) == SOFT_TOKENS
    again = await engine.generate(prompt, GREEDY)
    assert again.num_cached_tokens >= 20 and again.outputs[0].token_ids == expected[0][1]


async def test_audio_rows_and_logits_equal_transformers(gemma3n, hf):
    """Our loaded model's rows for a 1.6 s audio (40 subsampled frames over ten 4-frame attention chunks, 10 rows,
    2 of padding) equal transformers' ``get_audio_features`` rows and its padding row (``embed_audio`` of the
    vocabulary's last id); the logits of the whole prompt (the rows in place, their per-layer inputs, the audio
    embedder's ``<end_of_audio>``) equal its forward's."""
    model = load_model(EngineConfig.create(gemma3n), load_hf_config(gemma3n), torch.device("cpu"), torch.float32)
    assert type(model) is Gemma3nForConditionalGeneration
    inputs = hf_gemma3n_inputs(gemma3n, f"hear {AUDIO} now", [make_audio(1.6, seed=2)])
    features, mask = inputs["input_features"], inputs["input_features_mask"]
    values = torch.cat([features, mask[..., None].float()], dim=-1)
    with torch.no_grad():
        rows = model.embed_multimodal(values[None])[0]
        theirs = hf.model.get_audio_features(features, ~mask, return_dict=True)
        padding = hf.model.embed_audio(input_ids=torch.tensor([[hf.config.text_config.vocab_size - 1]]))[0, 0]
        expected_logits = hf(**inputs).logits[0]
    assert rows.shape == (SOFT_TOKENS, hf.config.text_config.hidden_size)
    assert theirs.pooler_output.shape[1] == 10 and not theirs.audio_mel_mask.any()
    torch.testing.assert_close(rows[:10], theirs.pooler_output[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(rows[10:], padding.expand(2, -1), rtol=0, atol=2e-5)
    ids = inputs["input_ids"][0]
    embeds = model.embed_input_ids(ids)
    embeds[ids == hf.config.audio_token_id] = rows
    torch.testing.assert_close(_logits(model, gemma3n, ids, embeds), expected_logits, rtol=0, atol=1e-4)


def _logits(model, path: str, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Our model's logits for one whole prompt (``embeds``: its input embeddings) in one step."""
    blocks = list(range(1, -(-len(ids) // 4) + 1))
    metadata, positions = make_attn_metadata([0], [len(ids)], [blocks], 4)
    caches = kv_cache_spec(load_hf_config(path), 1).allocate(len(blocks) + 1, 4, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, caches, metadata, embeds))


async def test_images_and_audios_out_of_range_are_refused(engine, gemma3n):
    """An image fails its request naming the vision tower (an image limit is a `NotBuiltError` naming it, before
    anything starts); an audio too long for the audio tokens or too short for one frame fails its request only. With
    ``limit_mm_per_prompt={"image": 0}`` the checkpoint serves its language model alone."""
    with pytest.raises(InvalidRequestError, match="images: 1 images, but Gemma 3n's vision tower .MobileNetV5"):
        await engine.generate({"prompt": "see <start_of_image>", "images": [make_image(32, 32, seed=1)]}, GREEDY)
    with pytest.raises(NotBuiltError, match="limit_mm_per_prompt.image=1 .* vision tower .MobileNetV5"):
        await AsyncEngine(gemma3n, limit_mm_per_prompt={"image": 1}, disable_log_stats=True).start()
    with pytest.raises(InvalidRequestError, match="too long: 13 rows"):  # 2.1 s: 208 frames, 13 rows
        await engine.generate(_audio_prompt(AUDIO, make_audio(2.1, seed=3)), GREEDY)
    with pytest.raises(InvalidRequestError, match="too short"):  # 20 ms: under one 32 ms frame
        await engine.generate(_audio_prompt(AUDIO, make_audio(0.02, seed=4)), GREEDY)
    one = SamplingParams(max_tokens=1)
    assert len((await engine.generate(_audio_prompt(AUDIO, make_audio(0.4, seed=5)), one)).outputs[0].token_ids) == 1
    assert get_model_class(load_hf_config(gemma3n), {"image": 0}) is Gemma3nTextOnly
