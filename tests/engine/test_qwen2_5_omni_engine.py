"""Qwen2.5-Omni's thinker end to end (asyncllm/models/qwen2_5_omni.py, docs/multimodal.md#qwen25-omni): greedy tokens
equal transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` for an image prompt, an audio prompt (its encoder's
chunks of 40 frames, the last of 13), a prompt with both and a text prompt, batched and split over 16-token prefill
chunks, and again on a prefix-cache hit; a video beside an audio (time positions from position_id_per_seconds); the
encoder's rows equal transformers'; a video with its audio track (``use_audio_in_video``: interleaved by 2 s chunks,
the request's or the engine's setting) equals transformers' over prefill chunks and on a prefix-cache hit; the full
``Qwen2_5OmniForConditionalGeneration`` layout loads the same thinker, its talker and token2wav skipped; speech out
and decoding a video file's audio are refused by name."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from audio_utils import SAMPLING_RATE, make_audio
from mm_utils import make_image, sent_requests
from qwen2_5_omni_utils import (
    AUDIO_MARK, IMAGE_MARK, VIDEO_MARK, hf_omni_greedy, hf_thinker, make_full_omni_layout, make_tiny_qwen2_5_omni,
)
from qwen_vl_utils import make_video, video_patches_of

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
IMAGE, AUDIO = make_image(90, 60, seed=1), make_audio(1.33, seed=2)
CASES = [(f"Look {IMAGE_MARK} at it", [IMAGE], []), (f"hear {AUDIO_MARK} ok", [], [AUDIO]),
         (f"see {IMAGE_MARK} hear {AUDIO_MARK} both", [IMAGE], [AUDIO]), ("just text here", [], [])]


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen2_5_omni(tmp_path_factory.mktemp("qwen2_5_omni"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_omni: str):
    engine = AsyncEngine(tiny_omni, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=4)
    await engine.start()
    yield engine
    await engine.aclose()


def _prompt(text: str, images: list, audios: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images, "audio": [(a, SAMPLING_RATE) for a in audios]}}


async def test_image_audio_and_text_prompts_match_transformers_and_on_a_prefix_cache_hit(engine, tiny_omni):
    expected = [hf_omni_greedy(tiny_omni, text, images, audios, 8) for text, images, audios in CASES]
    outs = await asyncio.gather(*(engine.generate(_prompt(*case), GREEDY) for case in CASES))
    for out, (prompt_ids, tokens) in zip(outs, expected):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    audio_pad = engine.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert outs[1].prompt_token_ids.count(audio_pad) == 33 > 16  # 133 frames: chunks of 40, 40, 40, 13 (odd)
    before = engine.stats().prefix_cache_hits
    again = await engine.generate(_prompt(*CASES[2]), GREEDY)
    assert engine.stats().prefix_cache_hits > before
    assert again.outputs[0].token_ids == expected[2][1]


async def test_a_video_beside_an_audio_matches_transformers(engine, tiny_omni):
    """0.5 fps: 4 seconds a temporal patch, 100 positions apart on the time axis (position_id_per_seconds 25), so
    the audio and text after the video start past its time axis."""
    video = (make_video(5, 100, 80, seed=3), {"fps": 0.5})
    text = f"watch {VIDEO_MARK} hear {AUDIO_MARK} now"
    out = await engine.generate({"prompt": text, "videos": [video], "audios": [(AUDIO, SAMPLING_RATE)]}, GREEDY)
    prompt_ids, tokens = hf_omni_greedy(tiny_omni, text, [], [AUDIO], 8, [video_patches_of(tiny_omni, video)], [4.0])
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == tokens


async def test_a_video_with_its_audio_matches_transformers_and_on_a_prefix_cache_hit(engine, tiny_omni):
    """``use_audio_in_video``: at 2 fps (two chunks of two temporal patches, the second reaching past the audio's
    last chunk: decoding goes on from the last prompt position) and at 0.5 fps (patches 100 positions apart: one-token
    video chunks), the audio's 62 rows in chunks of 50; each video and audio encoded once. The engine-wide setting
    lays the prompt out the same."""
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.mm.inputs import MultiModalInputs

    audio = make_audio(2.5, seed=4)
    text = f"watch {VIDEO_MARK} now"
    cases = [((make_video(8, 100, 80, seed=3), {"fps": 2.0}), 1.0), ((make_video(5, 100, 80, seed=5), {"fps": 0.5}), 4.0)]
    requests = [{"prompt": text, "videos": [video], "audios": [(audio, SAMPLING_RATE)],
                 "mm_processor_kwargs": {"use_audio_in_video": True}} for video, _ in cases]
    outs = await asyncio.gather(*(engine.generate(request, GREEDY) for request in requests))
    for out, (video, seconds) in zip(outs, cases):
        want = hf_omni_greedy(tiny_omni, text, [], [audio], 8, [video_patches_of(tiny_omni, video)], [seconds], True)
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == want
    before = engine.stats().prefix_cache_hits
    again = await engine.generate(requests[0], GREEDY)
    assert engine.stats().prefix_cache_hits > before
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    mm = prepare(EngineConfig.create(tiny_omni, mm_processor_kwargs={"use_audio_in_video": True})).mm
    token_ids = mm.encode_text(text, 0)
    wide = mm.process(token_ids, MultiModalInputs(videos=[cases[0][0]], audios=[(audio, SAMPLING_RATE)]), "images")
    assert wide.token_ids == outs[0].prompt_token_ids
    carried = [item.data is not None or item.shm_offset >= 0 for item in wide.items]
    assert carried == [item.rows[0] == 0 for item in wide.items] and carried.count(True) == 2  # the first pieces


async def test_a_video_with_its_audio_is_resent_in_its_own_layout_after_a_cache_miss(engine, tiny_omni):
    """A request's own ``use_audio_in_video`` survives the resend after a processor-cache miss (drift: the host's half
    lists items the core's lacks): the items come again with their data, laid over the same placeholders."""
    from asyncllm.mm.inputs import MultiModalInputs

    video, audio, text = (make_video(8, 100, 80, seed=7), {"fps": 2.0}), make_audio(2.5, seed=6), f"watch {VIDEO_MARK} now"
    own = {"use_audio_in_video": True}
    request = {"prompt": text, "videos": [video], "audios": [(audio, SAMPLING_RATE)], "mm_processor_kwargs": own}
    mm, sent = engine._processor._mm, sent_requests(engine)  # type: ignore[union-attr]
    laid = mm.process(mm.encode_text(text, 0), MultiModalInputs(videos=[video], audios=[(audio, SAMPLING_RATE)]),
                      "prompt.images", dict(own))  # recorded in the host's half only
    out = await engine.generate(request, GREEDY)
    (miss, _), (resent, _) = sent[-2:]
    assert miss.request_id == resent.request_id

    def layout(items):
        return [(item.mm_hash, item.offset, item.length, item.rows) for item in items]

    assert layout(resent.mm_items) == layout(miss.mm_items) == layout(laid.items)
    assert [item.data is None for item in miss.mm_items] == [True] * len(laid.items)
    assert sum(item.data is not None for item in resent.mm_items) == 2  # the video's and the audio's first pieces
    want = hf_omni_greedy(tiny_omni, text, [], [audio], 8, [video_patches_of(tiny_omni, video)], [1.0], True)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == want


