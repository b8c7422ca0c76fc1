"""Videos on Qwen2-VL and Qwen2.5-VL end to end, token for token equal to transformers' model given the same pixels
(its video processor needs torchvision): time-spaced M-RoPE positions, videos split across prefill chunks beside
images and text-only requests, prefix-cache hits, vLLM's prompt dicts, chat parts, video files and the OpenAI
server's video_url parts. Qwen3-VL's per-frame timestamps: tests/engine/test_qwen_vl_engine.py (its Qwen3-VL
engine)."""

from __future__ import annotations

import asyncio
import base64

import pytest
import pytest_asyncio
from qwen_vl_utils import (
    IMAGE_PLACEHOLDER,
    VIDEO_PAD,
    VIDEO_PLACEHOLDER,
    hf_qwen_vl_greedy,
    hf_qwen_vl_video_greedy,
    make_image,
    make_mp4,
    make_tiny_qwen_vl,
    make_video,
    video_patches_of,
)

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8


@pytest.fixture(scope="module")
def qwen25_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl_video"), version="2.5")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(qwen25_vl: str):
    async with AsyncEngine(qwen25_vl, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True, limit_mm_per_prompt={"video": 1}) as engine:
        yield engine


async def test_a_video_and_an_image_split_across_chunks_beside_text_match_transformers(engine, qwen25_vl):
    """0.5 fps: 4 seconds a temporal patch, 16 positions apart on the time axis (tokens_per_second 4), so the text
    after the video starts past its time axis."""
    video, image = (make_video(5, 100, 80, seed=3), {"fps": 0.5}), make_image(60, 90, seed=1)
    text = f"watch {VIDEO_PLACEHOLDER} and {IMAGE_PLACEHOLDER} now"
    prompts = [{"prompt": text, "videos": [video], "images": [image]}, "a text prompt with no video at all"]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate({"prompt": text, "multi_modal_data": {"video": video, "image": image}}, GREEDY)
    patches = video_patches_of(qwen25_vl, video)
    hf_tokens = hf_qwen_vl_video_greedy(qwen25_vl, outs[0].prompt_token_ids, [patches], [image], 8, [4.0])
    assert outs[0].prompt_token_ids.count(engine.tokenizer.convert_tokens_to_ids(VIDEO_PAD)) == 3 * 4 * 3 > BUDGET
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_qwen_vl_greedy(qwen25_vl, prompts[1], [], 8)[1]]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens
    faster = await engine.generate({"prompt": text, "videos": [(video[0], {"fps": 4.0})], "images": [image]}, GREEDY)
    assert faster.prompt_token_ids == outs[0].prompt_token_ids and faster.num_cached_tokens <= 8  # timing: a new key
    assert faster.outputs[0].token_ids == hf_qwen_vl_video_greedy(qwen25_vl, faster.prompt_token_ids, [patches],
                                                                  [image], 8, [0.5])


