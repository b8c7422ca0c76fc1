"""Qwen3-Omni's thinker end to end (asyncllm/models/qwen3_omni.py, docs/multimodal.md#qwen3-omni): greedy tokens equal
transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` for an image prompt (deepstack), an audio prompt (its
encoder's chunks of 100 frames, the last of 37 zero-padded), a prompt with both (a shorter-than-a-chunk audio) and a
text prompt, batched and split over 16-token prefill chunks, and again on a prefix-cache hit; a video beside an
audio (time positions from position_id_per_seconds); a video with its audio track (``use_audio_in_video``: merged
token by token in time order) over prefill chunks and on a prefix-cache hit; each audio's encoder rows equal
transformers'; the full ``Qwen3OmniMoeForConditionalGeneration`` layout loads the same thinker, its talker and
code2wav skipped; speech out is refused by name, and a video with its audio whose time positions are fractional."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from audio_utils import SAMPLING_RATE, make_audio
from mm_utils import make_image
from qwen3_omni_utils import (
    AUDIO_MARK, IMAGE_MARK, VIDEO_MARK, hf_omni3_greedy, make_full_omni3_layout, make_tiny_qwen3_omni,
)
from qwen_vl_utils import make_video, video_patches_of

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError, NotBuiltError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
IMAGE, AUDIO, SHORT_AUDIO = make_image(90, 60, seed=3), make_audio(2.37, seed=2), make_audio(0.62, seed=3)
CASES = [(f"Look {IMAGE_MARK} at it", [IMAGE], []), (f"hear {AUDIO_MARK} ok", [], [AUDIO]),
         (f"see {IMAGE_MARK} hear {AUDIO_MARK} both", [IMAGE], [SHORT_AUDIO]), ("just text here", [], [])]
"""The short audio (62 frames: 31 rows after the first convolution, an odd count) is one chunk of its own length, unpadded, as transformers encodes it alone."""


@pytest.fixture(scope="module")
def tiny_omni3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_omni3: str):
    engine = AsyncEngine(tiny_omni3, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=4)
    await engine.start()
    yield engine
    await engine.aclose()


def _prompt(text: str, images: list, audios: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images, "audio": [(a, SAMPLING_RATE) for a in audios]}}


async def test_image_audio_and_text_prompts_match_transformers_and_on_a_prefix_cache_hit(engine, tiny_omni3):
    expected = [hf_omni3_greedy(tiny_omni3, text, images, audios, 8) for text, images, audios in CASES]
    outs = await asyncio.gather(*(engine.generate(_prompt(*case), GREEDY) for case in CASES))
    for out, (prompt_ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    audio_pad = engine.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert outs[1].prompt_token_ids.count(audio_pad) == 31  # 237 frames: 13 + 13 + 5 rows
    before = engine.stats().prefix_cache_hits
    again = await engine.generate(_prompt(*CASES[2]), GREEDY)
    assert engine.stats().prefix_cache_hits > before
    assert again.outputs[0].token_ids == expected[2][1]


async def test_a_video_beside_an_audio_matches_transformers(engine, tiny_omni3):
    """0.5 fps: 4 seconds a temporal patch, 52 positions apart on the time axis (position_id_per_seconds 13), so
    the audio and text after the video start past its time axis; the video's deepstack rows join the decoder."""
    video = (make_video(5, 100, 80, seed=3), {"fps": 0.5})
    text = f"watch {VIDEO_MARK} hear {AUDIO_MARK} now"
    out = await engine.generate({"prompt": text, "videos": [video], "audios": [(AUDIO, SAMPLING_RATE)]}, GREEDY)
    patches = video_patches_of(tiny_omni3, video)
    prompt_ids, tokens = hf_omni3_greedy(tiny_omni3, text, [], [AUDIO], 8, [patches], [4.0])
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == tokens


