"""Mllama's pieces without an engine: which tokens see which images (transformers' processor's rule), the prefix
item that keys the blocks before the first image by every image, the KV-cache layers, the refusals, the memory an
image's cross-attention states take and the KV budget keeps for them, how long a row keeps them, the step's mask,
the attention over the grouped heads, and which vision states the intermediate layers' indices pick."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from asyncllm.attention.selector import get_attention_backend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kv.hashing import extend_block_hashes
from asyncllm.models.layers import TensorParallel
from asyncllm.models.mllama import MllamaForConditionalGeneration, image_spans, image_state_bytes
from asyncllm.models.vision_language import image_limit
from asyncllm.protocol import MultiModalItem
from asyncllm.workers.mm_runner import request_states_reserve

IMAGE = 9


@pytest.mark.parametrize("tokens", [
    [1, IMAGE, 2, 3],                              # one image
    [1, 2, IMAGE, 3, IMAGE, 4, 5],                 # two apart: the first until the second
    [IMAGE, IMAGE, 2, 3, IMAGE, 4],                # a run of two, then one
    [1, IMAGE, 2, IMAGE, IMAGE, 3],                # one, then a run of two at the end
    [IMAGE, 1, IMAGE, IMAGE, IMAGE],               # the prompt ends in a run
])
def test_image_spans_follow_the_processor(tokens):
    """Each image's [start, end) equals transformers' ``get_cross_attention_token_mask``; an end at the prompt's
    length (the spans generated tokens see too) is None."""
    from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

    expected = [(start, None if end in (-1, len(tokens)) else end)
                for start, end in get_cross_attention_token_mask(tokens, IMAGE)]
    offsets = [i for i, token in enumerate(tokens) if token == IMAGE]
    assert image_spans(offsets, len(tokens)) == expected


def _image(mm_hash: str, offset: int) -> MultiModalItem:
    return MultiModalItem(mm_hash, offset, 1, b"\0" * 4, [1])


def test_the_tokens_before_the_first_image_are_keyed_by_every_image():
    """A prompt with text before its first image gets a first item over that text whose key names all its images:
    the first blocks' hashes differ when any image differs, though the images sit in later blocks; a prompt that
    starts with its image needs none."""
    tokens = list(range(12))

    def hashes(images: list[MultiModalItem]) -> list[bytes]:
        items = MllamaForConditionalGeneration.mm_prompt_items(None, tokens, images)
        out: list[bytes] = []
        extend_block_hashes(out, tokens, 4, 3, None, items)
        return out

    same = hashes([_image("a", 8), _image("b", 10)])
    other = hashes([_image("a", 8), _image("c", 10)])
    assert same == hashes([_image("a", 8), _image("b", 10)])
    assert same[0] != other[0] and same[1] != other[1]
    items = MllamaForConditionalGeneration.mm_prompt_items(None, tokens, [_image("a", 8)])
    assert (items[0].offset, items[0].length) == (0, 8) and not MllamaForConditionalGeneration.mm_cross_item(items[0])
    assert MllamaForConditionalGeneration.mm_prompt_items(None, tokens, [_image("a", 0)]) == [_image("a", 0)]


def test_cross_attention_layers_take_no_kv_cache_layer():
    text = SimpleNamespace(num_hidden_layers=40, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38])
    assert MllamaForConditionalGeneration.kv_cache_layers(text) == 32


def test_a_tensor_parallel_size_that_splits_a_kv_head_is_refused_by_name():
    """The tiny decoder's 2 KV heads split over 2 ranks (the engine test) but not over 4 (a cross-attention KV head
    is not replicated)."""
    from mllama_utils import tiny_mllama_config

    backend = get_attention_backend(None, torch.device("cpu"), torch.float32)
    with pytest.raises(NotBuiltError, match="tensor_parallel_size=4 .*Mllama's 2 cross-attention KV heads over 4 ranks"):
        MllamaForConditionalGeneration(tiny_mllama_config(), dtype=torch.float32, tp=TensorParallel(0, 4),
                                       attn_backend=backend, max_position=64)


def _config_11b() -> SimpleNamespace:
    vision = SimpleNamespace(max_num_tiles=4, image_size=560, patch_size=14)
    text = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38])
    return SimpleNamespace(vision_config=vision, text_config=text)


def test_an_images_cross_attention_states_take_210_mb_on_11b():
    """8 layers x K and V x 4 tiles of 1601 rows x 8 KV heads of 128 x 2 bytes; half of it per rank at TP=2."""
    assert image_state_bytes(_config_11b(), 1, torch.bfloat16) == 8 * 2 * 6404 * 8 * 128 * 2 == 209_846_272
    assert image_state_bytes(_config_11b(), 2, torch.bfloat16) == 209_846_272 // 2


class _Model:
    mm_default_image_limit = MllamaForConditionalGeneration.mm_default_image_limit
    image_state_bytes = 2**20


def _config(max_num_seqs: int, limits: dict[str, int] | None) -> SimpleNamespace:
    return SimpleNamespace(max_num_seqs=max_num_seqs, multimodal_config=SimpleNamespace(limit_mm_per_prompt=limits))


def test_the_kv_budget_keeps_every_seats_images_cross_attention_states():
    """Every seat of max_num_seqs may hold limit_mm_per_prompt's images (one when unset): their states are kept out
    of the KV cache's budget; over half of it is refused, naming max_num_seqs and how many seats fit."""
    assert image_limit(MllamaForConditionalGeneration, None) == 1
    assert image_limit(MllamaForConditionalGeneration, {"image": 3}) == 3
    assert request_states_reserve(_Model(), _config(8, None), 2**30) == 8 * 2**20
    assert request_states_reserve(_Model(), _config(8, {"image": 3}), 2**30) == 24 * 2**20
    assert request_states_reserve(object(), _config(8, None), 2**30) == 0  # a model without such states
    with pytest.raises(ConfigError, match="max_num_seqs.*at most 170 .* 3 MB"):
        request_states_reserve(_Model(), _config(256, {"image": 3}), 2**30)