async def test_the_full_checkpoint_layout_loads_the_same_thinker_whose_audio_rows_equal_transformers(tiny_omni, tmp_path):
    """``thinker.*`` weights, the talker's and token2wav's skipped unread; the config's ``thinker_config`` served. Two
    audios in one encoder call (the second's last chunk of 15 frames: its padded frames zeroed between the
    convolutions shown to matter) give transformers' ``get_audio_features`` rows."""
    import numpy as np
    from transformers import AutoFeatureExtractor

    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_hf_config, load_model

    full = make_full_omni_layout(tiny_omni, tmp_path / "full")
    models = [load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
              for path in (tiny_omni, full)]
    assert load_hf_config(full).architectures == ["Qwen2_5OmniForConditionalGeneration"]
    states = [model.state_dict() for model in models]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    audios = [AUDIO, make_audio(1.35, seed=3)]  # 133 and 135 frames
    features = AutoFeatureExtractor.from_pretrained(tiny_omni)(
        audios, sampling_rate=SAMPLING_RATE, padding="max_length", return_attention_mask=True, return_tensors="np")
    values = np.stack([models[1].mm_audio_values({k: v[i:i + 1] for k, v in features.items()}) for i in range(2)])
    hf = hf_thinker(tiny_omni)
    with torch.no_grad():
        got = models[1].embed_multimodal(torch.from_numpy(values))
        mask = torch.from_numpy(features["attention_mask"])
        want = hf.get_audio_features(torch.from_numpy(features["input_features"]), mask).last_hidden_state
    assert [rows.shape[0] for rows in got] == [33, 34]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=0)


