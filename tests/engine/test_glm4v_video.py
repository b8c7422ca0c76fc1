"""Videos on GLM-4.1V / GLM-4.5V end to end: prompt ids and greedy tokens equal transformers' (its video processor
with torchvision's resize stood in, its processor's per-frame runs and timestamps, its M-RoPE positions) for a
video split across prefill chunks beside a text-only request, a video beside an image, a prefix-cache hit, vLLM's
prompt dict, chat parts and the OpenAI server's ``video_url`` (an mp4), ``limit_mm_per_prompt``, and GLM-4.5V on
two tensor-parallel ranks."""

from __future__ import annotations

import asyncio
import base64

import pytest
import pytest_asyncio
from glm4v_utils import IMAGE, IMAGE_PLACEHOLDER, make_image, make_tiny_glm4v
from glm4v_video_utils import VIDEO_PLACEHOLDER, hf_glm4v_merged_greedy, hf_glm4v_video_greedy
from qwen_vl_utils import make_mp4, make_video

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: fewer than a frame's placeholders, so each frame is split across steps."""
VIDEO = (make_video(5, 100, 80, seed=3), {"fps": 2.0})
"""5 frames at 2 fps: padded to 6, 3 temporal patches of 6 x 8 patches at 0, 1 and 2 seconds."""


@pytest.fixture(scope="module")
def glm4v(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_glm4v(tmp_path_factory.mktemp("glm4v_video"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(glm4v: str):
    async with AsyncEngine(glm4v, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET, max_num_seqs=4,
                           enable_prefix_caching=True, limit_mm_per_prompt={"image": 1, "video": 1}) as engine:
        yield engine


async def test_a_video_split_across_chunks_beside_text_matches_transformers(engine, glm4v):
    text = f"watch {VIDEO_PLACEHOLDER} now"
    prompts = [{"prompt": text, "videos": [VIDEO]}, "a text prompt with no video at all"]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    hf_prompt, hf_tokens = hf_glm4v_video_greedy(glm4v, text, [VIDEO], [], 8)
    assert outs[0].prompt_token_ids == hf_prompt
    assert hf_prompt.count(engine.tokenizer.convert_tokens_to_ids(IMAGE)) == 3 * 12 and 12 > BUDGET
    assert engine.tokenizer.decode(hf_prompt).count("<|end_of_image|>1<|begin_of_image|>") == 1  # the timestamps
    assert outs[0].outputs[0].token_ids == hf_tokens
    assert outs[1].outputs[0].token_ids == hf_glm4v_video_greedy(glm4v, prompts[1], [], [], 8)[1]
    vllm_style = await engine.generate({"prompt": text, "multi_modal_data": {"video": VIDEO}}, GREEDY)
    assert vllm_style.num_cached_tokens > 0 and vllm_style.outputs[0].token_ids == hf_tokens


async def test_a_video_beside_an_image_batched_matches_transformers(engine, glm4v):
    """transformers' model refuses the mix (it scatters image features over the video's ``<|image|>`` runs too):
    its parts are run by hand (`hf_glm4v_merged_greedy`). At 0.5 fps the timestamps are 0, 4 and 8 seconds."""
    image, slow = make_image(60, 90, seed=1), (VIDEO[0], {"fps": 0.5})
    text = f"watch {VIDEO_PLACEHOLDER} and {IMAGE_PLACEHOLDER} now"
    prompts = [{"prompt": text, "videos": [slow], "images": [image]}, {"prompt": text, "videos": [VIDEO],
                                                                        "images": [image]}]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    expected = [hf_glm4v_merged_greedy(glm4v, text, [video], [image], 8) for video in (slow, VIDEO)]
    assert [o.prompt_token_ids for o in outs] == [prompt for prompt, _ in expected]
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids  # other timestamps
    assert [o.outputs[0].token_ids for o in outs] == [tokens for _, tokens in expected]


async def test_chat_video_parts_and_the_openai_servers_video_url_match_transformers(engine, glm4v):
    from asgi_helpers import asgi_client

    from asyncllm.integrations.openai_server import create_app
    from asyncllm.mm.video_files import decode_video_file

    data = make_mp4(12, width=84, height=56)
    messages = [{"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": "what?"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    body = {"model": glm4v, "max_tokens": 8, "temperature": 0.0, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what?"}]}]}
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        response = await client.post("/v1/chat/completions", json=body)
    frames, meta = decode_video_file(data, "video", 10**6)
    hf_messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what?"}]}]
    hf_prompt, expected = hf_glm4v_video_greedy(glm4v, None, [(frames, meta)], [], 8, messages=hf_messages)
    assert frames.shape[0] == 12 and stream.collector.prompt_token_ids == hf_prompt and tokens == expected
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(expected,
                                                                                           skip_special_tokens=True)


async def test_limits_and_bad_videos_fail_their_own_request(engine):
    bad = [({"prompt": VIDEO_PLACEHOLDER * 2, "videos": [VIDEO, VIDEO]}, r"limit_mm_per_prompt\['video'\]=1"),
           ({"prompt": VIDEO_PLACEHOLDER, "videos": [VIDEO[0][:1]]}, "need at least 2"),
           ({"prompt": "no placeholder", "videos": [VIDEO]}, "0 video placeholder tokens")]
    for prompt, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            await engine.generate(prompt, GREEDY)


async def test_glm45v_video_on_two_tensor_parallel_ranks_matches_transformers(tmp_path):
    path = make_tiny_glm4v(tmp_path / "glm4v_moe", moe=True)
    text = f"clip {VIDEO_PLACEHOLDER} ok"
    async with AsyncEngine(path, tensor_parallel_size=2, disable_log_stats=True, block_size=4,
                           max_num_batched_tokens=BUDGET, limit_mm_per_prompt={"video": 1}) as engine:
        out = await engine.generate({"prompt": text, "videos": [VIDEO]}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_glm4v_video_greedy(path, text, [VIDEO], [], 8)