# ---- the cross-attention states' life, the step's mask, the attention, the vision encoder's intermediate layers
def _image_item(mm_hash: str, offset: int, aspect_ratio_id: int, pixels: int = 0) -> MultiModalItem:
    """An image item as `mm_pixel_values` lays it out: its aspect ratio id, then ``pixels`` random values."""
    data = np.concatenate([[aspect_ratio_id], np.random.default_rng(offset).standard_normal(pixels)])
    return MultiModalItem(mm_hash, offset, 1, data.astype(np.float32).tobytes(), [1 + pixels], "float32")


def test_a_rows_cross_attention_states_live_as_long_as_its_request(tmp_path):
    """Through the model runner (random weights): the states go when their request finishes (their memory freed,
    the step's plan holding none), is preempted and resumes in another row, or is sent again as new; a text-only
    request frees nothing; a reused row's stale states are dropped before the new ones are made; a sleep drops all."""
    from mllama_utils import TILE, tiny_mllama_config

    from asyncllm.config import EngineConfig
    from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
    from asyncllm.sampling import SamplingParams
    from asyncllm.workers.model_runner import ModelRunner

    tiny_mllama_config().save_pretrained(tmp_path)
    runner = ModelRunner(EngineConfig.create(str(tmp_path), max_model_len=64, block_size=4, max_num_seqs=4,
                                             max_num_batched_tokens=64, device="cpu", dtype="float32",
                                             load_format="dummy"), rank=0, tp_size=1, device=torch.device("cpu"))
    runner.load_model()
    runner.init_cache(40)
    model, steps = runner.model, iter(range(100))
    states = model.cross_states
    at_projection: list[list[int]] = []
    project = model._cross_layers()[0].cross_attn.project
    model._cross_layers()[0].cross_attn.project = lambda rows: at_projection.append(sorted(states.rows)) or project(rows)

    def new(req_id: str, block: int, seed: int | None = None) -> NewRequestData:
        items = [] if seed is None else [_image_item(f"i{seed}", 1, 1, 4 * 3 * TILE * TILE)]
        return NewRequestData(req_id, [5, 512 if items else 6, 7, 8], 4, SamplingParams(temperature=0.0), [block], 0,
                              mm_items=items)

    def step(news: list[NewRequestData], finished: tuple[str, ...] = (), preempted: tuple[str, ...] = ()) -> None:
        runner.execute_model(SchedulerOutput(next(steps), news, CachedRequestData(), {n.req_id: 4 for n in news},
                                             4 * len(news), list(finished), list(preempted)))

    def rows_of(*req_ids: str) -> list[int]:
        return sorted(runner.input_batch.requests[req_id].row for req_id in req_ids)

    step([new("a", 0, 1), new("t", 1), new("b", 2, 2)])
    assert sorted(states.rows) == rows_of("a", "b") == [0, 2]
    freed = weakref.ref(states.rows[0].keys[0])
    step([new("c", 3, 3)], finished=("a", "t"))  # c takes the text-only request's row
    assert freed() is None and sorted(states.rows) == rows_of("b", "c") == [1, 2]
    assert at_projection[-1] == [2]  # a's states were gone before c's were made
    step([new("d", 4), new("b", 5, 2)], preempted=("b",))  # b resumes in row 0; d (text) takes its row 2
    assert sorted(states.rows) == rows_of("b", "c") == [0, 1]
    step([new("c", 6, 3)])  # sent again as new (no preemption first): its old states go before the new are made
    assert at_projection[-1] == [0] and sorted(states.rows) == rows_of("b", "c") == [0, 1]
    states.rows[3] = states.rows[0]  # stale states in the row e is about to take
    step([new("e", 7, 4)])
    assert at_projection[-1] == [0, 1] and sorted(states.rows) == rows_of("b", "c", "e") == [0, 1, 3]
    last = weakref.ref(states.rows[3].keys[0])
    step([], finished=("c", "e"))  # no forward: the last step's plan must not keep e's states
    assert sorted(states.rows) == [0] and last() is None
    runner.mm_runner.forget_encoder_outputs()  # workers/sleep.py's and new weights' path
    assert states.rows == {}


