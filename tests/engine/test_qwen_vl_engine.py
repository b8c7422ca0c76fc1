"""Qwen2.5-VL end to end (and Qwen3.5's adapters): M-RoPE positions and native-resolution images, token for token
equal to transformers with images split across prefill chunks, prefix-cache hits, batches, chat; the other versions
(Qwen2-VL, Qwen3-VL, Qwen3.5) and tensor parallelism in tests/engine/test_qwen_vl_versions_engine.py."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from engine_helpers import assert_chat_image_part_equals_transformers
from qwen_vl_utils import IMAGE_PAD, IMAGE_PLACEHOLDER, hf_qwen_vl_greedy, make_image, make_tiny_qwen_vl

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: fewer than most images' placeholders, so images are split across steps."""


@pytest.fixture(scope="module")
def qwen25_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"), version="2.5")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(qwen25_vl: str):
    async with AsyncEngine(qwen25_vl, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True, enable_lora=True, max_lora_rank=4) as engine:
        yield engine  # requests without an adapter run the base model exactly


async def test_one_image_matches_transformers_with_the_image_split_across_chunks(engine, qwen25_vl):
    image = make_image(120, 90, seed=1)
    text = f"Describe {IMAGE_PLACEHOLDER} please"
    out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_qwen_vl_greedy(qwen25_vl, text, [image], 8)
    assert out.prompt_token_ids == hf_prompt
    pad = engine.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert hf_prompt.count(pad) > BUDGET
    assert out.outputs[0].token_ids == hf_tokens
    ids = engine.tokenizer(text)["input_ids"]  # one placeholder, expanded by the engine
    vllm_style = await asyncio.gather(  # vLLM's prompt dicts: multi_modal_data / multi_modal_uuids
        engine.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY),
        engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]},
                         "multi_modal_uuids": {"image": ["photo-1"]}}, GREEDY))
    assert [o.outputs[0].token_ids for o in vllm_style] == [hf_tokens, hf_tokens]
    with pytest.raises(InvalidRequestError, match="takes no audios"):
        await engine.generate({"prompt": text, "multi_modal_data": {"audio": [image]}}, GREEDY)
    length = engine.config.max_model_len  # the image's placeholders count: expanded, the prompt fills it
    filler = [ids[0]] * (length - len(out.prompt_token_ids))
    with pytest.raises(InvalidRequestError, match=f"However, your request has {length} input tokens") as info:
        await engine.generate({"prompt_token_ids": filler + ids, "multi_modal_data": {"image": image}}, GREEDY)
    assert info.value.code == "context_length_exceeded"


async def test_images_of_different_sizes_in_a_batch_with_text_and_a_prefix_hit_match_transformers(engine, qwen25_vl):
    images = [make_image(60, 200, seed=2), make_image(150, 60, seed=3)]
    text = f"{IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and the end"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image at all",
               {"prompt": text, "images": images}]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[0], GREEDY)  # its prefix, images included, from the cache
    _, hf_tokens = hf_qwen_vl_greedy(qwen25_vl, text, images, 8)
    _, hf_text = hf_qwen_vl_greedy(qwen25_vl, prompts[1], [], 8)
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_text, hf_tokens]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens


async def test_chat_messages_with_image_parts_match_transformers(engine, qwen25_vl):
    await assert_chat_image_part_equals_transformers(
        engine, make_image(90, 90, seed=5), lambda *args, **kwargs: hf_qwen_vl_greedy(qwen25_vl, *args, **kwargs))


async def test_a_string_chat_writes_each_images_placeholder_text_as_vllm(engine, qwen25_vl):
    """chat_template_content_format="string" with an image part: vLLM's placeholder string
    (``<|vision_start|><|image_pad|><|vision_end|>``) and a newline ahead of the text, unless the text holds it
    already; prompt ids and tokens equal transformers' over that text. More placeholders than images is refused."""
    image = make_image(60, 60, seed=7)
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    part = {"type": "image_url", "image_url": {"url": image}}

    def chat(text: str):
        return engine.chat([{"role": "user", "content": [part, {"type": "text", "text": text}]}], GREEDY,
                           chat_template=template, chat_template_content_format="string")

    for text, written in (("what?", f"{IMAGE_PLACEHOLDER}\nwhat?"), (f"a {IMAGE_PLACEHOLDER} b", None)):
        stream = chat(text)
        tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
        hf_prompt, hf_tokens = hf_qwen_vl_greedy(qwen25_vl, f"user: {written or text}\n", [image], 8)
        assert (stream.collector.prompt_token_ids, tokens) == (hf_prompt, hf_tokens)
    with pytest.raises(InvalidRequestError, match="holds 2 .* placeholders but the message has 1"):
        [d async for d in chat(IMAGE_PLACEHOLDER * 2)]