async def test_chat_video_parts_and_the_openai_servers_video_url_match_transformers(engine, qwen25_vl):
    from asgi_helpers import asgi_client
    from asyncllm.integrations.openai_server import create_app

    from asyncllm.mm.video_files import decode_video_file

    data = make_mp4(12, width=84, height=56)
    frames, meta = decode_video_file(data, "video", 10**6)
    messages = [{"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": "what?"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    body = {"model": qwen25_vl, "max_tokens": 8, "temperature": 0.0, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what?"}]}]}
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        response = await client.post("/v1/chat/completions", json=body)
    prompt_ids = stream.collector.prompt_token_ids
    seconds = 2 / meta["fps"]  # every frame taken: 12 frames at 10 fps
    expected = hf_qwen_vl_video_greedy(qwen25_vl, prompt_ids, [video_patches_of(qwen25_vl, (frames, meta))], [], 8, [seconds])
    assert frames.shape[0] == 12 and tokens == expected
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(expected,
                                                                                           skip_special_tokens=True)


async def test_bad_videos_fail_their_own_request(engine):
    video = make_video(4, 56, 56, seed=4)
    bad = [({"prompt": f"{VIDEO_PLACEHOLDER}", "videos": [video, video]}, r"limit_mm_per_prompt\['video'\]=1"),
           ({"prompt": "no placeholder", "videos": [video]}, "0 video placeholder tokens"),
           ({"prompt": VIDEO_PLACEHOLDER, "videos": [video[..., 0]]}, r"\[T, H, W, 3\] uint8"),
           ({"prompt": VIDEO_PLACEHOLDER, "videos": [(video, {"do_sample_frames": True})]}, "sampling frames"),
           ({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"audio": [b"x"]}}, "takes no audios")]
    for prompt, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            await engine.generate(prompt, GREEDY)
    ok = await engine.generate({"prompt": VIDEO_PLACEHOLDER, "videos": [video]}, GREEDY)
    assert len(ok.outputs[0].token_ids) == 8


async def test_a_video_whose_time_positions_pass_the_rotary_table_fails_only_its_request(qwen25_vl):
    """A low frame rate spaces a video's temporal patches ``tokens_per_second x 2 / fps`` positions apart (8 / fps
    here); past the rotary table (max(max_position_embeddings, max_model_len) = 1024 rows) its prompt, or its
    decoding up to max_tokens, would index outside it: that request fails (until 2026-12-07 an IndexError in the
    worker, restarted until the engine died). One that fits is served as transformers computes it."""
    video = make_video(4, 56, 56, seed=5)
    async with AsyncEngine(qwen25_vl, disable_log_stats=True, block_size=4, max_num_seqs=2,
                           max_worker_restarts=0) as engine:
        with pytest.raises(InvalidRequestError, match="past the 1024 rows of the model's rotary table"):
            await engine.generate({"prompt": VIDEO_PLACEHOLDER, "videos": [(video, {"fps": 0.001})]}, GREEDY)
        fits = {"prompt": VIDEO_PLACEHOLDER, "videos": [(video, {"fps": 0.01})]}  # 800 positions apart
        with pytest.raises(InvalidRequestError, match="rotary table"):
            await engine.generate(fits, SamplingParams(max_tokens=300, temperature=0.0))
        out = await engine.generate(fits, GREEDY)
        ok = await engine.generate({"prompt": VIDEO_PLACEHOLDER, "videos": [video]}, GREEDY)
    patches = video_patches_of(qwen25_vl, (video, {"fps": 0.01}))
    assert out.outputs[0].token_ids == hf_qwen_vl_video_greedy(qwen25_vl, out.prompt_token_ids, [patches], [], 8,
                                                               [200.0])
    assert len(ok.outputs[0].token_ids) == 8


async def test_qwen2_vl_video_from_a_file_matches_transformers(tmp_path_factory):
    """Qwen2-VL: temporal patches one position apart; the file's frames sampled (media_io_kwargs num_frames)."""
    from asyncllm.mm.video_files import decode_video_file

    path = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_vl_video"), version="2")
    data, text = make_mp4(30, width=112, height=56), f"clip: {VIDEO_PLACEHOLDER} ok"
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=2, media_io_kwargs={"video": {"num_frames": 6}}) as engine:
        out = await engine.generate({"prompt": text, "multi_modal_data": {"video": data}}, GREEDY)
    frames, meta = decode_video_file(data, "video", 10**6, num_frames=6)
    assert meta["frames_indices"] == [0, 5, 11, 17, 23, 29]  # vLLM's truncated linspace
    expected = hf_qwen_vl_video_greedy(path, out.prompt_token_ids, [video_patches_of(path, (frames, meta))], [], 8, [1.0])
    assert out.outputs[0].token_ids == expected


async def test_a_model_without_videos_refuses_them(tmp_path):
    from mm_utils import make_tiny_llava
    from transformers import AutoConfig, AutoTokenizer

    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import ConfigError
    from asyncllm.mm.inputs import MultiModalInputs
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.llava import LlavaForConditionalGeneration

    path = make_tiny_llava(tmp_path / "llava")
    mm = MultiModalProcessor(path, AutoConfig.from_pretrained(path), LlavaForConditionalGeneration,
                             AutoTokenizer.from_pretrained(path), 0, 10**6)
    with pytest.raises(InvalidRequestError, match="takes no videos"):
        mm.process([5, 6], MultiModalInputs(videos=[make_video(2, 8, 8, 0)]), "prompt.images")
    with pytest.raises(ConfigError, match="limit_mm_per_prompt.video"):
        prepare(EngineConfig.create(path, limit_mm_per_prompt={"video": 1}))