async def test_a_video_with_its_audio_matches_transformers_over_prefill_chunks_and_on_a_prefix_cache_hit(
        engine, tiny_omni3):
    """2 fps: temporal patches 13 time positions apart, an audio row one; with a 2.37 s track (31 rows) the video's
    patches and the audio's rows alternate, ending in audio; with a 0.62 s one (8 rows) the video's last two patches
    follow the audio. Both prompts batched over 16-token prefill chunks (alone, the first's second and third video
    runs would straddle a chunk's end), then the first again from the prefix cache."""
    video = (make_video(6, 64, 64, seed=4), {"fps": 2.0})
    text = f"now watch this {VIDEO_MARK} now"
    patches = video_patches_of(tiny_omni3, video)
    expected = [hf_omni3_greedy(tiny_omni3, text, [], [audio], 8, [patches], [1.0], audio_in_video=True)
                for audio in (AUDIO, SHORT_AUDIO)]

    def prompt(audio):
        return {"prompt": text, "videos": [video], "audios": [(audio, SAMPLING_RATE)],
                "mm_processor_kwargs": {"use_audio_in_video": True}}

    outs = await asyncio.gather(*(engine.generate(prompt(audio), GREEDY) for audio in (AUDIO, SHORT_AUDIO)))
    for out, (prompt_ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    pads = engine.tokenizer.convert_tokens_to_ids(["<|video_pad|>", "<|audio_pad|>"])
    kinds = [token == pads[0] for token in outs[0].prompt_token_ids if token in pads]
    assert sum(a != b for a, b in zip(kinds, kinds[1:])) == 5  # video, audio, video, audio, video, audio
    before = engine.stats().prefix_cache_hits
    again = await engine.generate(prompt(AUDIO), GREEDY)
    assert engine.stats().prefix_cache_hits > before
    assert again.outputs[0].token_ids == expected[0][1]


async def test_the_full_checkpoint_layout_loads_the_same_thinker_whose_audio_rows_equal_transformers(tiny_omni3,
                                                                                                    tmp_path):
    """``thinker.*`` weights, the talker's and code2wav's skipped unread; the config's ``thinker_config`` served. Each
    audio's encoder rows equal transformers' ``get_audio_features`` (the short one's differ by up to 0.07 if padded to
    a whole chunk, which greedy tokens need not show), zeros in their deepstack columns."""
    from qwen3_omni_utils import audio_features, hf_thinker3

    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_hf_config, load_model

    full = make_full_omni3_layout(tiny_omni3, tmp_path / "full")
    models = [load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
              for path in (tiny_omni3, full)]
    assert load_hf_config(full).architectures == ["Qwen3OmniMoeForConditionalGeneration"]
    states = [model.state_dict() for model in models]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    for audio, rows in ((SHORT_AUDIO, 8), (AUDIO, 31)):
        features = audio_features(tiny_omni3, [audio])
        with torch.no_grad():
            got = models[1].embed_multimodal(torch.from_numpy(models[1].mm_audio_values(features)[None]))[0]
            want = hf_thinker3(tiny_omni3).get_audio_features(
                torch.from_numpy(features["input_features"]), torch.from_numpy(features["attention_mask"]))
        assert got.shape == (rows, 64 * 3)  # the decoder's width, then two deepstack layers' zeros
        torch.testing.assert_close(got[:, :64], want.last_hidden_state, atol=1e-5, rtol=0)
        assert not got[:, 64:].any()


async def test_speech_out_and_fractional_time_positions_with_audio_are_not_built(engine, tiny_omni3):
    """``enable_audio_output`` set over the thinker's config (``hf_overrides``) is refused by name; so is a 4 fps
    video with its audio (temporal patches 6.5 time positions apart, which transformers keeps as floats), and a
    ``use_audio_in_video`` that is not a bool."""
    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import build_model, load_hf_config

    video = (make_video(4, 64, 64, seed=4), {"fps": 4.0})
    with_audio = {"prompt": f"watch {VIDEO_MARK} now", "videos": [video], "audios": [(SHORT_AUDIO, SAMPLING_RATE)],
                  "mm_processor_kwargs": {"use_audio_in_video": True}}
    with pytest.raises(InvalidRequestError, match="fractional positions are not built"):
        await engine.generate(with_audio, GREEDY)
    with pytest.raises(InvalidRequestError, match="use_audio_in_video"):
        await engine.generate({**with_audio, "mm_processor_kwargs": {"use_audio_in_video": "yes"}}, GREEDY)
    hf_config = load_hf_config(tiny_omni3)
    hf_config.enable_audio_output = True
    with pytest.raises(NotBuiltError, match="enable_audio_output"):
        build_model(EngineConfig.create(tiny_omni3), hf_config, torch.device("cpu"), torch.float32)