async def test_a_requests_mm_processor_kwargs_bound_its_image_and_key_it_apart(engine, qwen25_vl):
    image, text = make_image(200, 150, seed=16), f"small {IMAGE_PLACEHOLDER} please"
    small = {"max_pixels": 28 * 28 * 6}
    default, bounded = await asyncio.gather(
        engine.generate({"prompt": text, "images": [image]}, GREEDY),
        engine.generate({"prompt": text, "images": [image], "mm_processor_kwargs": small}, GREEDY))
    pad = engine.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert bounded.prompt_token_ids.count(pad) <= 6 < default.prompt_token_ids.count(pad)
    assert bounded.outputs[0].token_ids == hf_qwen_vl_greedy(qwen25_vl, text, [image], 8, processor_kwargs=small)[1]
    with pytest.raises(InvalidRequestError, match="prompt.mm_processor_kwargs"):
        await engine.generate({"prompt": text, "images": [image], "mm_processor_kwargs": {"max_pixel": 9}}, GREEDY)


async def test_mm_processor_kwargs_bound_an_image_and_an_unknown_key_is_refused(qwen25_vl):
    from PIL import Image

    from asyncllm.errors import ConfigError
    from asyncllm.mm.processor import load_image_processor

    image = Image.new("RGB", (400, 300))
    default = load_image_processor(qwen25_vl, {})(images=[image], return_tensors="np")["image_grid_thw"][0]
    bounded = load_image_processor(qwen25_vl, {"max_pixels": 28 * 28 * 4})(images=[image],
                                                                          return_tensors="np")["image_grid_thw"][0]
    assert default.prod() // 4 > 4 >= bounded.prod() // 4
    own = load_image_processor(qwen25_vl, {}).to_dict()["size"]  # the model's own bounds, repeated: no typo
    load_image_processor(qwen25_vl, {"max_pixels": own["longest_edge"], "min_pixels": own["shortest_edge"]})
    with pytest.raises(ConfigError, match="mm_processor_kwargs.max_pixel"):  # a typo changes nothing
        await AsyncEngine(qwen25_vl, mm_processor_kwargs={"max_pixel": 1000}).start()


async def test_openai_chat_completions_and_responses_take_base64_data_url_images(engine, qwen25_vl, tmp_path):
    import base64

    from asgi_helpers import asgi_client

    from asyncllm.integrations.openai_protocol import ServerLimits
    from asyncllm.integrations.openai_server import create_app

    image = make_image(90, 90, seed=5)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url, "detail": "high"}},
               {"type": "text", "text": "what is this?"}]
    body = {"model": qwen25_vl, "max_tokens": 8, "temperature": 0.0, "messages": [{"role": "user", "content": content}]}
    responses_body = {"model": qwen25_vl, "max_output_tokens": 8, "temperature": 0.0, "store": False, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                     {"type": "input_text", "text": "what is this?"}]}]}
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        ok = await client.post("/v1/chat/completions", json=body)
        response = await client.post("/v1/responses", json=responses_body)
        bounded = await client.post("/v1/chat/completions", json={**body, "mm_processor_kwargs": {"max_pixels": 3136}})
        content[0]["image_url"]["url"] = "https://example.com/cat.png"
        fetched = await client.post("/v1/chat/completions", json=body)
        (tmp_path / "cat.png").write_bytes(image)
        content[0]["image_url"]["url"] = str(tmp_path / "cat.png")  # a server file: never read for a client
        bare_path = await client.post("/v1/chat/completions", json=body)
    limits = ServerLimits(allowed_local_media_path=str(tmp_path))  # vLLM's --allowed-local-media-path
    async with asgi_client(create_app(engine, manage_engine=False, limits=limits)) as client:
        content[0]["image_url"]["url"] = (tmp_path / "cat.png").as_uri()
        from_file = await client.post("/v1/chat/completions", json=body)
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}]
    hf_prompt, hf_tokens = hf_qwen_vl_greedy(qwen25_vl, None, [image], 8, messages=hf_messages)
    pad = engine.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == len(hf_prompt)
    assert ok.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(hf_tokens, skip_special_tokens=True)
    assert fetched.status_code == 400 and "URLs are not fetched" in fetched.json()["error"]["message"]
    assert bare_path.status_code == 400 and "data:, http(s) or file: URL" in bare_path.json()["error"]["message"]
    assert from_file.json()["choices"][0]["message"]["content"] == ok.json()["choices"][0]["message"]["content"]
    assert bounded.json()["usage"]["prompt_tokens"] == len(hf_prompt) - hf_prompt.count(pad) + 4  # 56 x 56 pixels
    assert response.status_code == 200, response.text
    message = next(item for item in response.json()["output"] if item["type"] == "message")
    assert message["content"][0]["text"] == ok.json()["choices"][0]["message"]["content"]