async def test_speech_out_and_a_video_files_audio_are_not_built(engine, tiny_omni):
    """A request's or the engine's ``load_audio_from_video`` (decoding the track from the file), and
    ``enable_audio_output`` set over the thinker's config (``hf_overrides``), are refused by name; so is a video with
    its audio not after its vision start token or before its end token, and a use_audio_in_video that is not a bool
    (the request's or the engine's). The setting is not in an image's cache key."""
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.models.loader import build_model, load_hf_config

    with pytest.raises(InvalidRequestError, match="load_audio_from_video.*not built"):
        await engine.generate({**_prompt(*CASES[1]), "mm_processor_kwargs": {"load_audio_from_video": True}}, GREEDY)
    with pytest.raises(NotBuiltError, match="load_audio_from_video.*not built"):
        prepare(EngineConfig.create(tiny_omni, mm_processor_kwargs={"load_audio_from_video": True}))
    unmarked = {"prompt": "watch <|VIDEO|> now", "videos": [(make_video(2, 100, 80, seed=3), {"fps": 2.0})],
                "audios": [(AUDIO, SAMPLING_RATE)], "mm_processor_kwargs": {"use_audio_in_video": True}}
    with pytest.raises(InvalidRequestError, match="vision start token"):
        await engine.generate(unmarked, GREEDY)
    with pytest.raises(InvalidRequestError, match="vision_eos"):
        await engine.generate({**unmarked, "prompt": "watch <|vision_bos|><|VIDEO|> now"}, GREEDY)
    with pytest.raises(InvalidRequestError, match="use_audio_in_video"):
        await engine.generate({**unmarked, "prompt": f"watch {VIDEO_MARK}", "mm_processor_kwargs":
                               {"use_audio_in_video": "false"}}, GREEDY)
    with pytest.raises(ConfigError, match="use_audio_in_video"):
        prepare(EngineConfig.create(tiny_omni, mm_processor_kwargs={"use_audio_in_video": "false"}))
    from asyncllm.mm.inputs import MultiModalInputs

    mm = prepare(EngineConfig.create(tiny_omni)).mm
    image_ids, images = mm.encode_text(f"Look {IMAGE_MARK} at it", 0), MultiModalInputs(images=[IMAGE])
    first = mm.process(image_ids, images, "images", {"use_audio_in_video": True}).items[0]
    again = mm.process(image_ids, images, "images").items[0]
    assert first.data is not None and again.data is None and again.mm_hash == first.mm_hash  # a cache hit
    hf_config = load_hf_config(tiny_omni)
    hf_config.enable_audio_output = True
    with pytest.raises(NotBuiltError, match="enable_audio_output"):
        build_model(EngineConfig.create(tiny_omni), hf_config, torch.device("cpu"), torch.float32)