def test_a_steps_mask_is_built_on_the_device_from_the_requests_spans(monkeypatch):
    """The images' spans and rows go to the device when the request starts; a step's ``[tokens, rows]`` mask is
    built there (no host array per step): a token before the first image sees every row (its MLP dropped), a 2-tile
    image's tokens its 2 tiles' rows, the last image's tokens (and the generated ones) its 1 tile's."""
    from mllama_utils import tiny_mllama_config

    from asyncllm.attention.metadata import CrossImages
    from asyncllm.models.mllama import CrossImageStates

    states, per_image = CrossImageStates(tiny_mllama_config().vision_config), 4 * 17
    keys = [torch.zeros(2 * per_image, 2, 16)]
    states.start(0, [_image_item("x", 1, 2), _image_item("y", 4, 1)], 6, keys, keys)
    request = states.rows[0]
    assert all(isinstance(t, torch.Tensor) for t in (request.starts, request.ends, request.row_image))
    monkeypatch.setattr(torch, "from_numpy", lambda array: pytest.fail("a host array in the step's plan"))
    states.begin(CrossImages([], [(0, 2, 8, 0)]), 10, torch.device("cpu"), torch.float32)
    _, _, planned, mask = states.step.spans[0]
    expected = torch.zeros(8, 2 * per_image, dtype=torch.bool)
    expected[0] = True
    expected[1:4, : 2 * 17] = True
    expected[4:, per_image : per_image + 17] = True
    assert planned is request and torch.equal(mask, expected)
    assert states.step.sees_image.flatten().tolist() == [0, 0, 0] + [1] * 7
    with _LargestStorage() as largest:  # a bool gather: no float ``[tokens, rows]`` product (200 MB at 8k tokens)
        request.visible(torch.arange(8))
    assert largest.largest <= 8 * 2 * per_image


class _LargestStorage(TorchDispatchMode):
    """The bytes of the largest storage any op returns while it is on."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


def test_cross_attention_reads_the_kv_heads_without_copying_them():
    """Each KV head serves its 2 query heads as repeated K/V would (transformers' repeat_kv), yet no op makes a
    K/V-sized copy (per request, per layer, per step)."""
    from mllama_utils import tiny_mllama_config

    backend = get_attention_backend(None, torch.device("cpu"), torch.float32)
    model = MllamaForConditionalGeneration(tiny_mllama_config(), dtype=torch.float32, tp=TensorParallel(0, 1),
                                           attn_backend=backend, max_position=64)
    attention = model._cross_layers()[0].cross_attn
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 16, generator=generator)
    key, value = (torch.randn(512, 2, 16, generator=generator) for _ in range(2))
    mask = torch.rand(3, 512, generator=generator) > 0.3
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), *(t.repeat_interleave(2, dim=1).transpose(0, 1) for t in (key, value)),
        attn_mask=mask)
    with _LargestStorage() as storage:
        out = attention._attend(query, key, value, mask)
    torch.testing.assert_close(out, expected.transpose(0, 1), atol=1e-6, rtol=0)
    assert storage.largest < 2 * key.nbytes  # repeated K or V would take 2x


def test_the_vision_encoders_intermediate_index_i_is_what_layer_i_takes():
    """``intermediate_layers_indices`` [0, 1] join each row with the input of local layer 0 (the embeddings) and of
    layer 1, as Meta's reference and vLLM do (transformers 5 takes the layers' outputs: docs/multimodal.md)."""
    from mllama_utils import TILE, tiny_mllama_config

    from asyncllm.models.mllama_vision import MllamaVisionModel

    config = tiny_mllama_config().vision_config
    config.intermediate_layers_indices = [0, 1]
    torch.manual_seed(0)
    vision = MllamaVisionModel(config, torch.float32)
    inputs: list[torch.Tensor] = []
    for layer in vision.transformer.layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    out = vision(torch.randn(1, 4, 3, TILE, TILE), torch.tensor([2]))
    width = config.hidden_size
    joined = out[..., width:].reshape(1, 4, 17, width, 2)  # each feature's value at each index, interleaved
    for j, state in enumerate(inputs):
        assert torch.equal(joined[..., j], state.view(1, 4, 24, width)[:, :, :17])  # 16 patches + the class row
    assert not torch.equal(inputs[0], inputs[1])