async def test_limit_mm_per_prompt_fails_a_prompt_with_more_images_before_reading_them(qwen25_vl):
    from transformers import AutoConfig, AutoTokenizer

    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import ConfigError, InvalidRequestError
    from asyncllm.mm.inputs import MultiModalInputs
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(qwen25_vl)
    mm = MultiModalProcessor(qwen25_vl, AutoConfig.from_pretrained(qwen25_vl), Qwen2VLForConditionalGeneration,
                             tokenizer, 0, 10**6, max_images=1)
    ids = tokenizer(IMAGE_PLACEHOLDER * 2)["input_ids"]
    with pytest.raises(InvalidRequestError, match=r"2 images, over limit_mm_per_prompt\['image'\]=1"):
        mm.process(ids, MultiModalInputs([b"never read", b"never read"]), "prompt.images")
    assert len(mm.process(tokenizer(IMAGE_PLACEHOLDER)["input_ids"], MultiModalInputs([make_image(56, 56, 1)]),
                          "x").items) == 1
    with pytest.raises(ConfigError, match="limit_mm_per_prompt.audio.*takes no audios"):
        prepare(EngineConfig.create(qwen25_vl, limit_mm_per_prompt={"audio": 1}))
    from PIL import Image

    with pytest.raises(ConfigError, match="mm_max_image_pixels=.*PIL's decompression-bomb limit"):  # the host checks
        prepare(EngineConfig.create(qwen25_vl, mm_max_image_pixels=2 * Image.MAX_IMAGE_PIXELS + 1))
    with pytest.raises(ConfigError, match="limit_mm_per_prompt.image"):
        EngineConfig.create(qwen25_vl, limit_mm_per_prompt={"image": -1})
    assert EngineConfig.create(qwen25_vl, limit_mm_per_prompt={"image": 0, "video": 0}).multimodal_config


async def test_an_awq_checkpoint_with_the_tower_left_whole_matches_transformers_dequantized(qwen25_vl, tmp_path):
    import torch
    from int4_reference import write_int4_checkpoint
    from transformers import AutoModelForImageTextToText

    from qwen_vl_utils import hf_qwen_vl_inputs

    awq = tmp_path / "awq"
    dequantized = write_int4_checkpoint(qwen25_vl, awq, "awq", group=32, ignored=("visual",))
    image, text = make_image(100, 80, seed=8), f"see {IMAGE_PLACEHOLDER} here"
    async with AsyncEngine(str(awq), disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=2) as engine:
        out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    reference = AutoModelForImageTextToText.from_pretrained(qwen25_vl, dtype=torch.float32).eval()
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, weight in dequantized.items():  # model.layers.* in the checkpoint, model.language_model.* here
            params[name.replace("model.", "model.language_model.", 1)].copy_(weight)
        inputs = hf_qwen_vl_inputs(qwen25_vl, text, [image])
        expected = reference.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert len(dequantized) == 2 * 7  # every decoder projection was quantized
    assert out.outputs[0].token_ids == expected.tolist()


async def test_a_peft_adapter_on_the_decoder_matches_peft_with_an_image(engine, qwen25_vl, tmp_path):
    import torch
    from lora_utils import make_adapter
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText as ImageTextToText

    from asyncllm import LoRARequest
    from asyncllm.errors import InvalidRequestError
    from qwen_vl_utils import hf_qwen_vl_inputs

    decoder = make_adapter(qwen25_vl, str(tmp_path / "decoder"), 3, rank=4, alpha=8, auto_class=ImageTextToText,
                           targets=r".*language_model.*\.(q_proj|v_proj|o_proj|down_proj)")
    tower = make_adapter(qwen25_vl, str(tmp_path / "tower"), 3, rank=4, alpha=8, auto_class=ImageTextToText,
                         targets=r".*visual.*\.(qkv|down_proj)")
    image, text = make_image(100, 80, seed=9), f"see {IMAGE_PLACEHOLDER} here"
    prompt = {"prompt": text, "images": [image]}
    base, out = await asyncio.gather(engine.generate(prompt, GREEDY), engine.generate(
        prompt, GREEDY, lora_request=LoRARequest("decoder", 1, decoder)))
    with pytest.raises(InvalidRequestError, match="adapters on the vision tower are not built"):
        await engine.generate(prompt, GREEDY, lora_request=LoRARequest("tower", 2, tower))
    reference = PeftModel.from_pretrained(ImageTextToText.from_pretrained(qwen25_vl, dtype=torch.float32),
                                          decoder).eval()
    inputs = hf_qwen_vl_inputs(qwen25_vl, text, [image])
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert out.outputs[0].token_ids == expected.tolist() != base.outputs[0].token_ids


@pytest.mark.parametrize("version", ["3.5", "3.5-moe", "3-moe"])
async def test_a_qwen3_5_adapter_on_the_hybrid_decoder_matches_peft_with_an_image(tmp_path_factory, version: str):
    """Qwen3.5's decoder adapted in its gated attention's q_proj (queries and gates), its Gated DeltaNet's
    in_proj_qkv and out_proj, and its MLP's down_proj (Qwen3.5-MoE: its experts' stacked parameters too, which
    live under the image-text model's ``language_model``; Qwen3-VL-MoE: its attention's q_proj and its experts),
    with an image, beside the base model in one batch."""
    import torch
    from lora_utils import make_adapter
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText as ImageTextToText

    from asyncllm import LoRARequest
    from qwen_vl_utils import hf_qwen_vl_inputs

    path = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_5_lora"), version=version)
    experts = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} if "moe" in version else {}
    adapter = make_adapter(path, str(tmp_path_factory.mktemp("adapter")), 5, rank=4, alpha=8,
                           auto_class=ImageTextToText,
                           targets=r".*language_model.*\.(q_proj|in_proj_qkv|out_proj|down_proj)", **experts)
    image, text = make_image(90, 70, seed=15), f"see {IMAGE_PLACEHOLDER} here"
    prompt = {"prompt": text, "images": [image]}
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET, max_num_seqs=2,
                           enable_lora=True, max_lora_rank=4) as engine:
        base, out = await asyncio.gather(engine.generate(prompt, GREEDY), engine.generate(
            prompt, GREEDY, lora_request=LoRARequest("decoder", 1, adapter)))
    reference = PeftModel.from_pretrained(ImageTextToText.from_pretrained(path, dtype=torch.float32), adapter).eval()
    inputs = hf_qwen_vl_inputs(path, text, [image])
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert out.outputs[0].token_ids == expected.tolist() != base.outputs[0].token_ids


async def test_an_fp8_compressed_tensors_checkpoint_matches_transformers_with_an_image(qwen25_vl, tmp_path):
    """llm-compressor's FP8_DYNAMIC recipe for Qwen2.5-VL (the tower ignored), written by compressed-tensors."""
    import json

    import torch
    from compressed_tensors_reference import FP8_DYNAMIC, write_ct_checkpoint
    from transformers import AutoModelForImageTextToText

    from qwen_vl_utils import hf_qwen_vl_inputs

    path = write_ct_checkpoint(qwen25_vl, tmp_path / "fp8", {"fp8": FP8_DYNAMIC}, ignore=("lm_head", "re:.*visual.*"),
                               auto_class=AutoModelForImageTextToText)
    config = json.loads((path / "config.json").read_text())  # the recipe's ignore, not the saved layout's names,
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*visual.*"]  # which transformers 5 would not match
    (path / "config.json").write_text(json.dumps(config))
    image, text = make_image(100, 80, seed=11), f"see {IMAGE_PLACEHOLDER} here"
    async with AsyncEngine(str(path), disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=2) as engine:
        out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    reference = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    inputs = hf_qwen_vl_inputs(qwen25_vl, text, [image])
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert out.outputs[0].token_ids == expected.tolist()


async def test_a_trainers_state_dict_pushed_into_the_engine_serves_like_transformers(engine, qwen25_vl):
    """RL on a VLM: an HF model's whole state_dict (transformers 5's names: model.visual.*, model.language_model.*)
    pushed with update_weights_from_tensors, tower and decoder changed; the encoder cache forgets the old features.
    The original weights are pushed back at the end (the module's engine is shared)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from qwen_vl_utils import hf_qwen_vl_inputs

    image, text = make_image(100, 80, seed=9), f"see {IMAGE_PLACEHOLDER} here"
    prompt = {"prompt": text, "images": [image]}
    before = await engine.generate(prompt, GREEDY)  # its features now cached
    model = AutoModelForImageTextToText.from_pretrained(qwen25_vl, dtype=torch.float32).eval()
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual.blocks.0." in name or "language_model.layers.1." in name:
                param.mul_(1.5)
    await engine.update_weights_from_tensors(model.state_dict())
    after = await engine.generate(prompt, GREEDY)
    await engine.update_weights_from_tensors(original)
    restored = await engine.generate(prompt, GREEDY)
    inputs = hf_qwen_vl_inputs(qwen25_vl, text, [image])
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert after.outputs[0].token_ids == expected.tolist() != before.outputs[0].token_ids
    assert restored.outputs[0].token_ids == before.outputs[0].token_ids
